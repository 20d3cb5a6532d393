"""Whisper's encoder and Qwen2-Audio's audio tower imported into ours (``encoders.hf``): random
tiny models built by transformers and saved with ``save_pretrained`` give, in our encoder, what
transformers gives on the same log-mel input (fp32; two clips packed in one call): Whisper's
``last_hidden_state``, and Qwen2-Audio's tower + projector. The Whisper layout keeps the token
count of ``omniscale.geometry.audio_tokens`` for clips of any length, and broken checkpoints are
one line naming the file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniscale.encoders.audio import AudioConfig, AudioEncoder, pool_pairs
from omniscale.encoders.hf import audio_from_hf, audio_to_hf_state
from omniscale.errors import UserError
from omniscale.geometry import audio_tokens

transformers = pytest.importorskip("transformers")

TOL = 1e-4
MELS, POSITIONS = 16, 24  # HF's encoders take exactly 2 * max_source_positions mel frames
FRAMES = 2 * POSITIONS
ENCODER = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
               num_mel_bins=MELS, max_source_positions=POSITIONS)
WHISPER = dict(ENCODER, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
               vocab_size=64, max_target_positions=16, pad_token_id=0, bos_token_id=1,
               eos_token_id=1, decoder_start_token_id=2, begin_suppress_tokens=None)
TEXT = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=1,
            pad_token_id=0)


def _perturbed(model):
    """HF starts norms at 1, biases at 0 and weights tiny: perturb all (the position table
    too: a table transposed or offset must show)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2).add_(1.0 if p.ndim == 1 else 0.0)
    return model.eval()


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(the HF model, its checkpoint directory)."""
    model = _perturbed(transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(**WHISPER)))
    path = tmp_path_factory.mktemp("whisper") / "ckpt"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory):
    config = transformers.Qwen2AudioConfig(audio_config=ENCODER, text_config=TEXT,
                                           audio_token_index=5)
    model = _perturbed(transformers.Qwen2AudioForConditionalGeneration(config))
    path = tmp_path_factory.mktemp("qwen2_audio") / "ckpt"
    model.save_pretrained(path)
    return model, path


def _mel(clips: int = 2, seed: int = 0) -> torch.Tensor:
    """[clips, mels, frames]: transformers' layout (ours is the frames of every clip packed)."""
    return torch.randn(clips, MELS, FRAMES, generator=torch.Generator().manual_seed(seed))


