"""The kernel registry: references by default (on CPU, plain-torch backends where they beat
the reference), fast paths when available, overrides by config and by environment; the
reference attention's batching of equal-length sequences and the MoE permutation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omniscale import kernels
from omniscale.kernels import reference
from omniscale.kernels.registry import CANDIDATES, ENV_FORCE, _resolve


@pytest.fixture()
def fake_backend():
    """A 'fast' rms_norm that is available on CPU, registered for the test only."""
    saved = list(CANDIDATES["rms_norm"])
    kernels.register("rms_norm", "fake", "omniscale.kernels.reference:rms_norm",
                     lambda device: True)
    kernels.register("rms_norm", "gpu_only", "omniscale.kernels.reference:rms_norm",
                     lambda device: device == "cuda")
    yield
    CANDIDATES["rms_norm"][:] = saved
    _resolve.cache_clear()


# The CPU choices that are not the reference: plain-torch backends that beat it on CPU.
CPU_DEFAULTS = {"linear_cross_entropy": "chunked", "rms_norm": "eager", "add_rms_norm": "eager",
                "rotary": "eager", "moe_unpermute": "eager", "varlen_attention": "blocked"}


def test_every_op_has_a_working_reference():
    for op in CANDIDATES:
        assert kernels.backend_of(op, "cpu") == CPU_DEFAULTS.get(op, "reference")
        assert kernels.backend_of(op, "cpu", prefer="reference") == "reference"
        assert callable(getattr(reference, op))


def test_fast_path_chosen_when_available_and_overrides(fake_backend, monkeypatch):
    assert kernels.backend_of("rms_norm", "cpu") == "fake"  # gpu_only skipped on cpu
    assert kernels.backend_of("rms_norm", "cuda:0") == "gpu_only"
    assert kernels.backend_of("rms_norm", "cpu", prefer="reference") == "reference"
    assert kernels.backend_of("rms_norm", "cpu", prefer="gpu_only") == "reference"
    monkeypatch.setenv(ENV_FORCE, "reference")
    assert kernels.backend_of("rms_norm", "cuda") == "reference"
    x = torch.randn(3, 4)
    assert torch.equal(kernels.get("rms_norm")(x, torch.ones(4)),
                       reference.rms_norm(x, torch.ones(4)))


def test_unknown_op_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown kernel 'rmsnorm'"):
        kernels.get("rmsnorm")


def per_sequence_attention(q, k, v, cu, causal):
    """One SDPA call per sequence, zeros outside every sequence: what varlen attention is."""
    out = torch.zeros_like(q)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
            )[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bounds,total", [
    ([0, 8, 16, 24], 24),                 # one run of equal lengths: one batched call
    ([0, 5, 10, 10, 17, 24, 31, 33], 36),  # runs, an empty sequence, tokens after the last
    ([3, 9, 15], 20),                      # tokens before the first sequence
    ([0, 0], 0)])                          # an empty micro-batch
def test_varlen_attention_batches_equal_lengths_exactly(bounds, total, causal):
    torch.manual_seed(0)
    q = torch.randn(total, 4, 8, requires_grad=True)
    k, v = (torch.randn(total, 2, 8, requires_grad=True) for _ in range(2))
    cu = torch.tensor(bounds, dtype=torch.int32)
    out = reference.varlen_attention(q, k, v, cu, 8, causal=causal)
    want = per_sequence_attention(q, k, v, cu, causal)
    assert torch.equal(out, want)  # the same per-sequence math, bit for bit
    if total:
        grad = torch.randn_like(out)
        for got, exp in zip(torch.autograd.grad(out, (q, k, v), grad),
                            torch.autograd.grad(want, (q, k, v), grad)):
            assert torch.equal(got, exp)


def test_varlen_attention_stays_within_sequences():
    torch.manual_seed(0)
    q, k, v = (torch.randn(9, 4, 8) for _ in range(3))
    cu = torch.tensor([0, 4, 9])
    out = reference.varlen_attention(q, k[:, :2], v[:, :2], cu, 5)
    alone = reference.varlen_attention(q[4:], k[4:, :2], v[4:, :2], torch.tensor([0, 5]), 5)
    assert torch.allclose(out[4:], alone, atol=1e-6)  # the first sequence has no influence


def test_mrope_equals_rope_on_text_positions():
    pos = torch.arange(12)
    cos1, sin1 = reference.rotary_tables(pos, 16)
    cos3, sin3 = reference.rotary_tables(pos, 16, mrope_position_3T=torch.stack([pos] * 3),
                                         mrope_sections=(4, 2, 2))
    assert torch.allclose(cos1, cos3) and torch.allclose(sin1, sin3)


def test_moe_permute_round_trip():
    x = torch.randn(7, 5)
    experts = torch.randint(0, 4, (7, 2))
    weights = torch.rand(7, 2)
    x_sorted, order, counts = reference.moe_permute(x, experts, 4)
    assert counts.sum() == 14 and torch.all(experts.reshape(-1)[order].diff() >= 0)
    out = reference.moe_unpermute(x_sorted, order, weights)
    assert torch.allclose(out, x * weights.sum(1, keepdim=True), atol=1e-6)


def test_moe_unpermute_puts_every_row_back():
    """Row p of the expert output belongs to routing choice order[p] (token order[p] // k)."""
    torch.manual_seed(0)
    T, K, D = 9, 3, 4
    order = torch.randperm(T * K)
    y = torch.randn(T * K, D, requires_grad=True)
    w = torch.rand(T, K, requires_grad=True)
    out = reference.moe_unpermute(y, order, w)
    flat = torch.zeros(T * K, D)
    flat[order] = y.detach()
    assert torch.allclose(out, (flat.view(T, K, D) * w.detach()[..., None]).sum(1))
    out.backward(torch.ones_like(out))
    assert torch.allclose(y.grad, w.detach().reshape(-1)[order][:, None].expand(-1, D))
