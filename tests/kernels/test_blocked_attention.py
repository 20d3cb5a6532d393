"""The CPU default causal attention (row blocks of batched matrix products, closed-form
backward) against the SDPA reference: outputs and every gradient, grouped-query heads,
sequences that end mid-block, mixed lengths, strided inputs, and the SDPA fallback (long
sequences, other dtypes, bidirectional attention)."""

from __future__ import annotations

import pytest
import torch

from omniscale.kernels import blocked_attention, reference


def run_both(bounds, total, heads, kv_heads, head_dim=8, causal=True, dtype=torch.float32,
             strided=False):
    torch.manual_seed(0)
    if strided:  # q, k, v as views of one fused projection (the encoders' layout)
        qkv = torch.randn(total, 3, heads, head_dim, dtype=dtype, requires_grad=True)
        leaves = [qkv]
        q, k, v = (t[:, :kv_heads] if i else t for i, t in enumerate(qkv.unbind(1)))
    else:
        q = torch.randn(total, heads, head_dim, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(total, kv_heads, head_dim, dtype=dtype, requires_grad=True)
                for _ in range(2))
        leaves = [q, k, v]
    cu = torch.tensor(bounds, dtype=torch.int32)
    grad = torch.randn(total, heads, head_dim, dtype=dtype)
    results = []
    for attend in (blocked_attention.varlen_attention, reference.varlen_attention):
        out = attend(q, k, v, cu, max(bounds), causal=causal)
        grads = torch.autograd.grad(out, leaves, grad) if total else []
        results.append((out, grads))
    return results


def assert_same(results, tol=1e-5):
    (out, grads), (ref_out, ref_grads) = results
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("bounds,total", [
    ([0, 96, 192], 192),                        # one run, 3 full blocks each
    ([0, 70, 140, 240, 241, 241, 300], 305),    # partial blocks, 1 token, empty, trailing
    ([5, 600, 1200], 1210),                     # rows of 64 (L > 512), leading tokens
])
def test_matches_reference(bounds, total, heads, kv_heads):
    assert_same(run_both(bounds, total, heads, kv_heads))


def test_strided_inputs_from_a_fused_projection():
    assert_same(run_both([0, 40, 80], 80, 4, 4, strided=True))


def test_float64_gradients_are_exact():
    assert_same(run_both([0, 50, 120], 120, 4, 2, dtype=torch.float64), tol=1e-10)


def test_long_or_unsupported_runs_fall_back_to_sdpa(monkeypatch):
    assert blocked_attention.fits(4, 512, 4, True, torch.float32)
    assert not blocked_attention.fits(1, blocked_attention.MAX_LEN + 1, 4, True, torch.float32)
    assert not blocked_attention.fits(4, 512, 4, True, torch.bfloat16)
    assert not blocked_attention.fits(4, 512, 4, False, torch.float32)
    assert_same(run_both([0, 40, 80], 80, 4, 2, causal=False))
    monkeypatch.setattr(blocked_attention, "MAX_LEN", 64)  # 100-token runs: SDPA; 50: blocks
    calls = []
    monkeypatch.setattr(blocked_attention, "attend_run",
                        lambda *a, **kw: calls.append(a[0].shape) or
                        blocked_attention._BlockedAttention.apply(*a, 32))
    assert_same(run_both([0, 100, 150, 200], 200, 4, 2))
    assert calls == [torch.Size([2, 50, 4, 8])]


def test_empty_micro_batch():
    (out, _), (ref, _) = run_both([0, 0], 0, 4, 2)
    assert out.shape == ref.shape == (0, 4, 8)


def test_inference_keeps_nothing_for_backward():
    q, k, v = torch.randn(64, 4, 8), torch.randn(64, 2, 8), torch.randn(64, 2, 8)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    with torch.no_grad():
        out = blocked_attention.varlen_attention(q, k, v, cu, 64)
    torch.testing.assert_close(out, reference.varlen_attention(q, k, v, cu, 64))
    assert out.grad_fn is None
