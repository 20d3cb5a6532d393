"""The example configs for real models (``configs/examples/``, issue #45 item 5), checked
without weights and without downloads.

Each run config is loaded as a user would run it, its ``model.init_from`` pointed (``--set``
style overrides) at a directory holding only the published ``config.json`` of its Hugging Face
model, its mixing spec copied with the tokenizer path pointing at a stand-in for Qwen3's (the
published special tokens at their published ids, in a vocabulary of Qwen3's size). Then:

- on the 16 ranks each example is written for (2 nodes x 8 GPUs), ``loop.layout`` -- what the
  launcher checks before it starts anything -- accepts the layout as written, and the model
  config has the published parameter counts;
- the trainer's own path (``Task.build`` on the meta device, ``optim_groups.freeze``,
  ``Task.parallelize``) runs on 2 real gloo processes with the layout scaled down to 2 ranks
  (``SCALED``: the axes that must shrink to fit 2 processes, each by the same rule as the
  full layout), once for all three examples (a spawn costs more than a meta build). Every
  parameter stays on the meta device, each tensor has the shape the published config gives,
  the two ranks' shards add up to the published totals exactly (each weight held once), and
  the frozen towers are frozen.

Oracles are the published figures, not this code: Qwen3-30B-A3B 30.5B parameters / 3.3B
activated and Qwen3-8B 8.2B (the model cards), Qwen2-VL's 675M vision encoder (Qwen2-VL
report, Table 1), and exact counts worked out by hand from the published config values in the
comments below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from omniscale.errors import UserError
from tests.backbone.test_hf_real_configs import QWEN3_30B_A3B
from tests.parallel.multiproc import run_ranks

pytestmark = pytest.mark.xdist_group("example_configs")

EXAMPLES = Path(__file__).resolve().parents[2] / "configs" / "examples"

# config.json of Qwen/Qwen3-8B-Base as published (a stored copy: github.com/Chen-Oliver/
# qwen3-8b-base, config.json at 1e44ee1). Qwen3-8B (the post-trained one) has the same shapes;
# only max_position_embeddings (40960) and eos_token_id differ.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 32768, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}

# config.json of Qwen/Qwen2-VL-7B-Instruct as published (its values as stored in a copy in the
# VARGPT-family training code; the tower's shapes also in the module print-out of
# Qwen2VLForConditionalGeneration in github.com/zhenhua32/Qwen2-VL, READ.md: Conv3d(3, 1280,
# (2, 14, 14)), 32 blocks, qkv 1280 -> 3840, fc1 1280 -> 5120, merger 5120 -> 5120 -> 3584).
QWEN2_VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
    "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2_vl", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                      "in_chans": 3, "hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064}

# Qwen3's added tokens, ids 151643.. in order (its tokenizer_config.json, shared by every Qwen3
# model; a stored copy: github.com/akougkas/warpio-cli, warpio-docs/ai-docs/model_cards/
# qwen3:4b.md at 8dde6d2). The byte-level BPE holds ids 0..151642: 151,669 ids in all.
QWEN3_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
    "</think>")
QWEN3_BPE_IDS = 151643

# Exact parameter counts by hand from the published configs (d: width, V: vocabulary):
# Qwen3-30B-A3B (d 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts of 768):
#   attention 2048 x (4096 + 2 x 512) + 4096 x 2048 + 2 x 128 (q/k norms)   =  18,874,624
#   two norms 4,096; router 2048 x 128 = 262,144; experts 128 x 3 x 2048 x 768 = 603,979,776
#   a layer 623,120,640; x 48 = 29,909,790,720; + embedding and head 2 x 151936 x 2048
#   (622,329,856) + final norm 2,048                                  = 30,532,122,624 (30.5B)
#   active: a layer with 8 experts (37,748,736) instead of 128: 56,889,600 x 48 + 622,331,904
#   = 3,353,032,704 (the card writes 3.3B: one decimal, truncated)
QWEN3_30B_A3B_PARAMS, QWEN3_30B_A3B_ACTIVE = 30_532_122_624, 3_353_032_704
# Qwen3-8B (d 4096, 36 layers, 32 q / 8 kv heads of 128, SwiGLU 12288):
#   attention 4096 x (4096 + 2 x 1024) + 4096 x 4096 + 256 = 41,943,296; norms 8,192;
#   SwiGLU 3 x 4096 x 12288 = 150,994,944; a layer 192,946,432; x 36 = 6,946,071,552;
#   + final norm 4,096 = 6,946,075,648 (the card's "non-embedding 6.95B");
#   + embedding and head 2 x 151936 x 4096 = 1,244,659,712                = 8,190,735,360 (8.2B)
QWEN3_8B_PARAMS = 8_190_735_360
# Qwen2-VL-7B's vision tower: patch embedding 1280 x 3 x 2 x 14 x 14 = 1,505,280; a block:
#   2 LayerNorms 2 x 2,560, qkv 1280 x 3840 + 3840, proj 1280 x 1280 + 1280, fc1 1280 x 5120
#   + 5120, fc2 5120 x 1280 + 1280 = 19,677,440, x 32 = 629,678,080; merger: ln_q 2,560,
#   5120 x 5120 + 5120 = 26,219,520, 5120 x 3584 + 3584 = 18,353,664      =   675,759,104 (675M)
QWEN2_VL_TOWER_PARAMS = 675_759_104
# ... with its last merger layer to Qwen3-8B's 4096 instead of 3584: + 512 x 5120 + 512
QWEN2_VL_TOWER_TO_4096 = QWEN2_VL_TOWER_PARAMS + 512 * 5120 + 512
QWEN2_VL_MERGER_TO_4096 = 2_560 + 26_219_520 + 5120 * 4096 + 4096

# The layouts scaled to 2 processes: the axes written for 16 GPUs that cannot fit 2, each
# shrunk by the rule the full layout follows (FSDP over every rank left, EP over the ranks of
# a "node", SP over a pair instead of 4).
SCALED = {
    "qwen3_30b_a3b_sft": ["parallel.dp_shard=2", "parallel.ep=2"],
    "qwen3_8b_qwen2vl_omni": ["parallel.dp_replicate=1", "parallel.dp_shard=2",
                              "parallel.encoder_dp_shard=2"],
    "long_context_moe_pretrain": ["parallel.dp_shard=1", "parallel.sp=2", "parallel.ep=2"],
}
# the Hugging Face directories each example's init_from names (written here, config only)
INIT_FROM = {
    "qwen3_30b_a3b_sft": {"backbone": "Qwen3-30B-A3B"},
    "qwen3_8b_qwen2vl_omni": {"backbone": "Qwen3-8B", "vision": "Qwen2-VL-7B-Instruct"},
    "long_context_moe_pretrain": {},
}
HF_CONFIGS = {"Qwen3-30B-A3B": QWEN3_30B_A3B, "Qwen3-8B": QWEN3_8B,
              "Qwen2-VL-7B-Instruct": QWEN2_VL_7B}


def _qwen3_tokenizer(path: Path) -> Path:
    """A tokenizer with Qwen3's vocabulary size and its added tokens at their ids (the BPE's
    151,643 entries are stand-ins): what the specs' special_tokens and the vocabulary sizing
    read from a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(QWEN3_BPE_IDS)}
    vocab.update({token: QWEN3_BPE_IDS + i for i, token in enumerate(QWEN3_ADDED_TOKENS)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(QWEN3_ADDED_TOKENS))
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, list[str]]:
    """Per example, the ``--set`` overrides that make it run here: its init_from directories
    (config.json only), its mixing spec with the stand-in tokenizer, a scratch output_dir."""
    root = tmp_path_factory.mktemp("examples")
    tokenizer = _qwen3_tokenizer(root / "tokenizer.json")
    for name, config in HF_CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    sets = {}
    for example, init in INIT_FROM.items():
        spec = yaml.safe_load((EXAMPLES / f"{example}.mix.yaml").read_text())
        spec["tokenizer"] = str(tokenizer)  # everything else as written
        (root / f"{example}.mix.yaml").write_text(yaml.safe_dump(spec))
        sets[example] = [f"data.spec={root / example}.mix.yaml",
                         f"output_dir={root / 'runs' / example}",
                         *(f"model.init_from.{kind}={root / d}" for kind, d in init.items())]
    return sets


