"""Hugging Face configs as they ship (issue #45 item 7): the values the published Qwen3 models
set where our defaults differ -- RoPE theta 1,000,000, the norm epsilon, head dims, tied
embeddings -- reach our decoder, in transformers 4's layout (``rope_theta`` at the top level)
and transformers 5's (``rope_parameters``).

Oracles: transformers' own logits for a tiny model with those values (a theta our import
ignored would move them far past the tolerance), and the published sizes of the real models
(Qwen3-30B-A3B: 30.5B parameters, 3.3B activated -- Qwen3 technical report / model card)."""

from __future__ import annotations

import json

import pytest
import torch

from omniscale.backbone.hf import config_from_hf, from_hf
from tests.backbone.test_hf import TOL, _hf_logits, _ours_logits, _saved

transformers = pytest.importorskip("transformers")

# config.json of Qwen/Qwen3-30B-A3B (the fields the architecture reads), as published
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "attention_bias": False, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.001, "use_sliding_window": False}


def _layouts(config: dict) -> dict[str, dict]:
    """The same config as transformers 4 and 5 write it."""
    v4 = {k: v for k, v in config.items() if k != "rope_parameters"}
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    v4.update(rope_theta=theta, rope_scaling=None)
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return {"transformers-4": v4, "transformers-5": v5}


@pytest.mark.parametrize("layout", ["transformers-4", "transformers-5"])
def test_the_published_qwen3_moe_config_in_either_layout(layout):
    config = config_from_hf(_layouts(QWEN3_30B_A3B)[layout])
    assert (config.d_model, config.n_layers, config.n_heads, config.n_kv_heads,
            config.head_dim) == (2048, 48, 32, 4, 128)
    assert (config.moe.num_experts, config.moe.top_k, config.moe.expert_ffn_dim,
            config.moe.norm_topk_prob) == (128, 8, 768, True)
    assert config.rope_theta == 1e6 and config.norm_eps == 1e-6
    assert not config.tie_embeddings and config.vocab_size == 151936
    # the model card's "30.5B total, 3.3B activated" (one decimal, embeddings and head
    # counted: 3.35B by hand -- 48 x (18.9M attention + 8 x 4.7M experts + 0.26M router)
    # + 2 x 0.31B -- which the card writes as 3.3B)
    assert config.param_count() / 1e9 == pytest.approx(30.5, abs=0.05)
    assert config.active_param_count() / 1e9 == pytest.approx(3.35, abs=0.01)


@pytest.mark.parametrize("layout", ["transformers-4", "transformers-5"])
@pytest.mark.parametrize("kind", ["moe", "dense_tied"])
def test_theta_and_epsilon_of_qwen3_reach_the_logits(tmp_path, layout, kind):
    """A tiny model with Qwen3's RoPE theta (1e6, not our default 1e4) and another norm
    epsilon: our logits equal transformers' with the config.json in either layout."""
    shapes = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=256, rms_norm_eps=1e-5)
    if kind == "moe":
        cfg = transformers.Qwen3MoeConfig(**shapes, moe_intermediate_size=16, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True)
        hf = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**shapes, tie_word_embeddings=True)
        hf = transformers.Qwen3ForCausalLM(cfg)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    hf = type(hf)(hf.config)  # rebuilt: the rotary embedding reads theta when made
    hf, path = _saved(hf, tmp_path / kind)
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(_layouts(written)[layout]))
    ours, config = from_hf(path)
    assert config.rope_theta == 1e6 and config.norm_eps == 1e-5
    assert config.tie_embeddings == (kind == "dense_tied")
    gen = torch.Generator().manual_seed(2)
    ids_list = [torch.randint(0, 96, (n,), generator=gen) for n in (40, 9, 64)]
    with torch.no_grad():
        got = _ours_logits(ours.eval(), ids_list)
    want = _hf_logits(hf, ids_list)
    assert (got - want).abs().max().item() <= TOL
    # the oracle sees theta: the same weights at our default theta give other logits
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    other = type(hf)(hf.config)
    other.load_state_dict(hf.state_dict())
    assert (_hf_logits(other.eval(), ids_list) - want).abs().max().item() > 100 * TOL
