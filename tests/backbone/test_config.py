"""Configs and accounting: analytic counts equal the modules' real parameters; FLOPs feed the
balancer's cost model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omniscale.backbone.config import ModelConfig, MoEConfig
from omniscale.backbone.decoder import MoEDecoder
from omniscale.balancer.cost import Costs


def real_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def active_params(model: MoEDecoder) -> int:
    """Count from the module: every parameter, minus the experts a token does not use."""
    total = real_params(model)
    for layer in model.layers:
        if layer.is_moe:
            experts = layer.ffn.experts
            per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
            total -= (experts.num_experts - layer.ffn.top_k) * per_expert
    return total


VARIANTS = {
    "tiny": ModelConfig.preset("tiny"),
    "small": ModelConfig.preset("small"),
    "shared_dense_tied": dataclasses.replace(
        ModelConfig.preset("tiny"), n_layers=3, n_dense_layers=1, tie_embeddings=True,
        qk_norm=False, moe=MoEConfig(num_experts=4, top_k=1, expert_ffn_dim=64,
                                     shared_expert=True, shared_ffn_dim=96, router="sigmoid")),
    "dense": dataclasses.replace(ModelConfig.preset("tiny"), moe=None),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_counts_match_the_module(name):
    config = VARIANTS[name]
    model = MoEDecoder(config)
    assert config.param_count() == real_params(model)
    assert config.active_param_count() == active_params(model)


def test_qwen3_30b_a3b_totals():
    config = ModelConfig.preset("30b_a3b")
    assert 29.5e9 < config.param_count() < 31.5e9  # Qwen3-30B-A3B: 30.5B
    assert 3.0e9 < config.active_param_count() < 3.6e9  # 3.3B active
    assert 0.5e9 < ModelConfig.preset("1b").param_count() < 2e9


def test_cost_coefficients_match_the_balancer():
    config = ModelConfig.preset("30b_a3b")
    alpha, beta = config.cost_coefficients()
    llm = Costs.from_model_dims(*config.cost_dims()).llm
    assert (llm.alpha, llm.beta) == (alpha, beta)
    assert beta == 6 * config.n_layers * config.n_heads * config.head_dim
    # linear FLOPs: 6 x (active params without the input table, which is a lookup)
    table = config.vocab_size * config.d_model
    assert alpha == 6 * (config.active_param_count() - table - config.d_model)
    flops = config.flops_per_token(4096)
    assert flops["linear"] == alpha and flops["attention"] == beta * 4096
    # ~6 x 3.3B linear FLOPs per token at 30B-A3B
    assert 15e9 < flops["linear"] < 21e9


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="mrope_sections"):
        ModelConfig(head_dim=64, mrope_sections=(8, 8, 8))
    with pytest.raises(ValueError, match="moe.router"):
        MoEConfig(router="relu")
    with pytest.raises(KeyError, match="unknown preset"):
        ModelConfig.preset("huge")


def test_kernel_preferences_per_op():
    from omniscale.backbone.config import kernel

    config = ModelConfig.preset("tiny", kernels={"*": "compiled", "rotary": "reference"},
                                attention_backend="flex")
    assert config.kernel_backend("rms_norm") == "compiled"
    assert config.kernel_backend("rotary") == "reference"
    assert config.kernel_backend("varlen_attention") == "flex"
    assert ModelConfig.preset("tiny").kernel_backend("swiglu") is None
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(kernels={"varlen_attention": "flash"})
    with pytest.raises(ValueError, match="unknown op"):
        ModelConfig(kernels={"rmsnorm": "compiled"})
    # a backend the op lacks on the device gives the automatic choice, not the reference
    # (moe_permute has no compiled version; nothing is compiled on CUDA)
    assert kernel("moe_permute", "cpu", "compiled")._omniscale_backend == "reference"
    assert kernel("swiglu", "cuda", "compiled")._omniscale_backend == \
        kernel("swiglu", "cuda")._omniscale_backend
    assert kernel("swiglu", "cpu", "compiled")._omniscale_backend == "compiled"
