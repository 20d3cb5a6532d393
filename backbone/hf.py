"""Hugging Face decoders as our :class:`MoEDecoder`, and back: Qwen3-MoE
(``Qwen3MoeForCausalLM``) and dense Qwen3 (``Qwen3ForCausalLM``).

Our decoder is that architecture (GQA with per-head q/k RMSNorm, rotate-half RoPE, pre-norm
blocks, SwiGLU, a softmax top-k router with optional renormalisation), so the mapping is one of
names and layouts only:

==========================================  ================================================
ours (``MoEDecoder``)                        Hugging Face
==========================================  ================================================
``embed_tokens.weight``                      ``model.embed_tokens.weight``
``layers.{i}.attn_norm.weight``              ``model.layers.{i}.input_layernorm.weight``
``layers.{i}.attn.{q,k,v,o}_proj.weight``    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``
``layers.{i}.attn.{q,k}_norm.weight``        ``model.layers.{i}.self_attn.{q,k}_norm.weight``
``layers.{i}.ffn_norm.weight``               ``model.layers.{i}.post_attention_layernorm.weight``
``layers.{i}.ffn.{gate,up,down}_proj``       ``model.layers.{i}.mlp.{gate,up,down}_proj`` (dense)
``layers.{i}.ffn.router.weight``             ``model.layers.{i}.mlp.gate.weight``
``layers.{i}.ffn.experts.gate_up_proj``      ``mlp.experts.{e}.gate_proj`` ‖ ``up_proj``, stacked
``layers.{i}.ffn.experts.down_proj``         ``mlp.experts.{e}.down_proj``, stacked over e
``norm.weight`` / ``lm_head.weight``         ``model.norm.weight`` / ``lm_head.weight``
==========================================  ================================================

Experts are stored one tensor per expert on the Hub (and by ``save_pretrained``); fused
``mlp.experts.gate_up_proj`` / ``down_proj`` tensors are read too. Loading goes parameter by
parameter, each read alone from its file (:mod:`encoders.hf_files`); into a parallelized model
through ``parallel.load.fill_parameters``, where a parameter sharded by FSDP (a DTensor) keeps
only this rank's shard, so a rank's memory peaks at about one full tensor beyond its shards. A
tokenizer vocabulary larger than the checkpoint's grows the embedding and head; the new rows
are the mean of the old ones (a common choice: new tokens start as an average token rather
than noise).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from omniscale.backbone.config import ModelConfig, MoEConfig
from omniscale.encoders.hf_files import CONFIG, CheckpointDir
from omniscale.errors import UserError

MOE, DENSE = "Qwen3MoeForCausalLM", "Qwen3ForCausalLM"
MODEL_TYPES = {MOE: "qwen3_moe", DENSE: "qwen3"}


def config_from_hf(hf: dict, source: str | Path = CONFIG) -> ModelConfig:
    """Our ModelConfig for a Qwen3 / Qwen3-MoE ``config.json`` (one line naming ``source``
    and the field for anything we do not build the same way)."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in MODEL_TYPES:
        raise UserError(f"{source}: architecture {arch!r} (model_type "
                        f"{hf.get('model_type')!r}) is not supported; supported: {MOE}, {DENSE}")

    def need(field: str, ok: bool, what: str) -> None:
        if not ok:
            raise UserError(f"{source}: {field}={hf.get(field)!r}: {what}")

    need("hidden_act", hf.get("hidden_act", "silu") == "silu", "only silu (SwiGLU) is built")
    need("attention_bias", not hf.get("attention_bias", False), "q/k/v/o biases are not built")
    need("use_sliding_window", not hf.get("use_sliding_window", False),
         "sliding-window attention is not built")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    need("rope_scaling", rope.get("rope_type", rope.get("type", "default")) == "default",
         "only the default RoPE is built")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    heads = hf["num_attention_heads"]
    moe, dense_layers = None, 0
    if arch == MOE:
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        sparse = list(range(len(hf.get("mlp_only_layers") or [])))
        need("mlp_only_layers", sorted(hf.get("mlp_only_layers") or []) == sparse,
             "dense layers must come first (layers 0..n-1)")
        need("decoder_sparse_step", hf.get("decoder_sparse_step", 1) == 1,
             "every layer after the dense ones must be MoE")
        dense_layers = len(sparse)
        moe = MoEConfig(num_experts=experts, top_k=hf["num_experts_per_tok"],
                        expert_ffn_dim=hf["moe_intermediate_size"], router="softmax",
                        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                        aux_loss_coef=float(hf.get("router_aux_loss_coef", 1e-3)))
    return ModelConfig(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                       n_layers=hf["num_hidden_layers"], n_heads=heads,
                       n_kv_heads=hf.get("num_key_value_heads", heads),
                       head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                       ffn_dim=hf.get("intermediate_size", 4 * hf["hidden_size"]), moe=moe,
                       n_dense_layers=dense_layers, qk_norm=True, rope_theta=float(theta),
                       norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def config_to_hf(config: ModelConfig, special_ids: dict[str, int] | None = None) -> dict:
    """A ``config.json`` transformers builds our decoder's architecture from, with no custom
    code (``special_ids``: ``bos``/``eos``/``pad`` token ids, when known)."""
    arch = DENSE if config.moe is None else MOE
    hf = {"architectures": [arch], "model_type": MODEL_TYPES[arch],
          "vocab_size": config.vocab_size, "hidden_size": config.d_model,
          "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
          "head_dim": config.head_dim, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
          "rope_theta": config.rope_theta, "rope_scaling": None, "attention_bias": False,
          "tie_word_embeddings": config.tie_embeddings, "max_position_embeddings": 32768,
          "torch_dtype": "float32", "use_sliding_window": False}
    if config.moe is not None:
        m = config.moe
        if m.router != "softmax" or m.shared_expert or m.bias_update_rate > 0:
            raise UserError("model: only a softmax router without shared expert or expert bias "
                            "exports to Qwen3-MoE (moe.router, shared_expert, bias_update_rate)")
        hf.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                  moe_intermediate_size=m.expert_ffn_dim, norm_topk_prob=m.norm_topk_prob,
                  decoder_sparse_step=1, mlp_only_layers=list(range(config.n_dense_layers)),
                  router_aux_loss_coef=m.aux_loss_coef)
    for name, value in (special_ids or {}).items():
        hf[f"{name}_token_id"] = value
    return hf


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_SAME = {"attn_norm.weight": "input_layernorm.weight",
         "ffn_norm.weight": "post_attention_layernorm.weight",
         "ffn.router.weight": "mlp.gate.weight"}
