"""Qwen2-VL's vision tower imported into ours (``encoders.hf``): a random tiny
``Qwen2VLForConditionalGeneration`` built by transformers and saved with ``save_pretrained``
gives, in our encoder, the merged embeddings its ``visual`` gives (fp32) -- two images of
different grids and a clip packed in one call; sharded checkpoints load alike, the export names
are transformers', and broken checkpoints are one line naming the file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniscale.encoders.hf import vision_from_hf, vision_to_hf_state
from omniscale.encoders.vision import VisionEncoder
from omniscale.errors import UserError

transformers = pytest.importorskip("transformers")

TOL = 1e-4
WIDTH = 48  # the LLM width: the merger's output
VISION = dict(depth=2, embed_dim=32, hidden_size=WIDTH, num_heads=4, mlp_ratio=2, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2)
TEXT = dict(vocab_size=64, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=1,
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 4],
                             "rope_theta": 10000.0})
# Two images of different grids and a 3-slice clip, in one packed call.
GRIDS = torch.tensor([(1, 4, 6), (1, 2, 8), (3, 4, 4)])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the HF model, its checkpoint directory)."""
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(vision_config=VISION, text_config=TEXT)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF starts norms at 1, biases at 0 and weights tiny: perturb all
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.ndim == 1 else 0.15).add_(1.0 if p.ndim == 1 else 0.0)
    path = tmp_path_factory.mktemp("qwen2_vl") / "ckpt"
    model.save_pretrained(path)
    return model, path


def _patches(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(GRIDS.prod(dim=1).sum()), 3 * 2 * 4 * 4, generator=g)


def test_vision_tower_matches_transformers(saved):
    model, path = saved
    encoder, config = vision_from_hf(path)
    assert (config.norm, config.mlp, config.bias, config.d_model) == ("layer", "quick_gelu",
                                                                       True, 32)
    x = _patches()
    with torch.no_grad():
        ours = encoder.eval()(x, GRIDS)
        theirs = model.model.visual(x, grid_thw=GRIDS).pooler_output
    assert ours.shape == theirs.shape == (int(encoder.output_lengths(GRIDS).sum()), WIDTH)
    assert theirs.std() > 0.5  # outputs far from trivial: a layout error cannot hide in 1e-4
    diff = (ours - theirs).abs().max().item()
    assert diff <= TOL, diff


def test_sharded_checkpoint_loads_the_same(saved, tmp_path):
    model, path = saved
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, _ = vision_from_hf(path)
    b, _ = vision_from_hf(tmp_path / "sharded")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_other_llm_width_keeps_all_but_the_last_projection(saved):
    _, path = saved
    full, _ = vision_from_hf(path)
    narrow, _ = vision_from_hf(path, out_dim=24)
    with torch.no_grad():
        assert narrow(_patches(), GRIDS).shape[1] == 24
    kept = narrow.state_dict()
    for name, x in full.state_dict().items():
        if not name.startswith("merger.fc2."):
            assert torch.equal(kept[name], x), name


def test_export_is_transformers_state(saved):
    model, path = saved
    encoder, _ = vision_from_hf(path)
    ours = vision_to_hf_state(encoder)
    theirs = {"visual." + k: v for k, v in model.model.visual.state_dict().items()}
    assert ours.keys() == theirs.keys()
    for name, x in theirs.items():
        assert torch.equal(ours[name], x), name


def test_a_tower_written_alone_loads_in_transformers_and_back(saved, tmp_path):
    """The tower as its own checkpoint directory: transformers' tower class loads it with no
    custom code and gives our embeddings; read back, it is the same encoder."""
    from omniscale.encoders.hf import vision_to_hf_dir

    model, path = saved
    encoder, _ = vision_from_hf(path)
    out = vision_to_hf_dir(encoder, tmp_path / "vision")
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    tower = Qwen2VisionTransformerPretrainedModel.from_pretrained(out).eval()
    x = _patches(1)
    with torch.no_grad():
        ours = encoder.eval()(x, GRIDS)
        theirs = tower(x, grid_thw=GRIDS).pooler_output
    assert theirs.std() > 0.5
    assert (ours - theirs).abs().max().item() <= TOL
    again, _ = vision_from_hf(out)
    for (name, a), b in zip(encoder.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_default_layout_cannot_be_exported():
    from omniscale.encoders.vision import VisionConfig

    with pytest.raises(ValueError, match="not Qwen2-VL's"):
        vision_to_hf_state(VisionEncoder(VisionConfig.preset("tiny"), 8))


# ---- broken checkpoints: one line naming the file and the tensor ---------------------------

def _one_line_error(path, match: str) -> str:
    with pytest.raises(UserError, match=match) as info:
        vision_from_hf(path)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_missing_shard(saved, tmp_path):
    model, _ = saved
    path = tmp_path / "sharded"
    model.save_pretrained(path, max_shard_size="40KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "visual.blocks.1.mlp.fc1.weight"
    (path / weight_map[name]).unlink()
    message = _one_line_error(path, "missing shard")
    assert weight_map[name] in message and "visual." in message


def test_wrong_shape(saved, tmp_path):
    _, path = saved
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "visual.blocks.1.attn.qkv.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    message = _one_line_error(broken, "has shape")
    assert str(broken / "model.safetensors") in message and name in message
    assert "[95, 32]" in message and "[96, 32]" in message


def test_missing_tensor(saved, tmp_path):
    _, path = saved
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["visual.merger.ln_q.bias"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    message = _one_line_error(broken, "no tensor visual.merger.ln_q.bias")
    assert "model.safetensors" in message


def test_unsupported_architecture(saved, tmp_path):
    _, path = saved
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    config = json.loads((broken / "config.json").read_text())
    config.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"])
    (broken / "config.json").write_text(json.dumps(config))
    message = _one_line_error(broken, "not supported")
    assert str(broken / "config.json") in message and "qwen2_5_vl" in message
