"""Registers the Triton kernels (and the CPU backends) with the kernel registry.

Imported by ``kernels/__init__.py``. It names implementations by import path only, so importing
it imports neither Triton nor torch.compile machinery; the registry imports a module when an op
is first resolved to it.

Triton is chosen on CUDA, and on CPU only under ``TRITON_INTERPRET=1`` (tests). "compiled"
(kernels/compiled.py) exists only for the ops where tools/bench/kernel_ops.py showed compile
beating eager on CPU; it is used when asked for by name (``prefer="compiled"``), never by
default, because compiling costs seconds per new shape (see README, Kernels). Plain-torch
backends that beat the reference on CPU are its default there: "chunked" (kernels/fused.py)
for linear_cross_entropy, "eager" (kernels/eager.py) for rms_norm, add_rms_norm, rotary and
moe_unpermute.
"""

from __future__ import annotations

from omniscale.kernels.registry import _any, _cpu, _triton_ok, register

TRITON_OPS = {
    "rms_norm": "omniscale.kernels.triton_rms_norm:rms_norm",
    "add_rms_norm": "omniscale.kernels.triton_rms_norm:add_rms_norm",
    "rotary": "omniscale.kernels.triton_rotary:rotary",
    "swiglu": "omniscale.kernels.triton_swiglu:swiglu",
    "linear_cross_entropy": "omniscale.kernels.triton_linear_ce:linear_cross_entropy",
    "moe_permute": "omniscale.kernels.triton_moe:moe_permute",
    "moe_unpermute": "omniscale.kernels.triton_moe:moe_unpermute",
}

# Ops where torch.compile of the reference beat eager on CPU (forward+backward), see README.
COMPILED_OPS = ("rms_norm", "add_rms_norm", "rotary", "swiglu", "moe_unpermute")

# Ops whose CPU default is kernels/eager.py (hand-written backward).
EAGER_OPS = ("rms_norm", "add_rms_norm", "rotary", "moe_unpermute")


def _never(device_type: str) -> bool:
    return False


# CPU defaults, any device by name. Registered before Triton, so that Triton comes first
# where it runs (CUDA; CPU under the interpreter, in tests).
# "chunked": the Triton path's chunked algorithm in plain torch; its cache-sized chunks beat
# the reference's whole [T, V] logits on time as well as memory (kernels/fused.py).
register("linear_cross_entropy", "chunked", "omniscale.kernels.fused:chunked_linear_cross_entropy",
         _any, auto=_cpu)
# "eager": the reference's math as one autograd node with a closed-form backward
# (kernels/eager.py).
for _op in EAGER_OPS:
    register(_op, "eager", f"omniscale.kernels.eager:{_op}", _any, auto=_cpu)
for _op, _target in TRITON_OPS.items():
    register(_op, "triton", _target, _triton_ok)
for _op in COMPILED_OPS:
    register(_op, "compiled", f"omniscale.kernels.compiled:{_op}", _cpu, auto=_never)
