"""Hugging Face decoders imported into ours (``backbone.hf``): random tiny Qwen3-MoE and Qwen3
models built by transformers and saved with ``save_pretrained`` give, in our decoder, the
logits transformers gives (fp32) -- packed sequences against the same sequences one by one --
and the same routing per token; broken checkpoints are one line naming the file and tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniscale.backbone.hf import from_hf
from omniscale.errors import UserError

transformers = pytest.importorskip("transformers")

TOL = 1e-4
SHAPES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=128, rope_theta=10000.0)


def _moe(tmp_path, **extra):
    config = transformers.Qwen3MoeConfig(**SHAPES, moe_intermediate_size=16, num_experts=6,
                                         num_experts_per_tok=2, **extra)
    return _saved(transformers.Qwen3MoeForCausalLM(config), tmp_path / "moe")


def _dense(tmp_path, **extra):
    config = transformers.Qwen3Config(**SHAPES, **extra)
    return _saved(transformers.Qwen3ForCausalLM(config), tmp_path / "dense")


def _saved(model, path, **kw):
    torch.manual_seed(0)
    with torch.no_grad():  # HF initialises norms to 1 and q/k norms alike: perturb them all
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.ndim == 1 else 0.05).add_(1.0 if p.ndim == 1 else 0.0)
    model.eval().save_pretrained(path, **kw)
    return model, path


def _ours_logits(decoder, ids_list: list[torch.Tensor]) -> torch.Tensor:
    """Our logits for the sequences packed into one varlen batch, [sum L, V]."""
    ids_T = torch.cat(ids_list)
    lengths = [len(ids) for ids in ids_list]
    cu_S1 = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    position_ids_T = torch.cat([torch.arange(n) for n in lengths])
    hidden_TD, _ = decoder(decoder.embed_tokens(ids_T), position_ids_T, cu_S1, max(lengths))
    return decoder.logits(hidden_TD)


def _hf_logits(model, ids_list: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(ids[None]).logits[0] for ids in ids_list])


@pytest.mark.parametrize("kind", ["moe", "moe_dense_first_renorm", "dense_tied"])
def test_logits_equal_transformers_packed_against_one_by_one(tmp_path, kind):
    if kind == "moe":
        hf, path = _moe(tmp_path)
    elif kind == "moe_dense_first_renorm":
        hf, path = _moe(tmp_path, mlp_only_layers=[0], norm_topk_prob=True)
    else:
        hf, path = _dense(tmp_path, tie_word_embeddings=True)
    ours, config = from_hf(path)
    assert (config.moe is None) == (kind == "dense_tied")
    gen = torch.Generator().manual_seed(1)
    ids_list = [torch.randint(0, 96, (n,), generator=gen) for n in (11, 5, 17)]
    with torch.no_grad():
        got = _ours_logits(ours.eval(), ids_list)
    want = _hf_logits(hf, ids_list)
    assert want.abs().max() > 0.5  # the weights are not near-zero: a real comparison
    assert (got - want).abs().max().item() <= TOL


def test_routing_equals_transformers_per_token(tmp_path):
    hf, path = _moe(tmp_path, norm_topk_prob=True)
    ours, _ = from_hf(path)
    theirs, mine = [], []
    for layer in hf.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, out: theirs.append(out))
    for layer in ours.layers:
        layer.ffn.register_forward_hook(
            lambda m, inputs, out: mine.append(m.route(inputs[0])[:2]))
    ids = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _ours_logits(ours.eval(), [ids])
        hf(ids[None])
    assert len(theirs) == len(mine) == 3
    for (_, weight_hf, expert_hf), (expert_TK, weight_TK) in zip(theirs, mine):
        assert torch.equal(expert_TK, expert_hf)  # the same experts, in the same order
        assert (weight_TK - weight_hf).abs().max().item() <= 1e-6


def test_a_larger_vocabulary_grows_with_mean_rows(tmp_path):
    hf, path = _moe(tmp_path)
    ours, config = from_hf(path, vocab_size=100)
    table = hf.model.embed_tokens.weight.detach()
    assert config.vocab_size == 100 and ours.embed_tokens.weight.shape == (100, 32)
    assert torch.equal(ours.embed_tokens.weight[:96], table)
    assert torch.allclose(ours.embed_tokens.weight[96:], table.mean(0).expand(4, 32))
    assert torch.allclose(ours.lm_head.weight[96:],
                          hf.lm_head.weight.detach().mean(0).expand(4, 32))


def test_broken_checkpoints_are_one_line(tmp_path):
    _, path = _saved(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SHAPES, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2)),
        tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    (path / shard).unlink()
    with pytest.raises(UserError) as e:
        from_hf(path)
    assert str(e.value).startswith(f"{path / shard}: missing shard (holds tensor ")
    assert "\n" not in str(e.value)

    _, path = _dense(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(47, 32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(UserError, match=r"^\S+/dense/model\.safetensors: tensor "
                                        r"model\.layers\.2\.mlp\.up_proj\.weight has shape "
                                        r"\[47, 32\], expected \[48, 32\] \(from config\.json\)$"):
        from_hf(path)

    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(UserError, match=r"dense/model\.safetensors: no tensor "
                                        r"model\.layers\.2\.mlp\.up_proj\.weight"):
        from_hf(path)

    llama = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4)).save_pretrained(llama)
    with pytest.raises(UserError, match=r"llama/config\.json: architecture 'LlamaForCausalLM' "
                                        r"\(model_type 'llama'\) is not supported; supported: "
                                        r"Qwen3MoeForCausalLM, Qwen3ForCausalLM$"):
        from_hf(llama)
