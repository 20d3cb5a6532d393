"""Eager torch with hand-written backward: the CPU default for rms_norm, add_rms_norm, rotary
and moe_unpermute. Same math and signatures as kernels/reference.py, but each op is one
autograd node whose backward is the closed-form gradient, instead of autograd through every
elementwise step of the reference (which saves more intermediates, makes more passes over
them and allocates more: on CPU every large fresh tensor also costs page faults, the
allocator does not cache). Fwd+bwd at the `small` preset's shapes, one thread: RMSNorm
~0.4-0.65× the reference's time, rotary ~0.55-0.8×, moe_unpermute ~0.7× and far fewer page faults
(tests/kernels/test_eager.py checks values and gradients against the reference).

Shape suffixes: T tokens, D width, H heads, K head dim (rotary pairs: the first half of K
rotates with the second), P = T·k routed copies, K (in moe_unpermute) routing choices.
"""

from __future__ import annotations

import torch

from omniscale.kernels import reference


class _RMSNorm(torch.autograd.Function):
    """y = x · r · w with r = rsqrt(mean(x²) + eps), in fp32; saves x·r and r.
    dx = r · (g·w − x·r · mean(g·w · x·r)), dw = Σ g · x·r."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        xr = xf * r
        ctx.save_for_backward(xr, r, weight)
        return (xr * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xr, r, weight = ctx.saved_tensors
        g = grad.float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gw = g * weight.float()
            mean = (gw * xr).mean(-1, keepdim=True)
            dx = gw.addcmul_(xr, mean, value=-1.0).mul_(r).to(grad.dtype)
        if ctx.needs_input_grad[1]:
            # summed over the leading dims in place of a reshape: a head-sharded DTensor (TP
            # q/k norms) cannot flatten them
            dw = (g * xr).sum(tuple(range(g.dim() - 1))).to(weight.dtype)
        return dx, dw, None


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _RMSNorm.apply(x_TD, weight_D, eps)


def add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor, weight_D: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x_TD + residual_TD
    return _RMSNorm.apply(summed, weight_D, eps), summed


class _Rotary(torch.autograd.Function):
    """out = x·cos + rotate_half(x)·sin, i.e. with halves x = (x1, x2), cos = (c1, c2),
    sin = (s1, s2): out = (x1·c1 − x2·s1, x2·c2 + x1·s2), computed in fp32 in place of one
    product; the gradient is the transposed rotation (g1·c1 + g2·s2, g2·c2 − g1·s1)."""

    @staticmethod
    def forward(ctx, x_THK, cos_TK, sin_TK):
        ctx.save_for_backward(cos_TK, sin_TK)
        half = x_THK.shape[-1] // 2
        xf = x_THK.float()
        cos, sin = cos_TK[:, None, :], sin_TK[:, None, :]
        out = xf * cos
        out[..., :half].addcmul_(xf[..., half:], sin[..., :half], value=-1.0)
        out[..., half:].addcmul_(xf[..., :half], sin[..., half:])
        return out.to(x_THK.dtype)

    @staticmethod
    def backward(ctx, grad_THK):
        cos_TK, sin_TK = ctx.saved_tensors
        half = grad_THK.shape[-1] // 2
        g = grad_THK.float()
        cos, sin = cos_TK[:, None, :], sin_TK[:, None, :]
        dx = g * cos
        dx[..., :half].addcmul_(g[..., half:], sin[..., half:])
        dx[..., half:].addcmul_(g[..., :half], sin[..., :half], value=-1.0)
        return dx.to(grad_THK.dtype), None, None


def rotary(x_THK: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    if cos_TK.requires_grad or sin_TK.requires_grad:  # tables are constants in every model
        return reference.rotary(x_THK, cos_TK, sin_TK)
    return _Rotary.apply(x_THK, cos_TK, sin_TK)


class _MoEUnpermute(torch.autograd.Function):
    """y_TD[t] = Σ_j weight_TK[t, j] · y_PD[inverse[t·k + j]] (inverse: the permutation
    `order` undone). The forward accumulates one routing choice j at a time over [T, D] rows
    where the reference builds [T·k, D] intermediates (the gathered rows and their weighted
    copy); the backward gathers the output gradient once into y's row order, where autograd
    through the reference also scatters into a zero-filled [T·k, D] tensor."""

    @staticmethod
    def forward(ctx, y_PD, order_P, weight_TK):
        T, K = weight_TK.shape
        inverse_TK = torch.empty_like(order_P).scatter_(
            0, order_P, torch.arange(order_P.numel(), device=order_P.device)).view(T, K)
        w_TK = weight_TK.to(y_PD.dtype)
        # products in y's dtype, summed in order in fp32 (fp64 for fp64): the reference's sum
        out_TD = None
        for j in range(K):
            term_TD = y_PD.index_select(0, inverse_TK[:, j]) * w_TK[:, j:j + 1]
            out_TD = term_TD.to(torch.promote_types(term_TD.dtype, torch.float32)) \
                if out_TD is None else out_TD.add_(term_TD)
        ctx.save_for_backward(y_PD, order_P, weight_TK)
        return out_TD.to(y_PD.dtype)

    @staticmethod
    def backward(ctx, grad_TD):
        y_PD, order_P, weight_TK = ctx.saved_tensors
        T, K = weight_TK.shape
        d_y = d_w = None
        # Row p of y is routing choice order[p]: it sees its token's gradient (gathered once,
        # in y's order), weighted by its routing weight, and its weight's gradient is the dot
        # product of the two.
        grad_PD = grad_TD.index_select(0, order_P // K)
        if ctx.needs_input_grad[2]:
            d_w_P = (grad_PD * y_PD).sum(-1)
            d_w = torch.empty_like(d_w_P).index_copy_(0, order_P, d_w_P).view(T, K) \
                .to(weight_TK.dtype)
        if ctx.needs_input_grad[0]:
            w_P = weight_TK.reshape(-1).index_select(0, order_P).to(grad_TD.dtype)
            d_y = grad_PD.mul_(w_P[:, None])
        return d_y, None, d_w


def moe_unpermute(y_PD: torch.Tensor, order_P: torch.Tensor, weight_TK: torch.Tensor
                  ) -> torch.Tensor:
    return _MoEUnpermute.apply(y_PD, order_P, weight_TK)
