"""The eager backend (hand-written backward) against the torch reference: values and
gradients of rms_norm (2-D and per-head 3-D), add_rms_norm and rotary (1-D RoPE tables, and
tables whose halves differ, which no model builds but the reference handles), in fp32, fp64
inputs (computed in fp32, as the reference does) and bf16; moe_unpermute bit for bit."""

from __future__ import annotations

import pytest
import torch

from omniscale.kernels import eager, reference

TOL = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 2e-2}


def run(fn, inputs, seed=1):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(seed)
    torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
    return [o.detach() for o in outs], [t.grad for t in inputs if t.requires_grad]


def same(fn_eager, fn_ref, inputs, dtype):
    (y, g), (y_ref, g_ref) = run(fn_eager, inputs), run(fn_ref, inputs)
    tol = TOL[dtype]
    for got, want in zip(y + g, y_ref + g_ref):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 24), (37, 3, 24)])
def test_rms_norm_matches_reference(dtype, shape):
    torch.manual_seed(0)
    x, w = torch.randn(*shape, dtype=dtype), torch.rand(shape[-1], dtype=dtype) + 0.5
    same(eager.rms_norm, reference.rms_norm, [x, w], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_reference(dtype):
    torch.manual_seed(0)
    x, r = torch.randn(37, 24, dtype=dtype), torch.randn(37, 24, dtype=dtype)
    w = torch.rand(24, dtype=dtype) + 0.5
    same(eager.add_rms_norm, reference.add_rms_norm, [x, r, w], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("tables", ["rope", "any"])
def test_rotary_matches_reference(dtype, tables):
    torch.manual_seed(0)
    x = torch.randn(37, 3, 16, dtype=dtype)
    if tables == "rope":
        cos, sin = reference.rotary_tables(torch.arange(37) % 11, 16)
    else:  # halves that differ: the backward must pair each half with the other's table
        cos, sin = torch.randn(37, 16), torch.randn(37, 16)
    cos, sin = cos.to(dtype), sin.to(dtype)
    rot = lambda fn: (lambda x: fn(x, cos, sin))  # noqa: E731  (the tables are constants)
    same(rot(eager.rotary), rot(reference.rotary), [x], dtype)


def test_rotary_with_trainable_tables_takes_the_reference():
    x = torch.randn(5, 2, 8)
    cos = torch.rand(5, 8, requires_grad=True)
    y = eager.rotary(x, cos, torch.rand(5, 8))
    y.sum().backward()
    assert cos.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("T,K", [(37, 3), (16, 1), (0, 2)])
def test_moe_unpermute_matches_reference_exactly(dtype, T, K):
    """Same products, summed in the same order at the same precision: bit for bit."""
    torch.manual_seed(0)
    x, experts = torch.randn(T, 16, dtype=dtype), torch.randint(0, 5, (T, K))
    _, order, _ = reference.moe_permute(x, experts, 5)
    y, w = torch.randn(T * K, 16, dtype=dtype), torch.rand(T, K)
    (got, grads), (want, grads_want) = (
        run(lambda y, w: eager.moe_unpermute(y, order, w), [y, w]),
        run(lambda y, w: reference.moe_unpermute(y, order, w), [y, w]))
    assert all(torch.equal(a, b) for a, b in zip(got + grads, want + grads_want))