def _layout(example: str, sets: list[str], world: int):
    from omniscale.tools.train.config import load_config
    from omniscale.tools.train.loop import layout

    cfg, _ = load_config(EXAMPLES / f"{example}.yaml", sets)
    return (cfg, *layout(cfg, world))


# ---- the layouts as written, on 16 ranks ----------------------------------------------------

def test_every_example_names_a_mixing_spec_of_its_own():
    configs = sorted(p.name for p in EXAMPLES.glob("*.yaml") if not p.name.endswith(".mix.yaml"))
    assert configs == sorted(f"{e}.yaml" for e in SCALED)
    for example in SCALED:
        raw = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
        assert raw["data"]["spec"] == f"configs/examples/{example}.mix.yaml"
        assert raw["parallel"]["device"] == "cuda"
        assert raw["parallel"]["mixed_precision"] == "bf16"


def test_qwen3_30b_a3b_sft_on_2_nodes_of_8(prepared):
    from omniscale.loaders.decode_text import load_tokenizer

    cfg, spec, mcfg, dims, groups = _layout("qwen3_30b_a3b_sft", prepared["qwen3_30b_a3b_sft"],
                                            16)
    assert (dims.dp_replicate, dims.dp_shard, dims.ep, dims.edp_shard, dims.sp, dims.tp) == \
        (1, 16, 8, 2, 1, 1)
    assert (mcfg.d_model, mcfg.n_layers, mcfg.moe.num_experts, mcfg.moe.top_k) == \
        (2048, 48, 128, 8)
    assert mcfg.vision is None and mcfg.audio is None
    assert mcfg.vocab_size == 151936  # the checkpoint's: the tokenizer's 151,669 ids fit
    assert mcfg.param_count() == QWEN3_30B_A3B_PARAMS
    assert mcfg.active_param_count() == QWEN3_30B_A3B_ACTIVE
    assert round(mcfg.param_count() / 1e9, 1) == 30.5  # the model card
    assert round(mcfg.active_param_count() / 1e9, 1) == 3.4  # the card's "3.3B": see above
    # three sources and a curriculum whose weights move from a general mix to the chat data
    assert [s.template for s in spec.sources] == ["conversation", "conversation", "text"]
    assert spec.accounting == "target_tokens"
    start, end = spec.schedule.weights_at(0), spec.schedule.weights_at(1999)
    assert start["chat"] == pytest.approx(0.5) and end["chat"] == pytest.approx(0.6)
    assert end["pretrain_replay"] < start["pretrain_replay"]
    # every special token is one of Qwen3's (the loaders refuse a missing one)
    load_tokenizer(spec.tokenizer, spec.special_tokens)
    assert cfg.data.global_batch_tokens % (16 * cfg.data.micro_batch_tokens) == 0


