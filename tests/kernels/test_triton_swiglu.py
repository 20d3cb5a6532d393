"""Triton SwiGLU against the torch reference, forward and backward: on CPU in Triton's
interpreter (fp32, odd sizes, a size that is not a multiple of the block), and on CUDA in bf16
(gpu). Tolerances, relative to the largest reference value: fp32 1e-5; bf16 2e-2 (the
reference rounds silu(gate) to bf16 before multiplying, the kernel does not)."""

from __future__ import annotations

import pytest
import torch

from omniscale.kernels import reference, triton_swiglu

pytestmark = pytest.mark.usefixtures("triton_env")


def near(got, want, tol):
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=tol * max(scale, 1.0), rtol=tol)


def check(shape, device="cpu", dtype=torch.float32, tol=1e-5):
    torch.manual_seed(0)
    g, u = (3 * torch.randn(*shape, device=device, dtype=dtype) for _ in "gu")
    g.requires_grad_(), u.requires_grad_()
    dy = torch.randn_like(g)
    y, y_ref = triton_swiglu.swiglu(g, u), reference.swiglu(g, u)
    near(y, y_ref, tol)
    for got, want in zip(torch.autograd.grad(y, (g, u), dy),
                         torch.autograd.grad(y_ref, (g, u), dy)):
        near(got, want, tol)


@pytest.mark.parametrize("shape", [(1, 1), (7, 19), (3, 5, 333), (0, 8)])
def test_swiglu_matches_reference_in_interpreter(shape):
    check(shape)


def test_swiglu_mismatched_inputs_are_an_error():
    with pytest.raises(ValueError, match="must match"):
        triton_swiglu.swiglu(torch.randn(2, 3), torch.randn(2, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_matches_reference_on_cuda():
    check((4097, 2816), device="cuda", dtype=torch.bfloat16, tol=2e-2)
