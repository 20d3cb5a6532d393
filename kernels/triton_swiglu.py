"""SwiGLU, silu(gate) · up, as one elementwise Triton kernel each way, with the signature of
kernels.reference.swiglu. Eager torch makes three passes over memory forward (silu, multiply)
and more backward; here each direction reads its inputs once and writes its outputs once.
The backward recomputes sigmoid(gate) instead of saving silu(gate).

Shapes: T tokens, F the FFN width (any shape works: the kernel sees flat memory).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniscale.kernels import reference
from omniscale.kernels.dtensor import dtensor_safe
from omniscale.kernels.triton_launch import jit

BLOCK = 1024


@jit
def _fwd(g_ptr, u_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dsilu = sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + offs, (dy * u * dsilu).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * silu).to(du_ptr.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _fwd[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _bwd[(triton.cdiv(n, BLOCK),)](dy.contiguous(), gate, up, dg, du, n, BLOCK=BLOCK)
        return dg, du


@dtensor_safe(fallback=reference.swiglu)  # DTensors: op by op (kernels/dtensor.py)
def swiglu(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up in fp32, returned in gate's dtype (the reference rounds silu first)."""
    if gate_TF.shape != up_TF.shape or gate_TF.dtype != up_TF.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate_TF.shape)} {gate_TF.dtype} and up "
                         f"{tuple(up_TF.shape)} {up_TF.dtype} must match")
    return _SwiGLU.apply(gate_TF, up_TF)