def test_qwen3_8b_with_the_qwen2_vl_tower_on_2_nodes_of_8(prepared):
    from omniscale.loaders.decode_text import load_tokenizer

    cfg, spec, mcfg, dims, groups = _layout("qwen3_8b_qwen2vl_omni",
                                            prepared["qwen3_8b_qwen2vl_omni"], 16)
    assert (dims.dp_replicate, dims.dp_shard, dims.encoder_dp_shard,
            dims.encoder_dp_replicate) == (2, 8, 8, 2)
    assert mcfg.moe is None and (mcfg.d_model, mcfg.n_layers) == (4096, 36)
    assert mcfg.param_count() == QWEN3_8B_PARAMS and round(QWEN3_8B_PARAMS / 1e9, 1) == 8.2
    v = mcfg.vision
    assert (v.patch_size, v.temporal_patch_size, v.merge_size) == (14, 2, 2)
    assert (spec.media.patch_size, spec.media.temporal_patch_size, spec.media.merge_size) == \
        (14, 2, 2)
    assert (v.d_model, v.n_layers, v.n_heads, v.ffn_dim) == (1280, 32, 16, 5120)
    assert mcfg.audio is None
    assert groups.frozen("vision.blocks.3.qkv.weight")
    assert not groups.frozen("vision.merger.fc2.weight")
    assert not groups.frozen("decoder.layers.0.attn.q_proj.weight")
    load_tokenizer(spec.tokenizer, spec.special_tokens)


def test_the_qwen2_vl_tower_needs_a_fresh_projector_for_qwen3_8b(prepared):
    """Without ``model.fresh_projector`` the run stops in one line: Qwen2-VL-7B's merger
    projects to 3584, Qwen3-8B is 4096 wide."""
    with pytest.raises(UserError, match=r"projects to width 3584, the decoder is 4096 wide"):
        _layout("qwen3_8b_qwen2vl_omni",
                [*prepared["qwen3_8b_qwen2vl_omni"], "model.fresh_projector=false"], 16)


