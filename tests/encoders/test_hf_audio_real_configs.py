"""Hugging Face audio configs as they ship (issue #45 item 7): the config.json of
openai/whisper-large-v3 and of Qwen/Qwen2-Audio-7B-Instruct reach our encoder with every value
it uses -- mel bins, width, layers, heads, FFN width, position table, activation, the
LayerNorm epsilon (fixed at 1e-5 in transformers' Whisper-family encoders) and the LLM width
-- in transformers 4's layout (as published: ``torch_dtype``, the text model's ``rope_theta``
at the top level, Qwen2-Audio's text width left out because it is Qwen2Config's default) and
transformers 5's (``dtype``, ``rope_parameters``, every text size written). The audio fields
are the same in both layouts.

Oracles: transformers itself -- its config class reading the same file, its encoder built
from that config at full size (on the meta device: shapes only) holding our tensor count, and
a tiny model with the published non-size values whose outputs ours must equal after import.
The values below are written from the published config.json files (public data; no network
here): the encoder fields are certain, the rest is as remembered and marked where unsure."""

from __future__ import annotations

import json

import pytest
import torch

from omniscale.encoders.audio import AudioConfig, AudioEncoder
from omniscale.encoders.hf import audio_from_hf, audio_source
from tests.encoders.test_hf_audio import TOL, _perturbed

transformers = pytest.importorskip("transformers")

# config.json of openai/whisper-large-v3 (transformers 4.36 wrote it). The token ids and the
# spec-augment fields are as remembered (the encoder reads none of them).
WHISPER_LARGE_V3 = {
    "_name_or_path": "openai/whisper-large-v3", "activation_dropout": 0.0,
    "activation_function": "gelu", "apply_spec_augment": False,
    "architectures": ["WhisperForConditionalGeneration"], "attention_dropout": 0.0,
    "begin_suppress_tokens": [220, 50257], "bos_token_id": 50257, "classifier_proj_size": 256,
    "d_model": 1280, "decoder_attention_heads": 20, "decoder_ffn_dim": 5120,
    "decoder_layerdrop": 0.0, "decoder_layers": 32, "decoder_start_token_id": 50258,
    "dropout": 0.0, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
    "encoder_layerdrop": 0.0, "encoder_layers": 32, "eos_token_id": 50257, "init_std": 0.02,
    "is_encoder_decoder": True, "mask_feature_length": 10, "mask_feature_min_masks": 0,
    "mask_feature_prob": 0.0, "mask_time_length": 10, "mask_time_min_masks": 2,
    "mask_time_prob": 0.05, "max_length": 448, "max_source_positions": 1500,
    "max_target_positions": 448, "median_filter_width": 7, "model_type": "whisper",
    "num_hidden_layers": 32, "num_mel_bins": 128, "pad_token_id": 50256,
    "scale_embedding": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "use_weighted_layer_sum": False, "vocab_size": 51866}

# config.json of Qwen/Qwen2-Audio-7B-Instruct (transformers 4.45.dev wrote it). Its text_config
# names only what differs from Qwen2Config's defaults: no hidden_size (4096), layers or heads
# (32 each). Unsure: whether audio_config also lists the dropout fields (all 0.0, the
# defaults; read by nothing at inference).
QWEN2_AUDIO_7B_INSTRUCT = {
    "architectures": ["Qwen2AudioForConditionalGeneration"],
    "audio_config": {"model_type": "qwen2_audio_encoder", "num_mel_bins": 128,
                     "encoder_layers": 32, "encoder_attention_heads": 20,
                     "encoder_ffn_dim": 5120, "d_model": 1280, "dropout": 0.0,
                     "attention_dropout": 0.0, "activation_function": "gelu",
                     "activation_dropout": 0.0, "scale_embedding": False,
                     "initializer_range": 0.02, "max_source_positions": 1500},
    "audio_token_index": 151646, "ignore_index": -100, "model_type": "qwen2_audio",
    "text_config": {"bos_token_id": 151643, "eos_token_id": 151645, "intermediate_size": 11008,
                    "max_position_embeddings": 8192, "model_type": "qwen2",
                    "rms_norm_eps": 1e-05, "rope_theta": 10000, "sliding_window": 32768,
                    "torch_dtype": "bfloat16", "use_mrope": False, "vocab_size": 156032},
    "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0", "vocab_size": 156032}

