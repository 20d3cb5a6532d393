"""Attention over packed sequences: rotary / M-RoPE, qk-norm, GQA, no leakage across
sequences."""

from __future__ import annotations

import dataclasses

import torch

from omniscale.backbone.attention import Attention, rope_tables
from omniscale.backbone.config import ModelConfig


def packed(lengths):
    cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return cu, pos


def test_each_sequence_attends_only_to_itself():
    torch.manual_seed(0)
    config = ModelConfig.preset("tiny")
    attn = Attention(config).double()
    lengths = [7, 1, 12]
    cu, pos = packed(lengths)
    x = torch.randn(sum(lengths), config.d_model, dtype=torch.double)
    cos, sin = (t.double() for t in rope_tables(config, pos))
    out = attn(x, cos, sin, cu, max(lengths))
    for (s, e) in zip(cu[:-1].tolist(), cu[1:].tolist()):
        c1, p1 = packed([e - s])
        cos1, sin1 = (t.double() for t in rope_tables(config, p1))
        alone = attn(x[s:e], cos1, sin1, c1, e - s)
        torch.testing.assert_close(out[s:e], alone)


def test_causal():
    torch.manual_seed(0)
    config = ModelConfig.preset("tiny")
    attn = Attention(config)
    cu, pos = packed([10])
    cos, sin = rope_tables(config, pos)
    x = torch.randn(10, config.d_model)
    y = x.clone()
    y[6:] += 1.0  # changing later tokens leaves earlier outputs alone
    a, b = attn(x, cos, sin, cu, 10), attn(y, cos, sin, cu, 10)
    torch.testing.assert_close(a[:6], b[:6])
    assert not torch.allclose(a[6:], b[6:])


def test_mrope_text_positions_equal_rope_and_media_positions_differ():
    config = dataclasses.replace(ModelConfig.preset("tiny"), mrope_sections=(4, 6, 6))
    pos = torch.arange(9)
    cos1, sin1 = rope_tables(config, pos)
    cos3, sin3 = rope_tables(config, pos, torch.stack([pos] * 3))
    torch.testing.assert_close(cos1, cos3)
    torch.testing.assert_close(sin1, sin3)
    grid = torch.stack([torch.zeros(9, dtype=torch.long), pos // 3, pos % 3])  # a 3x3 image
    cos_img, _ = rope_tables(config, pos, grid)
    assert not torch.allclose(cos_img, cos1)


def test_flex_backend_selected_by_config_matches_reference_in_inference():
    torch.manual_seed(0)
    config = ModelConfig.preset("tiny")
    ref = Attention(config)
    flex = Attention(dataclasses.replace(config, attention_backend="flex"))
    flex.load_state_dict(ref.state_dict())
    cu, pos = packed([20, 3, 41])
    cos, sin = rope_tables(config, pos)
    x = torch.randn(64, config.d_model)
    with torch.no_grad():
        torch.testing.assert_close(flex(x, cos, sin, cu, 41), ref(x, cos, sin, cu, 41),
                                   atol=2e-6, rtol=1e-5)
