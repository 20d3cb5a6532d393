"""One registry for every fused op: ``kernels.get("rms_norm", device)`` picks the implementation.

Each op has a torch reference (kernels/reference.py, the CPU path and the test oracle) and may
have fast implementations (Triton; for attention torch's varlen flash kernel, flash-attn, flex
attention) that share its signature. The choice depends on the device, on what is installed,
on a config override (``prefer``) and on ``OMNISCALE_KERNELS=reference``, which forces every op
to its reference (for debugging a numerical difference). Each choice is logged once.

Implementations are named by import path so that importing the registry imports no Triton.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from typing import Callable

log = logging.getLogger(__name__)

REFERENCE = "reference"
ENV_FORCE = "OMNISCALE_KERNELS"


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _triton_ok(device_type: str) -> bool:
    # Triton runs on CUDA, and on CPU tensors only in its interpreter (tests).
    return _has("triton") and (device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def _flash_ok(device_type: str) -> bool:
    return device_type == "cuda" and _has("flash_attn")


def _varlen_ok(device_type: str) -> bool:
    # torch's own flash kernel (torch >= 2.10), Ampere or newer; an unknown GPU (none here,
    # e.g. describing the CUDA choice on a CPU machine) counts as capable.
    if device_type != "cuda" or not _has("torch.nn.attention.varlen"):
        return False
    import torch

    return not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 0)


def _flex_ok(device_type: str) -> bool:
    # CPU: forward only in torch 2.11 (no backward), so there it serves only prefer="flex".
    return device_type in ("cuda", "cpu") and _has("torch.nn.attention.flex_attention")


def _cuda(device_type: str) -> bool:
    return device_type == "cuda"


# op -> [(backend, "module:function", availability(device_type), auto(device_type))],
# fastest first; the reference is always last and always available. `auto`: whether the
# backend may be chosen without being asked for by name (`prefer`).
CANDIDATES: dict[str, list[tuple[str, str, Callable[[str], bool], Callable[[str], bool]]]] = {
    "rms_norm": [], "add_rms_norm": [], "rotary": [], "swiglu": [],
    "varlen_attention": [],
    "linear_cross_entropy": [], "moe_permute": [], "moe_unpermute": [],
}


def register(op: str, backend: str, target: str, available: Callable[[str], bool],
             auto: Callable[[str], bool] | None = None) -> None:
    """Add a fast implementation (used by kernel modules at import; tests add their own).
    `auto` (default: `available`) narrows where it is picked without `prefer` naming it."""
    CANDIDATES.setdefault(op, []).insert(0, (backend, target, available, auto or available))
    _resolve.cache_clear()


def get(op: str, device: str = "cpu", prefer: str | None = None) -> Callable:
    """The implementation of ``op`` for ``device`` (``prefer``: a backend name, or
    ``reference``; ignored when that backend is unavailable there)."""
    if op not in CANDIDATES:
        raise KeyError(f"unknown kernel {op!r} (known: {', '.join(sorted(CANDIDATES))})")
    device_type = str(device).split(":")[0]
    return _resolve(op, device_type, prefer, os.environ.get(ENV_FORCE, ""))


def backend_of(op: str, device: str = "cpu", prefer: str | None = None) -> str:
    fn = get(op, device, prefer)
    return getattr(fn, "_omniscale_backend", REFERENCE)


@functools.lru_cache(maxsize=None)
def _resolve(op: str, device_type: str, prefer: str | None, forced: str) -> Callable:
    by_name = prefer not in (None, "auto")
    choices = [] if forced == REFERENCE or prefer == REFERENCE else [
        c for c in CANDIDATES[op] if not by_name or prefer == c[0]]
    for backend, target, available, auto in choices:
        if available(device_type) and (by_name or auto(device_type)):
            module, name = target.split(":")
            fn = getattr(importlib.import_module(module), name)
            log.info("kernel %s on %s: %s (%s)", op, device_type, backend, target)
            return _tag(fn, backend)
    reference = getattr(importlib.import_module("omniscale.kernels.reference"), op)
    log.info("kernel %s on %s: torch reference%s", op, device_type,
             f" ({ENV_FORCE}={forced})" if forced else "")
    return _tag(reference, REFERENCE)


def _tag(fn: Callable, backend: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    wrapper._omniscale_backend = backend
    return wrapper


def _cpu(device_type: str) -> bool:
    return device_type == "cpu"


def _any(device_type: str) -> bool:
    return True


# Attention backends, first choice first. CUDA: "varlen", torch's own flash kernel
# (kernels/varlen.py: no mask, no compile, whatever the packed length; it hands fp32 and odd
# head dims to flex); flash-attn ("flash") when installed, chosen by prefer= (or on its own
# where torch's kernel is missing): it runs the same FlashAttention-2 algorithm, so it buys
# nothing by default over the kernel that ships with, and is tested against, the installed
# torch, and its adapter casts fp32 to bf16; else flex attention (compiled, kernels/flex.py).
# CPU: "blocked" (row-blocked matrix products, kernels/blocked_attention.py; SDPA for long
# sequences), with flex (forward only) and the SDPA reference selectable by prefer=.
register("varlen_attention", "blocked", "omniscale.kernels.blocked_attention:varlen_attention",
         _any, auto=_cpu)
register("varlen_attention", "flex", "omniscale.kernels.flex:varlen_attention", _flex_ok,
         auto=_cuda)
register("varlen_attention", "flash", "omniscale.kernels.flash:varlen_attention", _flash_ok)
register("varlen_attention", "varlen", "omniscale.kernels.varlen:varlen_attention", _varlen_ok)


def describe(device: str = "cpu", prefer: str | None = None) -> dict[str, str]:
    """The backend every op resolves to on ``device``: what the trainer prints once at start
    (resolving also logs each choice once)."""
    return {op: backend_of(op, device, prefer) for op in CANDIDATES}