def test_long_context_moe_pretraining_on_2_nodes_of_8(prepared):
    from omniscale.loaders.decode_text import load_tokenizer
    from omniscale.tools.train.loop import planning_config

    example = "long_context_moe_pretrain"
    cfg, spec, mcfg, dims, groups = _layout(example, prepared[example], 16)
    assert (dims.dp_shard, dims.sp, dims.ep, dims.edp_shard, dims.dp_sp) == (4, 4, 8, 2, 16)
    assert mcfg.param_count() == QWEN3_30B_A3B_PARAMS  # the preset: the published shapes
    plane = planning_config(cfg, 16)
    assert (plane.dp, plane.sp_max) == (16, 4)
    # the plane may size a split sample's heads by the ranks' speeds: it knows the decoder's
    # 32 query heads (one TP rank holds them all); a run that asks for H/k heads tells it 0
    assert (mcfg.n_heads, dims.tp, plane.attention_heads) == (32, 1, 32)
    cfg.data.heads_by_speed = False
    assert planning_config(cfg, 16).attention_heads == 0
    assert plane.sp_max * plane.micro_batch_tokens == 65536  # the longest sample
    assert spec.schedule.unit == "tokens"
    long = ("books", "code_repos", "papers")
    early, late = spec.schedule.weights_at(0), spec.schedule.weights_at(95e9)
    assert sum(early[s] for s in long) == pytest.approx(0.2)
    assert sum(late[s] for s in long) == pytest.approx(0.34)
    load_tokenizer(spec.tokenizer, spec.special_tokens)


@pytest.mark.parametrize("example", sorted(SCALED))
def test_the_written_layouts_do_not_fit_2_ranks(prepared, example):
    """The layouts are checked for real: as written, 2 processes are refused in one line
    naming the axis (hence ``SCALED``)."""
    with pytest.raises(UserError, match=r"^parallel\..*\(with --nproc 2\)$"):
        _layout(example, prepared[example], 2)


# ---- built on the meta device by the trainer's path, 2 gloo ranks ---------------------------

def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _build_examples(rank: int, world: int, prepared: dict[str, list[str]]) -> dict:
    """Each example built as ``loop._train_rank`` builds it, up to its weights: per example,
    whether every parameter is on the meta device, this rank's share of the parameters (all,
    frozen, per top-level part), some global shapes and the experts this rank holds."""
    from omniscale.parallel.dcp import plain_name
    from omniscale.parallel.fsdp import MixedUnitError
    from omniscale.tools.train import optim_groups
    from omniscale.tools.train.loop import settings_of
    from omniscale.tools.train.tasks import task_of

    device = torch.device("cpu")
    out = {}
    for example, scaled in SCALED.items():
        cfg, spec, mcfg, dims, groups = _layout(
            example, [*prepared[example], *scaled, "parallel.device=cpu"], world)
        cfg = cfg.on_device("cpu")
        task = task_of(cfg)
        model = task.build(cfg, spec, mcfg, device)
        optim_groups.freeze(model, groups)
        try:
            task.parallelize(cfg)(model, dims, settings_of(cfg, device), device.type)
        except MixedUnitError as e:
            raise optim_groups.unit_error(groups, model, e) from None
        params = dict(model.named_parameters())
        parts: dict[str, int] = {}
        for name, p in params.items():
            part = plain_name(name).split(".")[0]
            parts[part] = parts.get(part, 0) + _local(p).numel()
        experts = [m.num_experts for m in model.modules()
                   if getattr(m, "num_global_experts", None) is not None]
        out[example] = {
            "meta": all(p.is_meta for p in params.values()),
            "local": sum(_local(p).numel() for p in params.values()),
            "frozen": sum(_local(p).numel() for p in params.values() if not p.requires_grad),
            "parts": parts,
            "shapes": {plain_name(n): tuple(p.shape) for n, p in params.items()},
            "experts_here": sorted(set(experts)),
        }
        del model
    return out


@pytest.fixture(scope="module")
def built(prepared):
    return run_ranks(_build_examples, 2, prepared)


