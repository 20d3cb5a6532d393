"""Hugging Face checkpoints -> our encoders, and back: Qwen2-VL's vision tower, Whisper's encoder
and Qwen2-Audio's audio tower with its projector.

A checkpoint is a directory as ``save_pretrained`` writes it: ``config.json`` and
``model.safetensors``, or shards listed by ``model.safetensors.index.json``. The encoder's config
comes from ``config.json`` (missing fields take transformers' defaults, since ``save_pretrained``
leaves out fields equal to them), the encoder is built in the matching layout, and each of its
tensors is read on its own (``encoders.hf_files.CheckpointDir``: never a whole file at once),
shape-checked against the config before its data is read, and copied in. Anything wrong -- no
config, an unsupported ``model_type``, a shard missing, a tensor missing or of the wrong shape
-- is a ``UserError`` of one line naming the file and the tensor or field.

Tensor names: transformers 5 saves Qwen2-VL's tower under ``visual.`` and Qwen2-Audio's under
``audio_tower.`` / ``multi_modal_projector.``; Whisper's encoder is ``model.encoder.``
(``WhisperForConditionalGeneration``) or ``encoder.`` (``WhisperModel``). Each is also looked
for under ``model.`` (how some conversions save them); the first that holds the tower wins. A
tower saved alone (``qwen2_vl_vision``, ``qwen2_audio_encoder``, a bare ``WhisperEncoder``; what
``vision_to_hf_dir`` / ``audio_to_hf_dir`` write) has its tensors at the top level.

``out_dim``: the LLM width. By default the checkpoint's own (Qwen2-VL's merger output, Qwen2-
Audio's text width); another width leaves the last projection (``merger.fc2``, ``projector``)
freshly initialised, as it is for Whisper, which has no projector (there ``out_dim`` is needed).
The reader names that projection (``TowerReader.fresh``), so a trainer can refuse to start one
from scratch unless asked (``model.fresh_projector``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from omniscale.encoders.audio import AudioConfig, AudioEncoder
from omniscale.encoders.hf_files import CONFIG, INDEX, SINGLE, CheckpointDir, read_config
from omniscale.encoders.vision import QWEN2_VL, VisionConfig, VisionEncoder
from omniscale.errors import UserError

Reader = Callable[..., "torch.Tensor | None"]  # (name, shape[, first_expert]) -> tensor

# transformers' config defaults for the fields we read (save_pretrained omits defaults).
QWEN2_VL_VISION_DEFAULTS = dict(depth=32, embed_dim=1280, hidden_size=3584,
                                hidden_act="quick_gelu", mlp_ratio=4, num_heads=16,
                                in_channels=3, patch_size=14, spatial_merge_size=2,
                                temporal_patch_size=2)
WHISPER_DEFAULTS = dict(num_mel_bins=80, encoder_layers=4, encoder_attention_heads=6,
                        encoder_ffn_dim=1536, d_model=384, max_source_positions=1500,
                        activation_function="gelu")
QWEN2_AUDIO_DEFAULTS = dict(WHISPER_DEFAULTS, num_mel_bins=128, encoder_layers=32,
                            encoder_attention_heads=20, encoder_ffn_dim=5120, d_model=1280)
# Qwen2Config's width: Qwen2-Audio-7B(-Instruct)'s published text_config leaves it out
QWEN2_TEXT_DEFAULTS = dict(hidden_size=4096)
VISION_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu"}
AUDIO_PROJECTOR = "projector.safetensors"  # an exported audio tower's projection to the LLM


@dataclass(frozen=True)
class Tensor:
    """One of our tensors and the HF tensors it is made of: ``parts`` concatenated along dim 0
    (None: zeros, Whisper's absent k bias), each of shape ``shape`` (None: an equal split of
    ours, e.g. q/k/v of a fused qkv)."""

    ours: str
    parts: tuple[str | None, ...]
    shape: tuple[int, ...] | None = None


# ---- reading ----------------------------------------------------------------------------

def vision_from_hf(path: str | Path, out_dim: int | None = None
                   ) -> tuple[VisionEncoder, VisionConfig]:
    """Qwen2-VL's vision tower (``model_type`` ``qwen2_vl``, or a saved tower alone,
    ``qwen2_vl_vision``) as our encoder, with its weights."""
    return _tower(VisionEncoder, path, *vision_source(path, out_dim))


def vision_source(path: str | Path, out_dim: int | None = None
                  ) -> tuple[VisionConfig, int, "TowerReader"]:
    """The config, output width and tensor reader of a Qwen2-VL checkpoint's vision tower
    (:func:`vision_from_hf`; a trainer fills its sharded tower with the reader)."""
    directory = Path(path)
    raw, config_path = _read_config(directory)
    model_type = raw.get("model_type")
    if model_type == "qwen2_vl":
        hf = {**QWEN2_VL_VISION_DEFAULTS, **raw.get("vision_config", {})}
        prefixes = ("visual.", "model.visual.")
    elif model_type == "qwen2_vl_vision":
        hf = {**QWEN2_VL_VISION_DEFAULTS, **raw}
        prefixes = ("",)
    else:
        raise _unsupported(config_path, raw, "vision_from_hf reads Qwen2-VL (qwen2_vl)")
    act = hf["hidden_act"]
    if act not in VISION_ACTS:
        raise UserError(f"{config_path}: vision_config.hidden_act {act!r} is not supported "
                        f"(choose one of {', '.join(VISION_ACTS)})")
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    config = _build(config_path, VisionConfig, **{**QWEN2_VL, "mlp": VISION_ACTS[act]},
                    patch_size=_int_size(hf, "patch_size", config_path),
                    temporal_patch_size=_int_size(hf, "temporal_patch_size", config_path),
                    merge_size=hf["spatial_merge_size"],
                    in_channels=hf.get("in_chans", hf["in_channels"]), d_model=hf["embed_dim"],
                    n_layers=hf["depth"], n_heads=hf["num_heads"],
                    ffn_dim=int(hf["embed_dim"] * hf["mlp_ratio"]), rope_theta=float(theta))
    width = hf["hidden_size"]
    ckpt = _weights(directory)
    prefix = ckpt.prefix(prefixes, "patch_embed.proj.weight")
    keep = out_dim in (None, width)
    specs = [t for t in vision_tensors(config, prefix)
             if keep or not t.ours.startswith("merger.fc2.")]
    return config, out_dim or width, tower_reader(ckpt, specs, None if keep else "merger.fc2",
                                                  width)


def audio_from_hf(path: str | Path, out_dim: int | None = None
                  ) -> tuple[AudioEncoder, AudioConfig]:
    """Whisper's encoder (``model_type`` ``whisper``: a fresh projector to ``out_dim``), or
    Qwen2-Audio's audio tower and projector (``qwen2_audio``; a saved tower alone,
    ``qwen2_audio_encoder``, has no projector), as our encoder with its weights."""
    return _tower(AudioEncoder, path, *audio_source(path, out_dim))


def audio_source(path: str | Path, out_dim: int | None = None
                 ) -> tuple[AudioConfig, int, "TowerReader"]:
    """The config, output width and tensor reader of an audio checkpoint
    (:func:`audio_from_hf`)."""
    directory = Path(path)
    raw, config_path = _read_config(directory)
    model_type = raw.get("model_type")
    width = None
    if model_type == "whisper":  # "": an encoder saved alone (WhisperEncoder, audio_to_hf_dir)
        hf, layout = {**WHISPER_DEFAULTS, **raw}, "whisper"
        prefixes, head = ("model.encoder.", "encoder.", ""), None
    elif model_type == "qwen2_audio":
        hf, layout = {**QWEN2_AUDIO_DEFAULTS, **raw.get("audio_config", {})}, "qwen2_audio"
        prefixes = ("audio_tower.", "model.audio_tower.")
        head = ("multi_modal_projector.", "model.multi_modal_projector.")
        width = {**QWEN2_TEXT_DEFAULTS, **raw.get("text_config", {})}["hidden_size"]
    elif model_type == "qwen2_audio_encoder":
        hf, layout = {**QWEN2_AUDIO_DEFAULTS, **raw}, "qwen2_audio"
        prefixes, head = ("",), None
    else:
        raise _unsupported(config_path, raw, "audio_from_hf reads whisper, qwen2_audio and "
                           "qwen2_audio_encoder")
    if hf["activation_function"] != "gelu":
        raise UserError(f"{config_path}: activation_function {hf['activation_function']!r} is "
                        "not supported (gelu)")
    ckpt = _weights(directory)
    if head is None and (directory / AUDIO_PROJECTOR).is_file():  # audio_to_hf_dir's
        ckpt.add(directory / AUDIO_PROJECTOR)
        head, width = ("",), ckpt.shape("linear.weight")[0]
    if out_dim is None and width is None:
        raise UserError(f"{config_path}: a {model_type} checkpoint has no projector to the LLM "
                        "width: pass out_dim")
    config = _build(config_path, AudioConfig, n_mels=hf["num_mel_bins"], d_model=hf["d_model"],
                    n_layers=hf["encoder_layers"], n_heads=hf["encoder_attention_heads"],
                    ffn_dim=hf["encoder_ffn_dim"], norm_eps=1e-5, layout=layout,
                    max_positions=hf["max_source_positions"])
    specs = audio_tensors(config, ckpt.prefix(prefixes, "conv1.weight"))
    keep_head = head is not None and out_dim in (None, width)
    if keep_head:
        specs += _projector_tensors(ckpt.prefix(head, "linear.weight"))
    return config, out_dim or width, tower_reader(ckpt, specs,
                                                  None if keep_head else "projector", width)


# ---- writing ----------------------------------------------------------------------------

def vision_to_hf_state(encoder: VisionEncoder, prefix: str = "visual."
                       ) -> dict[str, torch.Tensor]:
    """Our Qwen2-VL-layout encoder's state under transformers' names (a
    ``Qwen2VLForConditionalGeneration`` checkpoint's ``visual.`` tensors)."""
    c = encoder.config
    if (c.norm, c.bias) != ("layer", True) or c.mlp not in VISION_ACTS.values():
        raise ValueError(f"vision encoder layout norm={c.norm} mlp={c.mlp} bias={c.bias}: not "
                         "Qwen2-VL's (encoders.vision.QWEN2_VL)")
    return _to_hf(encoder, vision_tensors(c, prefix))


def vision_to_hf_dir(encoder: VisionEncoder, out: str | Path) -> Path:
    """Our Qwen2-VL-layout encoder as a tower alone, the way transformers saves one
    (``model_type`` ``qwen2_vl_vision``): ``Qwen2VisionTransformerPretrainedModel
    .from_pretrained(out)`` loads it, and so does :func:`vision_from_hf`. ``out`` must not
    exist."""
    from omniscale.encoders.hf_files import write_checkpoint_dir

    c = encoder.config
    if c.rope_theta != 10000.0:  # transformers' vision rotary has no theta of its own
        raise ValueError(f"vision encoder rope_theta {c.rope_theta}: Qwen2-VL's tower has "
                         "10000 only")
    if c.ffn_dim % c.d_model:  # transformers' config takes an integer mlp_ratio
        raise ValueError(f"vision encoder ffn_dim {c.ffn_dim}: Qwen2-VL's tower needs a "
                         f"multiple of d_model {c.d_model}")
    state = vision_to_hf_state(encoder, prefix="")
    config = {"model_type": "qwen2_vl_vision",
              "architectures": ["Qwen2VisionTransformerPretrainedModel"],
              "depth": c.n_layers, "embed_dim": c.d_model,
              "hidden_size": int(state["merger.mlp.2.weight"].shape[0]),
              "hidden_act": c.mlp, "mlp_ratio": c.ffn_dim // c.d_model, "num_heads": c.n_heads,
              "in_channels": c.in_channels, "patch_size": c.patch_size,
              "spatial_merge_size": c.merge_size, "temporal_patch_size": c.temporal_patch_size,
              "torch_dtype": "float32"}
    return write_checkpoint_dir(out, config, state.items())


def audio_to_hf_state(encoder: AudioEncoder, prefix: str | None = None
                      ) -> dict[str, torch.Tensor]:
    """Our Whisper-layout encoder's state under transformers' names: ``model.encoder.``
    (Whisper: the projector, which Whisper lacks, is left out) or ``audio_tower.`` plus
    ``multi_modal_projector.linear.`` (Qwen2-Audio)."""
    c = encoder.config
    if c.layout == "omniscale":
        raise ValueError("audio encoder layout omniscale: transformers has no such layout")
    if c.layout == "whisper":
        return _to_hf(encoder, audio_tensors(c, prefix or "model.encoder."))
    return _to_hf(encoder, audio_tensors(c, prefix or "audio_tower.")
                  + _projector_tensors("multi_modal_projector."))


def audio_to_hf_dir(encoder: AudioEncoder, out: str | Path) -> Path:
    """Our Whisper- or Qwen2-Audio-layout encoder as transformers saves the encoder alone
    (``WhisperEncoder`` / ``Qwen2AudioEncoder``, ``model_type`` ``whisper`` /
    ``qwen2_audio_encoder``: ``from_pretrained(out)`` loads it), and its projection to the
    LLM width, which neither class has, beside it as ``projector.safetensors`` under
    Qwen2-Audio's names (``linear.``). :func:`audio_from_hf` reads both back. ``out`` must
    not exist."""
    import tempfile

    from safetensors.torch import save_file

    from omniscale.encoders.hf_files import write_checkpoint_dir

    c = encoder.config
    if c.layout == "omniscale":
        raise ValueError("audio encoder layout omniscale: transformers has no such layout")
    if c.norm_eps != 1e-5:  # transformers' Whisper-family LayerNorms are fixed at 1e-5
        raise ValueError(f"audio encoder norm_eps {c.norm_eps}: Whisper's is 1e-5")
    config = {"model_type": "whisper" if c.layout == "whisper" else "qwen2_audio_encoder",
              "num_mel_bins": c.n_mels, "encoder_layers": c.n_layers,
              "encoder_attention_heads": c.n_heads, "encoder_ffn_dim": c.ffn_dim,
              "d_model": c.d_model, "max_source_positions": c.max_positions,
              "activation_function": "gelu", "torch_dtype": "float32"}
    state = _to_hf(encoder, audio_tensors(c, ""))
    with tempfile.TemporaryDirectory() as tmp:
        head = Path(tmp) / AUDIO_PROJECTOR
        save_file(_to_hf(encoder, _projector_tensors("")), str(head), metadata={"format": "pt"})
        return write_checkpoint_dir(out, config, state.items(), [head])


# ---- name maps --------------------------------------------------------------------------

def vision_tensors(c: VisionConfig, prefix: str) -> list[Tensor]:
    """Our Qwen2-VL-layout vision encoder's tensors and their HF names."""
    kernel = (c.d_model, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
    # Our patch embedding is the Conv3d's kernel flattened: both take (channel, frame, row,
    # col) patch vectors.
    out = [Tensor("patch_embed.weight", (prefix + "patch_embed.proj.weight",), kernel)]
    block = [("attn_norm", "norm1"), ("qkv", "attn.qkv"), ("out", "attn.proj"),
             ("ffn_norm", "norm2"), ("up", "mlp.fc1"), ("down", "mlp.fc2")]
    for i in range(c.n_layers):
        out += _pairs(f"blocks.{i}.", f"{prefix}blocks.{i}.", block)
    return out + _pairs("merger.", prefix + "merger.",
                        [("norm", "ln_q"), ("fc1", "mlp.0"), ("fc2", "mlp.2")])


def audio_tensors(c: AudioConfig, prefix: str) -> list[Tensor]:
    """Our Whisper-layout audio encoder's tensors (but the projector) and their HF names."""
    out = _pairs("", prefix, [("conv1", "conv1"), ("conv2", "conv2"), ("norm", "layer_norm")])
    out.append(Tensor("pos_embed", (prefix + "embed_positions.weight",)))
    block = [("attn_norm", "self_attn_layer_norm"), ("out", "self_attn.out_proj"),
             ("ffn_norm", "final_layer_norm"), ("up", "fc1"), ("down", "fc2")]
    for i in range(c.n_layers):
        ours, hf = f"blocks.{i}.", f"{prefix}layers.{i}.self_attn."
        out += _pairs(ours, f"{prefix}layers.{i}.", block)
        out.append(Tensor(ours + "qkv.weight", tuple(hf + n + "_proj.weight" for n in "qkv")))
        out.append(Tensor(ours + "qkv.bias", (hf + "q_proj.bias", None, hf + "v_proj.bias")))
    return out


def _projector_tensors(prefix: str) -> list[Tensor]:
    return _pairs("projector.", prefix + "linear.", [("", "")])


def _pairs(ours: str, hf: str, names: list[tuple[str, str]]) -> list[Tensor]:
    """Weight and bias of each (our module, HF module) pair under these prefixes, one part
    each ("" names the prefix's own module)."""
    def join(prefix: str, module: str, leaf: str) -> str:
        return prefix + (module + "." if module else "") + leaf

    return [Tensor(join(ours, a, leaf), (join(hf, b, leaf),))
            for a, b in names for leaf in ("weight", "bias")]


def _part_shapes(spec: Tensor, ours: tuple[int, ...]) -> list[tuple[int, ...]]:
    if spec.shape is not None:
        return [spec.shape] * len(spec.parts)
    rows = ours[0] // len(spec.parts)
    return [(rows, *ours[1:])] * len(spec.parts)


def _to_hf(encoder: nn.Module, specs: list[Tensor]) -> dict[str, torch.Tensor]:
    state = encoder.state_dict()
    out = {}
    for spec in specs:
        ours = state[spec.ours]
        shapes = _part_shapes(spec, tuple(ours.shape))
        for name, piece, shape in zip(spec.parts, ours.chunk(len(spec.parts)), shapes):
            if name is not None:
                out[name] = piece.reshape(shape).clone()
    return out


# ---- files ------------------------------------------------------------------------------

def _read_config(directory: Path) -> tuple[dict, Path]:
    return read_config(directory), directory / CONFIG


class ConfigOnly(CheckpointDir):
    """A checkpoint directory holding ``config.json`` but no weights (none downloaded yet):
    enough for the tower's config and shapes -- a model built on the meta device, a layout
    checked -- while reading any tensor is one line naming the directory. Without it, the
    trainer's layout check would need the weights' listing before it needs the weights."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = read_config(self.path)
        self.listing, self.where = self.path / CONFIG, {}

    def prefix(self, candidates: tuple[str, ...], probe: str) -> str:
        return candidates[0]  # no tensor to probe; a read fails in _file before names matter

    def _file(self, name: str) -> Path:
        if name in self.where:  # a part saved beside the config (``add``)
            return super()._file(name)
        raise UserError(f"{self.path}: no {SINGLE} or {INDEX}: its {CONFIG} gives the tower's "
                        f"shapes, not its weights (tensor {name})")


def _weights(directory: Path) -> CheckpointDir:
    """The checkpoint's tensors, or :class:`ConfigOnly` when it holds none."""
    if (directory / SINGLE).is_file() or (directory / INDEX).is_file():
        return CheckpointDir(directory)
    return ConfigOnly(directory)


def _tower(cls, path: str | Path, config, width: int, read: Reader):
    """A tower of ``config`` projecting to ``width``, filled from ``read``; with its config."""
    encoder = _build(Path(path) / CONFIG, cls, config, width)
    load_tower(encoder, read)
    return encoder, config


def _build(config_path: Path, cls, *args, **kwargs):
    """``cls(*args, **kwargs)``, its complaints about the config as one-line user errors."""
    try:
        return cls(*args, **kwargs)
    except (ValueError, TypeError) as e:
        raise UserError(f"{config_path}: {_line(e)}") from None


def _unsupported(config_path: Path, raw: dict, supported: str) -> UserError:
    return UserError(f"{config_path}: model_type {raw.get('model_type')!r} (architectures "
                     f"{raw.get('architectures')}) is not supported: {supported}")


def _int_size(hf: dict, field: str, config_path: Path) -> int:
    """Qwen2-VL allows a patch size per axis; ours is square."""
    value = hf[field]
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise UserError(f"{config_path}: vision_config.{field} {value}: only equal sizes "
                            "per axis are supported")
        value = value[0]
    return int(value)


def _line(error: Exception) -> str:
    return " ".join(str(error).split())


class TowerReader:
    """``read(name, shape)``: our tensor ``name`` made of its spec's HF tensors (each read
    alone, shape-checked first); None for tensors under ``fresh`` (a module name: the
    projection the checkpoint cannot give), which keep their initial values. ``own_width``:
    the LLM width the checkpoint's own projection maps to (None: it has none). A tensor no
    spec maps is our bug, not the checkpoint's."""

    def __init__(self, ckpt: CheckpointDir, specs: list[Tensor], fresh: str | None = None,
                 own_width: int | None = None):
        self.ckpt, self.fresh, self.own_width = ckpt, fresh, own_width
        self.by_name = {spec.ours: spec for spec in specs}

    def __call__(self, name: str, shape: tuple[int, ...], first_expert: int = 0
                 ) -> torch.Tensor | None:
        if self.fresh and name.startswith(self.fresh + "."):
            return None
        if name not in self.by_name:
            raise RuntimeError(f"no HF tensor maps to {name}")
        spec = self.by_name[name]
        pieces = [torch.zeros(part, device="cpu") if hf is None else self.ckpt.get(hf, part)
                  for hf, part in zip(spec.parts, _part_shapes(spec, shape))]
        return torch.cat([p.reshape(-1, *shape[1:]) for p in pieces]).view(shape)


def tower_reader(ckpt: CheckpointDir, specs: list[Tensor], fresh: str | None = None,
                 own_width: int | None = None) -> TowerReader:
    """The :class:`TowerReader` of a checkpoint's tower."""
    return TowerReader(ckpt, specs, fresh, own_width)


@torch.no_grad()
def load_tower(module: nn.Module, read: Reader) -> None:
    """Every tensor of a plain (unsharded) tower from ``read``."""
    for name, target in module.state_dict(keep_vars=True).items():
        value = read(name, tuple(target.shape))
        if value is not None:
            target.copy_(value)
