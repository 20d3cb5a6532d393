"""RMSNorm and add+RMSNorm (the pre-norm residual block's add then norm) as Triton kernels,
forward and backward, with the signatures of kernels.reference.rms_norm / add_rms_norm.

One program normalises ROWS rows; statistics in fp32 whatever the input dtype. The forward
keeps only the per-row 1/rms (4 bytes a row) for the backward, which recomputes x̂. The weight
gradient is reduced per program into a [programs, D] fp32 buffer and summed once in torch.

Shapes: T tokens (rows, any leading dims flattened), D width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniscale.kernels import eager
from omniscale.kernels.dtensor import dtensor_safe, rowwise
from omniscale.kernels.triton_launch import block, jit, warps

ROWS = 4  # rows per program: amortises loading the weight; the backward's dw partials shrink


@jit
def _fwd(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, rstd_ptr, T, D, eps,
         HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < T:
            offs = row.to(tl.int64) * D + cols
            x = tl.load(x_ptr + offs, mask=cmask, other=0.0)
            if HAS_RES:
                # Round the sum to the input dtype first, as the reference's `x + residual`.
                s = (x.to(tl.float32) + tl.load(res_ptr + offs, mask=cmask, other=0.0)
                     .to(tl.float32)).to(x.dtype)
                tl.store(sum_ptr + offs, s, mask=cmask)
                x = s
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
            tl.store(rstd_ptr + row, rstd)
            tl.store(y_ptr + offs, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=cmask)


@jit
def _bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dsum_ptr, dx_ptr, dw_ptr, T, D,
         HAS_DSUM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < T:
            offs = row.to(tl.int64) * D + cols
            x = tl.load(x_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xhat = x * rstd
            wdy = w * dy
            dw += dy * xhat
            # d/dx of x·rstd(x)·w: rstd·(w·dy − x̂·mean(w·dy·x̂))
            dx = rstd * (wdy - xhat * (tl.sum(wdy * xhat, axis=0) / D))
            if HAS_DSUM:  # the summed output's own gradient flows straight through
                dx += tl.load(dsum_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
    tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * D + cols, dw, mask=cmask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _forward(x, residual, weight, eps):
    x2 = _rows(x)
    T, D = x2.shape
    res2 = _rows(residual) if residual is not None else x2
    y = torch.empty_like(x2)
    summed = torch.empty_like(x2) if residual is not None else x2
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    if T:
        _fwd[(triton.cdiv(T, ROWS),)](x2, res2, weight.contiguous(), y, summed, rstd, T, D, eps,
                                      HAS_RES=residual is not None, ROWS=ROWS, BLOCK_D=block(D),
                                      num_warps=warps(block(D)))
    return y, summed, rstd


def _backward(dy, dsum, x2, weight, rstd):
    T, D = x2.shape
    dx = torch.empty_like(x2)
    programs = triton.cdiv(T, ROWS)
    dw = torch.zeros(max(programs, 1), D, dtype=torch.float32, device=x2.device)
    if T:
        dy2 = _rows(dy)
        dsum2 = _rows(dsum) if dsum is not None else dy2
        _bwd[(programs,)](dy2, x2, weight.contiguous(), rstd, dsum2, dx, dw, T, D,
                          HAS_DSUM=dsum is not None, ROWS=ROWS, BLOCK_D=block(D),
                          num_warps=warps(block(D)))
    return dx, dw.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x2, rstd = _forward(x, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, None, x2, weight, rstd)
        return dx.view(dy.shape), dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, summed, rstd = _forward(x, residual, weight, eps)
        ctx.save_for_backward(summed, weight, rstd)
        return y.view(x.shape), summed.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dsum):
        summed, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, dsum, summed, weight, rstd)
        dx = dx.view(dy.shape)
        return dx, dx, dw, None


# A head-sharded DTensor (TP's q/k norms) runs on its local heads: kernels/dtensor.py.
@dtensor_safe(fallback=eager.rms_norm, local=rowwise(n_rows=1))
def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / rms(x) * weight, statistics in fp32, returned in x's dtype (as the reference)."""
    return _RMSNorm.apply(x_TD, weight_D, eps)


@dtensor_safe(fallback=eager.add_rms_norm, local=rowwise(n_rows=2))
def add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor, weight_D: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over memory each way. Mixed dtypes
    (a bf16 block output onto an fp32 residual stream) promote as the reference's add does."""
    dtype = torch.promote_types(x_TD.dtype, residual_TD.dtype)
    return _AddRMSNorm.apply(x_TD.to(dtype), residual_TD.to(dtype), weight_D, eps)
