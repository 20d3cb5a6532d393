"""What a rank builds from the run config: the model, the optimizer, the learning-rate curve.

The model is built identically on every rank (same seed, before any sharding), so FSDP starts
from the same weights everywhere; its media geometry is checked against the spec's ``media:``
section and its vocabulary is sized to the spec's tokenizer.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from omniscale.backbone.config import ModelConfig
from omniscale.backbone.omni import OmniModel
from omniscale.dataplane.errors import UserError
from omniscale.encoders.audio import AudioConfig
from omniscale.encoders.vision import VisionConfig
from omniscale.loaders.decode_text import tokenizer_size
from omniscale.loaders.geometry import MediaGeometry
from omniscale.tools.train.config import RunConfig


def model_config(cfg: RunConfig, geometry: MediaGeometry, tokenizer_path) -> ModelConfig:
    """The ModelConfig of ``cfg.model``: preset + overrides, encoders on the spec's geometry,
    and a vocabulary that holds every id of the tokenizer (rounded up to 64)."""
    m = cfg.model
    try:
        base = _hf_backbone(m.init_from.backbone) if m.init_from.backbone else \
            ModelConfig.preset(m.preset)
        overrides = dict(m.overrides)
        for name, value in overrides.items():  # a nested section overrides the preset's fields
            nested = getattr(base, name, None)
            if isinstance(value, dict) and dataclasses.is_dataclass(nested):
                overrides[name] = dataclasses.replace(nested, **value)
        vocab = tokenizer_size(tokenizer_path)
        overrides.setdefault("vocab_size", max(base.vocab_size, -(-vocab // 64) * 64))
        enc = m.encoder_overrides
        unknown = set(enc) - {"vision", "audio"}
        if unknown:
            raise ValueError(f"encoder_overrides: unknown encoder(s) {sorted(unknown)}")
        if m.init_from.vision:  # the checkpoint's tower: its shapes, layout and geometry
            overrides["vision"] = _hf_tower("vision", m.init_from.vision, base.d_model, enc)
        elif m.vision:
            overrides["vision"] = VisionConfig.preset(
                m.vision, patch_size=geometry.patch_size,
                temporal_patch_size=geometry.temporal_patch_size, merge_size=geometry.merge_size,
                **enc.get("vision", {}))
        if m.init_from.audio:
            overrides["audio"] = _hf_tower("audio", m.init_from.audio, base.d_model, enc)
        elif m.audio:
            overrides["audio"] = AudioConfig.preset(m.audio, n_mels=geometry.n_mels,
                                                    **enc.get("audio", {}))
        for name in ("vision", "audio"):
            if overrides.get(name) is not None:
                overrides[name].check_geometry(geometry)
        config = dataclasses.replace(base, **overrides)
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"model: {e}") from None
    if config.vocab_size < vocab:
        raise UserError(f"model.overrides.vocab_size={config.vocab_size}: the tokenizer has "
                        f"{vocab} ids")
    return config


def _hf_tower(kind: str, path: str, width: int, enc: dict):
    """The config of a Hugging Face vision or audio tower (``encoders.hf``), projecting to
    ``width`` (the decoder's); ``encoder_overrides`` that change no shape still apply."""
    from omniscale.encoders import hf

    config = getattr(hf, f"{kind}_source")(path, width)[0]
    return dataclasses.replace(config, **enc.get(kind, {}))


def _hf_backbone(path: str) -> ModelConfig:
    """The decoder of a Hugging Face checkpoint directory (its shapes; weights: init_weights)."""
    from omniscale.backbone.hf import config_from_hf
    from omniscale.backbone.hf_files import CONFIG, read_config

    return config_from_hf(read_config(path), Path(path) / CONFIG)


def init_weights(model: OmniModel, cfg: RunConfig, device: torch.device | None = None) -> None:
    """The weights ``model.init_from`` names, loaded into the built (and parallelized) model:
    each rank reads the tensors one at a time and keeps its own shards (a decoder built on the
    meta device gets memory for them first, on ``device``)."""
    from omniscale.backbone.hf_files import IMPORTED
    from omniscale.parallel.load import fill_parameters

    if not isinstance(model, OmniModel):  # the video task's DiT: nothing to start from
        return
    empty = _materialize(model.decoder, device or torch.device("cpu"))
    if cfg.model.init_from.run:
        _from_run(model, Path(cfg.model.init_from.run))
        if empty:
            _check_filled(model.decoder)
        return
    backbone = cfg.model.init_from.backbone
    if backbone and (Path(backbone) / IMPORTED).is_file():  # omniscale model import-hf
        from torch.distributed.checkpoint.api import CheckpointException

        from omniscale.parallel.dcp import load

        try:
            load(backbone, model.decoder)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 -- a shape: one line
            reason = str(e).strip().splitlines()[-1]  # DCP's report ends with the cause
            raise UserError(f"model.init_from.backbone {backbone}: cannot load "
                            f"({reason}; a vocabulary of another size: "
                            f"import again with --vocab-size {model.config.vocab_size})"
                            ) from None
    elif backbone:
        from omniscale.backbone.hf import read_parameter
        from omniscale.backbone.hf_files import CheckpointDir

        ckpt = CheckpointDir(backbone)
        fill_parameters(model.decoder, lambda name, shape, first: read_parameter(
            ckpt, name, shape, first))
    if empty:
        _check_filled(model.decoder)
    for kind in ("vision", "audio"):
        path = getattr(cfg.model.init_from, kind)
        if path:
            from omniscale.encoders import hf

            read = getattr(hf, f"{kind}_source")(path, model.config.d_model)[2]
            fill_parameters(getattr(model, kind), read, buffers=True)


def _materialize(decoder: torch.nn.Module, device: torch.device) -> bool:
    """A decoder built on the meta device (``build_model``), now parallelized: memory for this
    rank's shards, NaN until filled (so a weight no checkpoint gave cannot pass unnoticed), its
    buffers at their initial values (the experts' selection biases: zero). False when it was
    built for real."""
    if not any(p.is_meta for p in decoder.parameters()):
        return False
    decoder.to_empty(device=device)
    with torch.no_grad():
        for p in decoder.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
        for b in decoder.buffers():
            (b.to_local() if hasattr(b, "to_local") else b).zero_()
    return True


def _check_filled(decoder: torch.nn.Module) -> None:
    """Every weight of a materialized decoder came from the checkpoint (none is still NaN)."""
    for name, p in decoder.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel() and bool(torch.isnan(local).any()):
            raise UserError(f"model.init_from: the checkpoint gave no value for the decoder's "
                            f"{name} (it is built empty when init_from gives the decoder)")


def _from_run(model: OmniModel, path: Path) -> None:
    """Every weight of an earlier run's checkpoint (its newest, given the run directory), in
    whatever layout this run has; one line when it is no checkpoint of this model."""
    from torch.distributed.checkpoint.api import CheckpointException

    from omniscale.parallel.dcp import load
    from omniscale.tools.train import checkpoint

    found = checkpoint.latest(path) if not (path / "meta.json").is_file() else (None, path)
    if found is None:
        raise UserError(f"model.init_from.run {path}: no checkpoint in it (a run directory "
                        "with checkpoints/step-*, or one of those)")
    checkpoint.verify(found[1])  # before DCP unpickles anything
    try:
        load(found[1], model)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- another model: one line
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(f"model.init_from.run {found[1]}: cannot load its weights into this "
                        f"model ({reason})") from None


def build_model(config: ModelConfig, seed: int, device: torch.device,
                decoder_loaded: bool = False) -> OmniModel:
    """The model, seeded by ``seed``. ``decoder_loaded``: ``init_from`` gives every decoder
    weight (``decoder_from_checkpoint``), so the decoder is built on the meta device -- no rank
    ever holds it whole; :func:`init_weights` gives its shards memory after parallelization
    and fills them. The towers are built for real either way: they are small, and a checkpoint
    may lack some of their weights (a new projector)."""
    torch.manual_seed(seed)
    if not decoder_loaded:
        return OmniModel(config).to(device)
    with torch.device("meta"):
        model = OmniModel(config)
    torch.manual_seed(seed)
    for name in ("vision", "audio"):
        tower = getattr(model, name)
        if tower is not None:
            setattr(model, name, type(tower)(tower.config, config.d_model).to(device))
    return model


def decoder_from_checkpoint(cfg: RunConfig) -> bool:
    """Whether ``model.init_from`` gives every decoder weight (an earlier run, or a Hugging
    Face backbone), so the decoder need not be initialised (``build_model``). Not under
    pipeline parallelism: its stages are cut from a built model."""
    init = cfg.model.init_from
    return bool(init.run or init.backbone) and cfg.parallel.pp == 1


def build_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters ``optim.groups`` leaves trained (frozen ones get no state);
    matrices decay, vectors (norms, biases) do not. ``optimizer.lr_scales``: each param
    group's factor on the scheduled learning rate (``step.set_lr``)."""
    from omniscale.tools.train.optim_groups import Groups, param_groups

    o = cfg.optim
    groups, scales = param_groups(model, Groups(tuple(o.groups)), o.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, foreach=False)
    optimizer.lr_scales = scales
    return optimizer


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up over ``warmup_steps`` to ``lr``, then cosine to ``min_lr`` at
    ``decay_steps``, flat after. A pure function of the step: nothing to checkpoint."""
    o, total = cfg.optim, cfg.decay_steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(total - o.warmup_steps, 1)
    t = min((step - o.warmup_steps) / span, 1.0)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * t))