_SAME.update({f"attn.{p}.weight": f"self_attn.{p}.weight"
              for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")})
_SAME.update({f"ffn.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")})


def hf_name(name: str) -> str | None:
    """The Hugging Face name of one of our decoder's parameters (None: the stacked experts,
    which are several tensors there)."""
    if name in ("embed_tokens.weight", "norm.weight"):
        return f"model.{name}"
    if name == "lm_head.weight":
        return name
    layer = _LAYER.match(name)
    if layer and layer.group(2) in _SAME:
        return f"model.layers.{layer.group(1)}.{_SAME[layer.group(2)]}"
    return None


def read_parameter(ckpt: CheckpointDir, name: str, shape: tuple[int, ...],
                   first_expert: int = 0) -> torch.Tensor:
    """Our parameter ``name`` (of ``shape``) from the checkpoint: one tensor, or the stack of
    a layer's experts ``first_expert ..`` (expert parallelism holds a slice of them); the
    vocabulary rows beyond the checkpoint's are the mean of its rows."""
    direct = hf_name(name)
    if direct is not None:
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return _grown(ckpt, direct, shape)
        return ckpt.get(direct, shape)
    layer = _LAYER.match(name)
    if not layer or layer.group(2) not in ("ffn.experts.gate_up_proj", "ffn.experts.down_proj"):
        raise UserError(f"{ckpt.path}: our parameter {name} has no Hugging Face counterpart")
    prefix, which = f"model.layers.{layer.group(1)}.mlp.experts", layer.group(2).rsplit(".")[-1]
    experts, out_dim, in_dim = shape
    chosen = range(first_expert, first_expert + experts)
    if f"{prefix}.{which}" in ckpt:  # fused on disk, as transformers 5 holds them in memory
        fused = ckpt.get(f"{prefix}.{which}")
        if tuple(fused.shape[1:]) != (out_dim, in_dim) or fused.shape[0] < chosen.stop:
            raise UserError(f"{ckpt.where[f'{prefix}.{which}']}: tensor {prefix}.{which} has "
                            f"shape {list(fused.shape)}, expected [{chosen.stop}, {out_dim}, "
                            f"{in_dim}] (from {CONFIG})")
        return fused[chosen.start:chosen.stop]
    stacked = None  # filled expert by expert: no list of copies beside the stack
    for i, e in enumerate(chosen):
        parts = ["down_proj"] if which == "down_proj" else ["gate_proj", "up_proj"]
        rows = out_dim // len(parts)
        for j, part in enumerate(parts):
            piece = ckpt.get(f"{prefix}.{e}.{part}.weight", (rows, in_dim))
            if stacked is None:
                stacked = piece.new_empty(shape)
            stacked[i, j * rows:(j + 1) * rows] = piece
    return stacked


def _grown(ckpt: CheckpointDir, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    rows, width = shape
    have = ckpt.shape(name)
    if len(have) != 2 or have[1] != width or have[0] > rows:
        raise UserError(f"{ckpt.where[name]}: tensor {name} has shape {list(have)}, expected "
                        f"[<= {rows}, {width}] (from {CONFIG})")
    table = ckpt.get(name)
    if have[0] == rows:
        return table
    mean = table.float().mean(0, keepdim=True).to(table.dtype)
    return torch.cat([table, mean.expand(rows - have[0], width)])


def from_hf(path: str | Path, vocab_size: int | None = None) -> tuple[nn.Module, ModelConfig]:
    """Our decoder with the weights of the Hugging Face checkpoint at ``path``, and its
    config (``vocab_size``: a larger vocabulary, the new rows the mean of the old)."""
    from omniscale.backbone.decoder import MoEDecoder

    ckpt = CheckpointDir(path)
    config = config_from_hf(ckpt.config, ckpt.path / CONFIG)
    if vocab_size is not None and vocab_size > config.vocab_size:
        config.vocab_size = vocab_size
    decoder = MoEDecoder(config)
    load_decoder(decoder, ckpt)
    return decoder, config


@torch.no_grad()
def load_decoder(decoder: nn.Module, path: str | Path | CheckpointDir) -> ModelConfig:
    """Fill ``decoder`` (a plain :class:`MoEDecoder`; a parallelized one:
    ``parallel.load.fill_parameters`` with :func:`read_parameter`) from the checkpoint at
    ``path``; its shapes must be those of the checkpoint's config (vocabulary: at least as
    large). Returns the checkpoint's config."""
    ckpt = path if isinstance(path, CheckpointDir) else CheckpointDir(path)
    config = config_from_hf(ckpt.config, ckpt.path / CONFIG)
    for name, param in decoder.named_parameters():
        param.copy_(read_parameter(ckpt, name, tuple(param.shape)))
    for name, buffer in decoder.named_buffers():
        if name.endswith("expert_bias_E"):  # selection bias of aux-loss-free balancing
            buffer.zero_()
    return config


def hf_tensors(state: dict[str, torch.Tensor], config: ModelConfig
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Our decoder's state (full tensors, names relative to the decoder) as Hugging Face
    tensors, in order, experts one tensor each (the Hub's layout)."""
    for name, tensor in state.items():
        if name.endswith("expert_bias_E") or (config.tie_embeddings and name == "lm_head.weight"):
            continue
        direct = hf_name(name)
        if direct is not None:
            yield direct, tensor
            continue
        layer = _LAYER.match(name)
        if not layer:
            raise UserError(f"model: parameter {name} has no Hugging Face counterpart")
        prefix = f"model.layers.{layer.group(1)}.mlp.experts"
        if layer.group(2) == "ffn.experts.gate_up_proj":
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
        elif layer.group(2) == "ffn.experts.down_proj":
            for e, down in enumerate(tensor):
                yield f"{prefix}.{e}.down_proj.weight", down
        else:
            raise UserError(f"model: parameter {name} has no Hugging Face counterpart")
