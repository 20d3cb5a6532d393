"""Registers the Triton kernels (and the CPU torch.compile backend) with the kernel registry.

Imported by ``kernels/__init__.py``. It names implementations by import path only, so importing
it imports neither Triton nor torch.compile machinery; the registry imports a module when an op
is first resolved to it.

Triton is chosen on CUDA, and on CPU only under ``TRITON_INTERPRET=1`` (tests). "compiled"
(kernels/compiled.py) exists only for the ops where tools/bench/kernels.py showed compile
beating eager on CPU; it is used when asked for by name (``prefer="compiled"``), never by
default, because compiling costs seconds per new shape (see README, Kernels).
"""

from __future__ import annotations

from kernels.registry import _triton_ok, register

TRITON_OPS = {
    "rms_norm": "kernels.triton_rms_norm:rms_norm",
    "add_rms_norm": "kernels.triton_rms_norm:add_rms_norm",
    "rotary": "kernels.triton_rotary:rotary",
    "swiglu": "kernels.triton_swiglu:swiglu",
    "linear_cross_entropy": "kernels.triton_linear_ce:linear_cross_entropy",
    "moe_permute": "kernels.triton_moe:moe_permute",
    "moe_unpermute": "kernels.triton_moe:moe_unpermute",
}

# Ops where torch.compile of the reference beat eager on CPU (forward+backward), see README.
COMPILED_OPS = ("rms_norm", "add_rms_norm", "rotary", "swiglu", "moe_unpermute")


def _cpu(device_type: str) -> bool:
    return device_type == "cpu"


def _never(device_type: str) -> bool:
    return False


for _op, _target in TRITON_OPS.items():
    register(_op, "triton", _target, _triton_ok)
for _op in COMPILED_OPS:
    register(_op, "compiled", f"kernels.compiled:{_op}", _cpu, auto=_never)
# The same chunked algorithm as the Triton path in plain torch: any device, by name only
# (prefer="chunked"), e.g. to train a large vocabulary on CPU without [T, V] logits.
register("linear_cross_entropy", "chunked", "kernels.fused:chunked_linear_cross_entropy",
         lambda device_type: True, auto=_never)