def _packed(mel_BMF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (mel_BMF.transpose(1, 2).reshape(-1, MELS),
            torch.full((mel_BMF.shape[0],), mel_BMF.shape[2]))


def test_whisper_encoder_matches_transformers(whisper):
    model, path = whisper
    encoder, config = audio_from_hf(path, out_dim=40)
    assert (config.layout, config.max_positions, config.norm_eps) == ("whisper", POSITIONS, 1e-5)
    mel = _mel()
    with torch.no_grad():
        theirs = model.model.encoder(mel).last_hidden_state.reshape(-1, 32)
        ours, rows = encoder.eval().features(*_packed(mel))
        out = encoder(*_packed(mel))
    assert rows == [POSITIONS, POSITIONS] and ours.shape == theirs.shape
    assert theirs.std() > 0.5  # far from trivial: a layout error cannot hide in 1e-4
    diff = (ours - theirs).abs().max().item()
    assert diff <= TOL, diff
    # Then Qwen2-Audio's pool over frame pairs and the projection to the LLM width.
    assert out.shape == (2 * audio_tokens(FRAMES), 40)
    with torch.no_grad():
        pooled = encoder.projector(theirs.view(-1, 2, 32).mean(1))
    assert (out - pooled).abs().max().item() <= TOL


def test_whisper_model_checkpoint_loads_the_same(whisper, tmp_path):
    """``WhisperModel`` keeps the encoder under ``encoder.``, not ``model.encoder.``."""
    model, path = whisper
    bare = transformers.WhisperModel(model.config)
    bare.load_state_dict(model.model.state_dict())
    bare.save_pretrained(tmp_path / "bare", max_shard_size="40KB")
    a, _ = audio_from_hf(path, out_dim=8)
    b, _ = audio_from_hf(tmp_path / "bare", out_dim=8)
    for name, x in a.state_dict().items():
        if not name.startswith("projector."):
            assert torch.equal(b.state_dict()[name], x), name


def test_qwen2_audio_matches_transformers(qwen2_audio):
    model, path = qwen2_audio
    encoder, config = audio_from_hf(path)
    assert config.layout == "qwen2_audio"
    mel = _mel(seed=1)
    with torch.no_grad():
        theirs = model.model.multi_modal_projector(
            model.model.audio_tower(mel).last_hidden_state).reshape(-1, 48)
        ours = encoder.eval()(*_packed(mel))
    assert ours.shape == theirs.shape == (2 * audio_tokens(FRAMES), 48)
    assert theirs.std() > 0.5
    diff = (ours - theirs).abs().max().item()
    assert diff <= TOL, diff


def test_export_is_transformers_state(whisper, qwen2_audio):
    model, path = whisper
    encoder, _ = audio_from_hf(path, out_dim=8)
    ours = audio_to_hf_state(encoder)
    theirs = {"model.encoder." + k: v for k, v in model.model.encoder.state_dict().items()}
    assert ours.keys() == theirs.keys()
    for name, x in theirs.items():
        assert torch.equal(ours[name], x), name
    model, path = qwen2_audio
    ours = audio_to_hf_state(audio_from_hf(path)[0])
    theirs = {f"{prefix}.{k}": v for prefix, module in
              (("audio_tower", model.model.audio_tower),
               ("multi_modal_projector", model.model.multi_modal_projector))
              for k, v in module.state_dict().items()}
    assert ours.keys() == theirs.keys()
    for name, x in theirs.items():
        assert torch.equal(ours[name], x), name


def test_an_encoder_written_alone_loads_in_transformers_and_back(whisper, qwen2_audio,
                                                                  tmp_path):
    """Each layout as transformers' encoder class saves it alone: that class loads it with no
    custom code and gives our features; the projection to the LLM width beside it is ours;
    read back, each is the same encoder, projector included."""
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from omniscale.encoders.hf import audio_to_hf_dir

    mel = _mel(seed=2)
    for (_, path), cls, out_dim in ((whisper, WhisperEncoder, 40),
                                    (qwen2_audio, Qwen2AudioEncoder, None)):
        encoder, _ = audio_from_hf(path, out_dim=out_dim)
        out = audio_to_hf_dir(encoder.eval(), tmp_path / cls.__name__)
        loaded = cls.from_pretrained(out).eval()
        head = load_file(out / "projector.safetensors")
        with torch.no_grad():
            hidden = loaded(mel).last_hidden_state.reshape(-1, 32)
            if cls is WhisperEncoder:  # ours pools frame pairs before the projection
                hidden = hidden.view(-1, 2, 32).mean(1)
            theirs = torch.nn.functional.linear(hidden, head["linear.weight"],
                                                head["linear.bias"])
            ours = encoder(*_packed(mel))
        assert theirs.std() > 0.5 and ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() <= TOL, cls.__name__
        again, _ = audio_from_hf(out)  # the width from the projector beside it
        for (name, a), b in zip(encoder.state_dict().items(), again.state_dict().values()):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("layout", ["whisper", "qwen2_audio"])
def test_any_clip_length_gives_geometry_tokens_and_packs_exactly(layout):
    torch.manual_seed(0)
    encoder = AudioEncoder(AudioConfig(n_mels=MELS, d_model=32, n_heads=4, ffn_dim=64,
                                       layout=layout, max_positions=POSITIONS), 24).eval()
    frames = [1, 2, 3, 4, 5, 7, 13, FRAMES, FRAMES + 2]  # FRAMES + 2: the table's overhang row
    mel = torch.randn(sum(frames), MELS)
    with torch.no_grad():
        packed = encoder(mel, torch.tensor(frames))
        alone = [encoder(x, torch.tensor([n])) for x, n in zip(mel.split(frames), frames)]
    assert packed.shape[0] == sum(audio_tokens(n) for n in frames)
    assert encoder.output_lengths(torch.tensor(frames)).tolist() == [audio_tokens(n)
                                                                      for n in frames]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="position table covers 50"):
        encoder(torch.randn(FRAMES + 3, MELS), torch.tensor([FRAMES + 3]))


def test_pool_keeps_an_odd_last_frame_alone():
    x = torch.arange(10.0)[:, None]
    assert pool_pairs(x, [3, 4, 3]).flatten().tolist() == [0.5, 2, 3.5, 5.5, 7.5, 9]


# ---- broken checkpoints: one line naming the file and the tensor ---------------------------

def _one_line_error(path, match: str, **kw) -> str:
    with pytest.raises(UserError, match=match) as info:
        audio_from_hf(path, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_wrong_shape(qwen2_audio, tmp_path):
    _, path = qwen2_audio
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "audio_tower.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    message = _one_line_error(broken, "has shape")
    assert str(broken / "model.safetensors") in message and name in message


def test_missing_shard(whisper, tmp_path):
    model, _ = whisper
    path = tmp_path / "sharded"
    model.save_pretrained(path, max_shard_size="20KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.encoder.layers.0.fc2.weight"
    (path / weight_map[name]).unlink()
    message = _one_line_error(path, "missing shard", out_dim=8)
    assert weight_map[name] in message and "model.encoder." in message


def test_unsupported_architecture_and_missing_width(whisper, tmp_path):
    _, path = whisper
    message = _one_line_error(path, "pass out_dim")
    assert str(path / "config.json") in message
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    config = json.loads((broken / "config.json").read_text())
    config.update(model_type="qwen2_5_omni", architectures=["Qwen2_5OmniModel"])
    (broken / "config.json").write_text(json.dumps(config))
    message = _one_line_error(broken, "not supported", out_dim=8)
    assert str(broken / "config.json") in message and "qwen2_5_omni" in message
