"""Triton MoE permute / unpermute against the torch reference, forward and backward: on CPU
in Triton's interpreter (fp32; experts that get no token, top-1 and top-k routing, widths wider
than a block and not powers of two), and on CUDA in bf16 (gpu). The orders and counts must be
identical (same stable sort); values: fp32 1e-5 relative to the largest reference value (the
permute is exact), bf16 2e-2."""

from __future__ import annotations

import pytest
import torch

from omniscale.kernels import reference, triton_moe

pytestmark = pytest.mark.usefixtures("triton_env")


def near(got, want, tol):
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=tol * max(scale, 1.0), rtol=tol)


def check(T, topk, E, D, used_experts, device="cpu", dtype=torch.float32, tol=1e-5):
    torch.manual_seed(0)
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    experts = torch.randint(0, used_experts, (T, topk), device=device)
    weights = torch.rand(T, topk, device=device, requires_grad=True)

    xs, order, counts = triton_moe.moe_permute(x, experts, E)
    xs_ref, order_ref, counts_ref = reference.moe_permute(x, experts, E)
    assert torch.equal(order, order_ref) and torch.equal(counts, counts_ref)
    assert (counts[used_experts:] == 0).all()
    near(xs, xs_ref, tol)
    dxs = torch.randn_like(xs)
    near(torch.autograd.grad(xs, x, dxs)[0], torch.autograd.grad(xs_ref, x, dxs)[0], tol)

    y = (torch.randn_like(xs) * 2).requires_grad_()  # the experts' outputs, in expert order
    out = triton_moe.moe_unpermute(y, order, weights)
    out_ref = reference.moe_unpermute(y, order_ref, weights)
    near(out, out_ref, tol)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (y, weights), dout),
                         torch.autograd.grad(out_ref, (y, weights), dout)):
        near(got, want, tol)


@pytest.mark.parametrize("T,topk,E,D,used", [(7, 2, 6, 13, 3), (5, 1, 4, 8, 4),
                                             (9, 3, 8, 1500, 2), (1, 2, 2, 3, 1)])
def test_moe_permute_unpermute_match_reference_in_interpreter(T, topk, E, D, used):
    check(T, topk, E, D, used)


def test_moe_no_tokens():
    x = torch.randn(0, 4, requires_grad=True)
    xs, order, counts = triton_moe.moe_permute(x, torch.zeros(0, 2, dtype=torch.long), 3)
    assert xs.shape == (0, 4) and counts.tolist() == [0, 0, 0]
    out = triton_moe.moe_unpermute(xs, order, torch.zeros(0, 2))
    assert out.shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_matches_reference_on_cuda():
    check(4099, 8, 64, 2048, 60, device="cuda", dtype=torch.bfloat16, tol=2e-2)
