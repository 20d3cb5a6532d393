"""MoE token permute / unpermute as Triton gathers, forward and backward, with the signatures of
kernels.reference.moe_permute / moe_unpermute.

The expert order itself (a stable argsort of T·k small integers, and the per-expert counts) is
computed by torch: it is index work, not bandwidth. What moves [*, D] rows is Triton, and every
kernel is a gather (no atomics, deterministic):

- permute:      out[p] = x[order[p] // k]
- its backward: dx[t] = Σ_j dy[inv[t·k + j]]              (inv: the inverse permutation)
- unpermute:    out[t] = Σ_j w[t, j] · y[inv[t·k + j]]    (same kernel as the line above)
- its backward: dy[p] = w_flat[order[p]] · dout[order[p] // k],
                dw[t, j] = ⟨dout[t], y[inv[t·k + j]]⟩

Shapes: T tokens, k experts per token (K in the kernels), P = T·k routed rows, D width,
E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniscale.kernels import reference
from omniscale.kernels.dtensor import dtensor_safe
from omniscale.kernels.triton_launch import block, jit

BLOCK_D = 1024


@jit
def _gather_rows(x_ptr, src_ptr, scale_idx_ptr, scale_ptr, out_ptr, D,
                 HAS_SCALE: tl.constexpr, BLOCK_D: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    src = tl.load(src_ptr + p).to(tl.int64)
    row = tl.load(x_ptr + src * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        row = row * tl.load(scale_ptr + tl.load(scale_idx_ptr + p)).to(tl.float32)
    tl.store(out_ptr + p * D + cols, row.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _gather_sum(y_ptr, inv_ptr, w_ptr, out_ptr, D,
                K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        src = tl.load(inv_ptr + t * K + j).to(tl.int64)
        row = tl.load(y_ptr + src * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            row = row * tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += row
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _row_dots(dout_ptr, y_ptr, inv_ptr, dw_ptr, K: tl.constexpr, D: tl.constexpr,
              BLOCK_D: tl.constexpr):
    # D is a compile-time constant (fixed per model): the interpreter cannot loop to a runtime
    # bound (numpy 2 refuses int() of its 1-element scalars).
    i = tl.program_id(0).to(tl.int64)  # = t·k + j
    src = tl.load(inv_ptr + i).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = cols < D
        a = tl.load(dout_ptr + (i // K) * D + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(y_ptr + src * D + cols, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(dw_ptr + i, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty))


def _gather(x, src, scale_idx=None, scale=None) -> torch.Tensor:
    P, D = src.numel(), x.shape[1]
    out = torch.empty(P, D, dtype=x.dtype, device=x.device)
    if P and D:
        bd = block(D, BLOCK_D)
        _gather_rows[(P, triton.cdiv(D, bd))](x, src, scale_idx if scale is not None else src,
                                              scale if scale is not None else x, out, D,
                                              HAS_SCALE=scale is not None, BLOCK_D=bd)
    return out


def _combine(y, inv_TK, weight_TK=None, dtype=None) -> torch.Tensor:
    T, K = inv_TK.shape
    D = y.shape[1]
    out = torch.empty(T, D, dtype=dtype or y.dtype, device=y.device)
    if T and D:
        bd = block(D, BLOCK_D)
        _gather_sum[(T, triton.cdiv(D, bd))](y, inv_TK, weight_TK if weight_TK is not None
                                             else inv_TK, out, D, K=K,
                                             HAS_W=weight_TK is not None, BLOCK_D=bd)
    return out


def _inverse(order_P: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order_P)
    inv[order_P] = torch.arange(order_P.numel(), device=order_P.device, dtype=order_P.dtype)
    return inv


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, order_P, topk):
        x = x_TD.contiguous()
        ctx.save_for_backward(order_P)
        ctx.topk = topk
        return _gather(x, torch.div(order_P, topk, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, dy_PD):
        (order_P,) = ctx.saved_tensors
        inv_TK = _inverse(order_P).view(-1, ctx.topk)
        return _combine(dy_PD.contiguous(), inv_TK), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_PD, order_P, weight_TK):
        y = y_PD.contiguous()
        w = weight_TK.contiguous()
        inv_TK = _inverse(order_P).view(w.shape)
        ctx.save_for_backward(y, order_P, w, inv_TK)
        return _combine(y, inv_TK, w.to(y.dtype) if w.dtype != y.dtype else w)

    @staticmethod
    def backward(ctx, dout_TD):
        y, order_P, w, inv_TK = ctx.saved_tensors
        T, K = w.shape
        dout = dout_TD.contiguous()
        dy = dw = None
        if ctx.needs_input_grad[0]:
            dy = _gather(dout, torch.div(order_P, K, rounding_mode="floor"), order_P,
                         w.to(y.dtype).reshape(-1))
        if ctx.needs_input_grad[2]:
            dw = torch.empty(T, K, dtype=w.dtype, device=w.device)
            D = y.shape[1]
            if T and D:
                _row_dots[(T * K,)](dout, y, inv_TK, dw, K=K, D=D, BLOCK_D=block(D, BLOCK_D))
            elif T:
                dw.zero_()
        return dy, None, dw


# DTensors: op by op (kernels/dtensor.py)
@dtensor_safe(fallback=reference.moe_permute)
def moe_permute(x_TD: torch.Tensor, expert_TK: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens grouped by expert: (x_sorted [T*k, D], order [T*k], counts [E]); a stable sort
    keeps each expert's tokens in order, as the reference."""
    flat = expert_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = reference.expert_counts(expert_TK, num_experts)  # no host sync (bincount syncs)
    return _Permute.apply(x_TD, order, expert_TK.shape[1]), order, counts


@dtensor_safe(fallback=reference.moe_unpermute)
def moe_unpermute(y_PD: torch.Tensor, order_P: torch.Tensor, weight_TK: torch.Tensor
                  ) -> torch.Tensor:
    """Inverse of moe_permute, combining each token's k expert outputs by routing weight."""
    return _Unpermute.apply(y_PD, order_P, weight_TK)