@pytest.mark.timeout(300)
def test_qwen3_30b_a3b_sft_builds_on_meta(built):
    ranks = [r["qwen3_30b_a3b_sft"] for r in built]
    assert all(r["meta"] for r in ranks)
    assert sum(r["local"] for r in ranks) == QWEN3_30B_A3B_PARAMS  # every weight once
    assert {tuple(r["parts"]) for r in ranks} == {("decoder",)}
    shapes = ranks[0]["shapes"]
    assert shapes["decoder.embed_tokens.weight"] == (151936, 2048)
    assert shapes["decoder.lm_head.weight"] == (151936, 2048)
    assert shapes["decoder.layers.47.attn.q_proj.weight"] == (4096, 2048)
    assert shapes["decoder.layers.47.attn.k_proj.weight"] == (512, 2048)
    assert shapes["decoder.layers.0.ffn.router.weight"] == (128, 2048)
    # ep 2: each rank holds 64 of each layer's 128 experts (edp_shard 1: not split further)
    assert all(r["experts_here"] == [64] for r in ranks)
    assert shapes["decoder.layers.0.ffn.experts.gate_up_proj"] == (64, 2 * 768, 2048)
    assert shapes["decoder.layers.0.ffn.experts.down_proj"] == (64, 2048, 768)
    assert all(r["frozen"] == 0 for r in ranks)


@pytest.mark.timeout(300)
def test_qwen3_8b_with_the_qwen2_vl_tower_builds_on_meta(built):
    ranks = [r["qwen3_8b_qwen2vl_omni"] for r in built]
    assert all(r["meta"] for r in ranks)
    assert sum(r["parts"]["decoder"] for r in ranks) == QWEN3_8B_PARAMS
    assert sum(r["parts"]["vision"] for r in ranks) == QWEN2_VL_TOWER_TO_4096
    assert int(QWEN2_VL_TOWER_PARAMS / 1e6) == 675  # the report's "675M"
    assert "audio" not in ranks[0]["parts"]
    # frozen: the ViT as published, all but its merger (which trains, its last layer new)
    assert sum(r["frozen"] for r in ranks) == QWEN2_VL_TOWER_TO_4096 - QWEN2_VL_MERGER_TO_4096
    shapes = ranks[0]["shapes"]
    assert shapes["vision.patch_embed.weight"] == (1280, 3 * 2 * 14 * 14)
    assert shapes["vision.blocks.31.qkv.weight"] == (3840, 1280)
    assert shapes["vision.merger.fc1.weight"] == (5120, 5120)
    assert shapes["vision.merger.fc2.weight"] == (4096, 5120)
    assert shapes["decoder.layers.35.ffn.gate_proj.weight"] == (12288, 4096)
    assert shapes["decoder.layers.0.attn.k_proj.weight"] == (1024, 4096)


@pytest.mark.timeout(300)
def test_long_context_moe_pretraining_builds_on_meta(built):
    ranks = [r["long_context_moe_pretrain"] for r in built]
    assert all(r["meta"] for r in ranks)
    assert sum(r["local"] for r in ranks) == QWEN3_30B_A3B_PARAMS
    assert all(r["experts_here"] == [64] for r in ranks)
    assert ranks[0]["shapes"]["decoder.layers.0.ffn.experts.gate_up_proj"] == (64, 1536, 2048)


# ---- the hook: a tower's config.json alone --------------------------------------------------

def test_a_tower_directory_without_weights_gives_shapes_and_refuses_reads(tmp_path):
    """``encoders.hf.vision_source`` on a directory of config.json alone: the tower's config
    and its readers (what a meta build and the layout check need); reading a tensor is one
    line naming the directory."""
    from omniscale.encoders.hf import vision_source

    (tmp_path / "config.json").write_text(json.dumps(QWEN2_VL_7B))
    config, width, read = vision_source(tmp_path, 4096)
    assert (config.d_model, config.n_layers, width, read.own_width, read.fresh) == \
        (1280, 32, 4096, 3584, "merger.fc2")
    assert read("merger.fc2.weight", (4096, 5120)) is None  # fresh: never read
    with pytest.raises(UserError, match=rf"^{tmp_path}: no model\.safetensors or model\."
                                        r"safetensors\.index\.json: .*visual\.blocks\.0\.attn"):
        read("blocks.0.qkv.weight", (3840, 1280))