# what every value that is not a size must become in ours
PUBLISHED_ENCODER = dict(n_mels=128, d_model=1280, n_layers=32, n_heads=20, ffn_dim=5120,
                         norm_eps=1e-5, max_positions=1500)
# sizes scaled down for a model built here (head dim 64 and FFN ratio 4 as published;
# mel bins and the 1500-row position table kept as published)
SCALED = dict(d_model=128, encoder_attention_heads=2, encoder_ffn_dim=512, encoder_layers=2)


def _layouts(config: dict) -> dict[str, dict]:
    """The same config as transformers 4 and 5 write it: ``torch_dtype`` or ``dtype``, the
    text model's theta at the top level or under ``rope_parameters``, Qwen2Config's default
    text sizes left out (as published) or written."""
    def v4(c: dict, text: bool = False) -> dict:
        out = {("torch_dtype" if k == "dtype" else k): v for k, v in c.items()
               if k != "rope_parameters"}
        if text and "rope_parameters" in c:
            out.update(rope_theta=c["rope_parameters"]["rope_theta"], rope_scaling=None)
        return out

    def v5(c: dict, text: bool = False) -> dict:
        out = {("dtype" if k == "torch_dtype" else k): v for k, v in c.items()
               if k not in ("rope_theta", "rope_scaling")}
        if text:
            theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta"))
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
            out = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, **out}
        return out

    layouts = {}
    for name, convert in (("transformers-4", v4), ("transformers-5", v5)):
        out = convert(config)
        if "text_config" in config:
            out["text_config"] = convert(config["text_config"], text=True)
        if "audio_config" in config:
            out["audio_config"] = convert(config["audio_config"])
        layouts[name] = out
    return layouts


