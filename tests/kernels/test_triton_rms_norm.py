"""Triton RMSNorm and add+RMSNorm against the torch reference, forward and backward: on CPU in
Triton's interpreter (fp32, odd and non-power-of-two widths), and on CUDA in bf16 (gpu).

Tolerances, relative to the largest reference value: fp32 1e-5 (same math, another summation
order); bf16 2e-2 (the kernel rounds once, the reference per torch op)."""

from __future__ import annotations

import pytest
import torch

from omniscale.kernels import reference, triton_rms_norm

pytestmark = pytest.mark.usefixtures("triton_env")
SHAPES = [(1, 1), (7, 37), (3, 5, 129), (0, 16)]


def near(got, want, tol):
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=tol * max(scale, 1.0), rtol=tol)


def check(shape, eps, device="cpu", dtype=torch.float32, tol=1e-5):
    torch.manual_seed(0)
    x, res = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in "xr")
    w = torch.randn(shape[-1], device=device, dtype=dtype, requires_grad=True)
    dy, ds = torch.randn_like(x), torch.randn_like(x)

    y = triton_rms_norm.rms_norm(x, w, eps)
    y_ref = reference.rms_norm(x, w, eps)
    near(y, y_ref, tol)
    for got, want in zip(torch.autograd.grad(y, (x, w), dy),
                         torch.autograd.grad(y_ref, (x, w), dy)):
        near(got, want, tol)

    out, summed = triton_rms_norm.add_rms_norm(x, res, w, eps)
    out_ref, summed_ref = reference.add_rms_norm(x, res, w, eps)
    near(out, out_ref, tol)
    torch.testing.assert_close(summed, summed_ref, atol=0, rtol=0)
    loss, loss_ref = ((o * dy).sum() + (s * ds).sum() for o, s in
                      ((out, summed), (out_ref, summed_ref)))
    for got, want in zip(torch.autograd.grad(loss, (x, res, w)),
                         torch.autograd.grad(loss_ref, (x, res, w))):
        near(got, want, tol)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference_in_interpreter(shape):
    check(shape, eps=1e-6)


def test_add_rms_norm_only_normed_output_used():
    # The summed output unused: its gradient arrives as zeros and must not break the backward.
    x, res = torch.randn(4, 10, requires_grad=True), torch.randn(4, 10, requires_grad=True)
    w = torch.rand(10)
    out, _ = triton_rms_norm.add_rms_norm(x, res, w, 1e-5)
    gx, gr = torch.autograd.grad(out.sum(), (x, res))
    gx_ref = torch.autograd.grad(reference.add_rms_norm(x, res, w, 1e-5)[0].sum(), x)[0]
    near(gx, gx_ref, 1e-5)
    assert torch.equal(gx, gr)


def test_add_rms_norm_promotes_mixed_dtypes():
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    res = torch.randn(3, 8, requires_grad=True)
    out, summed = triton_rms_norm.add_rms_norm(x, res, torch.ones(8))
    out_ref, summed_ref = reference.add_rms_norm(x, res, torch.ones(8))
    assert out.dtype == summed.dtype == out_ref.dtype == torch.float32
    near(out, out_ref, 1e-5)
    gx, gr = torch.autograd.grad(out.sum() + summed.sum(), (x, res))
    assert gx.dtype == torch.bfloat16 and gr.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 3000)])
def test_rms_norm_matches_reference_on_cuda(shape):
    check(shape, eps=1e-6, device="cuda", dtype=torch.bfloat16, tol=2e-2)
