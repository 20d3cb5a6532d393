"""Rotary embedding (rotate-half) as a Triton kernel, forward and backward, with the signature
of kernels.reference.rotary. The kernel reads per-token cos/sin tables, so multimodal RoPE is
covered by the tables (kernels.reference.rotary_tables with ``mrope_sections``): nothing about
the sections reaches the kernel.

The rotation is orthogonal, so the backward is the same kernel with the sine negated and the
halves' roles swapped: dx₁ = c₁·dy₁ + s₂·dy₂, dx₂ = c₂·dy₂ − s₁·dy₁.

Shapes: T tokens, H heads, K head dim (even), K/2 = half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniscale.kernels import reference
from omniscale.kernels.dtensor import dtensor_safe
from omniscale.kernels.triton_launch import block, jit, warps


@jit
def _rotate(x_ptr, cos_ptr, sin_ptr, y_ptr, H, HALF, stride_xt, stride_xh,
            BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_K)
    kmask = cols < HALF
    mask = (heads[:, None] < H) & kmask[None, :]
    row = t * 2 * HALF + cols  # this token's table entries, first half
    c1 = tl.load(cos_ptr + row, mask=kmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + row + HALF, mask=kmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + row, mask=kmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + row + HALF, mask=kmask, other=0.0).to(tl.float32)[None, :]
    offs = t * stride_xt + heads[:, None].to(tl.int64) * stride_xh + cols[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    out = t * H * 2 * HALF + heads[:, None].to(tl.int64) * 2 * HALF + cols[None, :]
    tl.store(y_ptr + out, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + out + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    T, H, K = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(T, H, K, dtype=x.dtype, device=x.device)
    if T and H:
        block_k = block(K // 2)
        block_h = max(1, min(block(H), 4096 // block_k))
        _rotate[(T, triton.cdiv(H, block_h))](x, cos, sin, y, H, K // 2, x.stride(0), x.stride(1),
                                              BACKWARD=backward, BLOCK_H=block_h, BLOCK_K=block_k,
                                              num_warps=warps(block_h * block_k))
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _apply(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _apply(dy, cos, sin, backward=True), None, None


@dtensor_safe(fallback=reference.rotary)  # DTensors: op by op (kernels/dtensor.py)
def rotary(x_THK: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with per-token cos/sin tables, computed in fp32, returned in x's dtype.
    Tables are constants here; a table that needs a gradient takes the reference path."""
    if x_THK.shape[-1] % 2:
        raise ValueError(f"rotary: head dim {x_THK.shape[-1]} must be even")
    if cos_TK.requires_grad or sin_TK.requires_grad:
        return reference.rotary(x_THK, cos_TK, sin_TK)
    return _Rotary.apply(x_THK, cos_TK.contiguous(), sin_TK.contiguous())
