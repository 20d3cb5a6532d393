"""The kernel registry: references everywhere by default, fast paths when available,
overrides by config and by environment."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from kernels.registry import CANDIDATES, ENV_FORCE, _resolve


@pytest.fixture()
def fake_backend():
    """A 'fast' rms_norm that is available on CPU, registered for the test only."""
    saved = list(CANDIDATES["rms_norm"])
    kernels.register("rms_norm", "fake", "kernels.reference:rms_norm", lambda device: True)
    kernels.register("rms_norm", "gpu_only", "kernels.reference:rms_norm",
                     lambda device: device == "cuda")
    yield
    CANDIDATES["rms_norm"][:] = saved
    _resolve.cache_clear()


def test_every_op_has_a_working_reference():
    for op in CANDIDATES:
        assert kernels.backend_of(op, "cpu") == "reference"
        assert callable(getattr(reference, op))


def test_fast_path_chosen_when_available_and_overrides(fake_backend, monkeypatch):
    assert kernels.backend_of("rms_norm", "cpu") == "fake"  # gpu_only skipped on cpu
    assert kernels.backend_of("rms_norm", "cuda:0") == "gpu_only"
    assert kernels.backend_of("rms_norm", "cpu", prefer="reference") == "reference"
    assert kernels.backend_of("rms_norm", "cpu", prefer="gpu_only") == "reference"
    monkeypatch.setenv(ENV_FORCE, "reference")
    assert kernels.backend_of("rms_norm", "cuda") == "reference"
    x = torch.randn(3, 4)
    assert torch.equal(kernels.get("rms_norm")(x, torch.ones(4)), reference.rms_norm(x, torch.ones(4)))


def test_unknown_op_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown kernel 'rmsnorm'"):
        kernels.get("rmsnorm")


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