def _config_dir(tmp_path, config: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


LAYOUTS = ["transformers-4", "transformers-5"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_published_whisper_large_v3_config(tmp_path, layout):
    path = _config_dir(tmp_path, _layouts(WHISPER_LARGE_V3)[layout])
    config, width, _ = audio_source(path, out_dim=4096)  # Whisper has no projector
    assert config == AudioConfig(**PUBLISHED_ENCODER, layout="whisper") and width == 4096
    theirs = transformers.AutoConfig.from_pretrained(path)
    assert (theirs.num_mel_bins, theirs.d_model, theirs.encoder_layers,
            theirs.encoder_attention_heads, theirs.encoder_ffn_dim,
            theirs.max_source_positions) == (128, 1280, 32, 20, 5120, 1500)
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    encoder = _on_meta(lambda: WhisperEncoder(theirs))
    _same_tensor_count(AudioEncoder, config, width, encoder, projector=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_published_qwen2_audio_config_with_its_text_width_left_out(tmp_path, layout):
    """As published, text_config has no hidden_size: the width is Qwen2Config's 4096 (the
    import once asked for ``out_dim`` instead, as if the checkpoint had no projector)."""
    path = _config_dir(tmp_path, _layouts(QWEN2_AUDIO_7B_INSTRUCT)[layout])
    config, width, _ = audio_source(path)
    assert config == AudioConfig(**PUBLISHED_ENCODER, layout="qwen2_audio") and width == 4096
    theirs = transformers.AutoConfig.from_pretrained(path)
    assert theirs.text_config.hidden_size == width  # transformers' own default, read alike
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    encoder = _on_meta(lambda: Qwen2AudioEncoder(theirs.audio_config))
    _same_tensor_count(AudioEncoder, config, width, encoder, projector=True)


def _on_meta(build):
    with torch.device("meta"):
        return build()


def _same_tensor_count(cls, config, width, hf_encoder, projector: bool) -> None:
    """Our full-size encoder (meta device) holds what transformers' does, element for element:
    theirs has no k bias (ours is zero there) and no projector (Qwen2-Audio's is
    ``multi_modal_projector``: d_model -> width)."""
    ours = _on_meta(lambda: cls(config, width))
    count = sum(t.numel() for t in ours.state_dict().values())
    theirs = sum(t.numel() for t in hf_encoder.state_dict().values())
    k_bias = config.n_layers * config.d_model
    head = config.d_model * width + width
    assert count == theirs + k_bias + head
    if projector:  # Qwen2-Audio's projector is part of the checkpoint: its size is published
        assert head == 1280 * 4096 + 4096


# ---- tiny models with the published non-size values ------------------------------------------

def _mel(clips: int = 2) -> torch.Tensor:
    """[clips, 128 mels, 3000 frames]: the fixed window transformers takes."""
    return torch.randn(clips, 128, 3000, generator=torch.Generator().manual_seed(0))


def _packed(mel_BMF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (mel_BMF.transpose(1, 2).reshape(-1, mel_BMF.shape[1]),
            torch.full((mel_BMF.shape[0],), mel_BMF.shape[2]))


def _relayout(path, layout: str) -> dict:
    """Rewrite the saved config.json in ``layout``; the text as read back."""
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(_layouts(written)[layout]))
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    decoder = dict(decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=512)
    published = {k: v for k, v in WHISPER_LARGE_V3.items()
                 if k not in ("_name_or_path", "architectures", "torch_dtype",
                              "transformers_version", "max_length", "num_hidden_layers")}
    model = _perturbed(transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(**{**published, **SCALED, **decoder, "vocab_size": 64,
                                      "begin_suppress_tokens": None, "bos_token_id": 1,
                                      "eos_token_id": 1, "pad_token_id": 0,
                                      "decoder_start_token_id": 2})))
    path = tmp_path_factory.mktemp("whisper") / "ckpt"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def tiny_qwen2_audio(tmp_path_factory):
    audio = {**QWEN2_AUDIO_7B_INSTRUCT["audio_config"], **SCALED}
    text = dict(QWEN2_AUDIO_7B_INSTRUCT["text_config"], hidden_size=96, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                vocab_size=64, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    text.pop("torch_dtype")
    model = _perturbed(transformers.Qwen2AudioForConditionalGeneration(
        transformers.Qwen2AudioConfig(audio_config=audio, text_config=text,
                                      audio_token_index=5)))
    path = tmp_path_factory.mktemp("qwen2_audio") / "ckpt"
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tiny_whisper_with_the_published_values_matches_transformers(tiny_whisper, layout):
    model, path = tiny_whisper
    written = _relayout(path, layout)
    assert ("torch_dtype" in written) == (layout == "transformers-4")
    encoder, config = audio_from_hf(path, out_dim=40)
    assert (config.n_mels, config.max_positions, config.n_heads, config.ffn_dim,
            config.norm_eps) == (128, 1500, 2, 512, 1e-5)
    mel = _mel()
    with torch.no_grad():
        theirs = model.model.encoder(mel).last_hidden_state.reshape(-1, 128)
        ours, rows = encoder.eval().features(*_packed(mel))
    assert rows == [1500, 1500] and ours.shape == theirs.shape and theirs.std() > 0.5
    assert (ours - theirs).abs().max().item() <= TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tiny_qwen2_audio_with_the_published_values_matches_transformers(tiny_qwen2_audio,
                                                                           layout):
    model, path = tiny_qwen2_audio
    written = _relayout(path, layout)
    assert ("rope_theta" in written["text_config"]) == (layout == "transformers-4")
    encoder, config = audio_from_hf(path)
    assert (config.n_mels, config.max_positions, config.layout) == (128, 1500, "qwen2_audio")
    mel = _mel()
    with torch.no_grad():
        theirs = model.model.multi_modal_projector(
            model.model.audio_tower(mel).last_hidden_state).reshape(-1, 96)
        ours = encoder.eval()(*_packed(mel))
    assert ours.shape == theirs.shape == (2 * 750, 96) and theirs.std() > 0.5
    assert (ours - theirs).abs().max().item() <= TOL
