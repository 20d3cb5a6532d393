"""What a rank builds from the run config: the model, the optimizer, the learning-rate curve.

The model is built on the meta device (shapes, no memory), parallelized, and only then given
memory for this rank's shards and their values (torchtitan's order), so no rank ever holds it
whole: :func:`init_weights` computes each tensor's initial value on the host, one tensor at
a time, by its module's own rule from a generator seeded by (run seed, tensor name), keeps
this rank's slice, then loads what ``model.init_from`` names. The values do not depend on the
layout: one process and N processes (FSDP, TP, EP) start from the same weights, and
:func:`build_model` on a real device gives those same weights to tools that want a whole
model. Pipeline parallelism still cuts its stages from a materialised model (its stages take
their device from the model's parameters). The media geometry is checked against the spec's
``media:`` section and the vocabulary is sized to the spec's tokenizer.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from omniscale.backbone.config import ModelConfig
from omniscale.backbone.omni import OmniModel
from omniscale.encoders.audio import AudioConfig
from omniscale.encoders.vision import VisionConfig
from omniscale.errors import UserError
from omniscale.geometry import MediaGeometry
from omniscale.loaders.decode_text import tokenizer_size
from omniscale.tools.train.config import AUTO, RunConfig

AUTO_PRESET = "tiny"  # the preset of a tower model.vision / model.audio "auto" builds


def resolve_towers(cfg: RunConfig, spec) -> None:
    """``model.vision`` / ``model.audio`` set to ``auto`` made explicit from the run's mixing
    spec (a ``MixSpec``): the tiny preset when a source feeds that tower
    (``spec_media.spec_towers``), else None. The launcher resolves before it writes
    RUN_DIR/config.yaml, so whatever later reads the run (resume, evaluation, export) builds
    the towers it trained."""
    from omniscale.tools.train.spec_media import spec_towers

    m = cfg.model
    if AUTO not in (m.vision, m.audio):
        return
    needed = spec_towers(spec)
    for kind in ("vision", "audio"):
        if getattr(m, kind) == AUTO:
            setattr(m, kind, AUTO_PRESET if kind in needed else None)


def model_config(cfg: RunConfig, geometry: MediaGeometry, tokenizer_path) -> ModelConfig:
    """The ModelConfig of ``cfg.model``: preset + overrides, encoders on the spec's geometry,
    and a vocabulary that holds every id of the tokenizer (rounded up to 64). A tower left
    ``auto`` (no :func:`resolve_towers` with the spec) is built with the tiny preset."""
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
            overrides["vision"] = _hf_tower("vision", m.init_from.vision, base.d_model, enc,
                                            geometry, m.fresh_projector)
        elif m.vision:
            overrides["vision"] = VisionConfig.preset(
                _preset(m.vision), patch_size=geometry.patch_size,
                temporal_patch_size=geometry.temporal_patch_size, merge_size=geometry.merge_size,
                **enc.get("vision", {}))
        if m.init_from.audio:
            overrides["audio"] = _hf_tower("audio", m.init_from.audio, base.d_model, enc,
                                           geometry, m.fresh_projector)
        elif m.audio:
            overrides["audio"] = AudioConfig.preset(_preset(m.audio), n_mels=geometry.n_mels,
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


def _preset(name: str) -> str:
    return AUTO_PRESET if name == AUTO else name


# the media geometry each tower kind fixes, as (the tower config's field, the spec's media: key)
TOWER_GEOMETRY = {"vision": (("patch_size", "patch_size"),
                             ("temporal_patch_size", "temporal_patch_size"),
                             ("merge_size", "merge_size")),
                  "audio": (("n_mels", "n_mels"),)}


def _hf_tower(kind: str, path: str, width: int, enc: dict, geometry: MediaGeometry,
              fresh_projector: bool):
    """The config of a Hugging Face vision or audio tower (``encoders.hf``), projecting to
    ``width`` (the decoder's); ``encoder_overrides`` that change no shape still apply. The
    checkpoint fixes the media geometry (Qwen2-VL: patch 14, temporal 2, merge 2; Whisper:
    80 mel bins): a spec whose ``media:`` differs is one line naming both, and a projector
    the checkpoint cannot give is one line unless ``model.fresh_projector``."""
    from omniscale.encoders import hf

    config, _, read = getattr(hf, f"{kind}_source")(path, width)
    where = f"model.init_from.{kind} {path}"
    wrong = [(ours, theirs) for ours, theirs in TOWER_GEOMETRY[kind]
             if getattr(config, ours) != getattr(geometry, theirs)]
    if wrong:
        tower = ", ".join(f"{theirs}: {getattr(config, ours)}" for ours, theirs in wrong)
        spec = ", ".join(f"{theirs}: {getattr(geometry, theirs)}" for _, theirs in wrong)
        raise UserError(f"{where}: the tower's geometry is {{{tower}}} but the spec's media: "
                        f"has {{{spec}}} (set media: {{{tower}}} in the mixing spec and "
                        f"re-index)")
    if read.fresh is not None and not fresh_projector:
        has = ("has no projector" if read.own_width is None
               else f"projects to width {read.own_width}")
        raise UserError(f"{where}: the tower {has}, the decoder is {width} wide: its "
                        f"{read.fresh} would start untrained (model.fresh_projector: true to "
                        f"train one from scratch)")
    return dataclasses.replace(config, **enc.get(kind, {}))


def _hf_backbone(path: str) -> ModelConfig:
    """The decoder of a Hugging Face checkpoint directory (its shapes; weights: init_weights)."""
    from omniscale.backbone.hf import config_from_hf
    from omniscale.encoders.hf_files import CONFIG, read_config

    return config_from_hf(read_config(path), Path(path) / CONFIG)


def init_weights(model: OmniModel, cfg: RunConfig, device: torch.device | None = None,
                 resume: bool = False) -> None:
    """The built (and parallelized) model's starting weights. A model built on the meta
    device gets memory for this rank's shards on ``device`` and their initial values
    (:func:`init_model`, seeded by ``cfg.seed``); then the weights ``model.init_from`` names
    are loaded, each rank reading the tensors one at a time and keeping its own shards.
    Weights a checkpoint gives are not initialised first: the decoder's when ``init_from``
    gives it (``decoder_from_checkpoint``), every one when ``resume`` (the caller loads the
    run's checkpoint next; ``init_from`` is not read)."""
    from omniscale.encoders.hf_files import IMPORTED
    from omniscale.parallel.load import fill_parameters

    if not isinstance(model, OmniModel):  # the video task's DiT: built for real, by itself
        return
    loaded = ("decoder", "vision", "audio") if resume else \
        ("decoder",) if decoder_from_checkpoint(cfg) else ()
    if any(p.is_meta for p in model.parameters()):
        init_model(model, cfg.seed, device or torch.device("cpu"), loaded,
                   offload=cfg.parallel.cpu_offload)
    else:
        loaded = ()  # built for real (pipeline parallelism): already initialised
    if resume:
        return
    if cfg.model.init_from.run:
        _from_run(model, Path(cfg.model.init_from.run))
        if loaded:
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
        from omniscale.encoders.hf_files import CheckpointDir

        ckpt = CheckpointDir(backbone)
        fill_parameters(model.decoder, lambda name, shape, first: read_parameter(
            ckpt, name, shape, first))
    if loaded:
        _check_filled(model.decoder)
    for kind in ("vision", "audio"):
        path = getattr(cfg.model.init_from, kind)
        if path:
            from omniscale.encoders import hf

            read = getattr(hf, f"{kind}_source")(path, model.config.d_model)[2]
            fill_parameters(getattr(model, kind), read, buffers=True)


def init_model(model: OmniModel, seed: int, device: torch.device,
               loaded: tuple[str, ...] = (), offload: bool = False) -> None:
    """A model built on the meta device (:func:`build_model`), parallelized or not, given
    memory for this rank's shards on ``device`` and their initial values: each tensor is
    computed whole on the host by the rule of the part it belongs to (the ``reset_module`` of
    the decoder or an encoder) from a generator seeded by ``seed`` and its name, and this
    rank keeps its slice (``parallel.load.init_parameters``). The values are the same in
    every layout, one process included; a rank's memory peaks at one whole tensor beyond its
    shards. The caller's RNG state is kept.

    ``loaded``: the parts (``decoder``, ``vision``, ``audio``) whose parameters a checkpoint
    gives next -- NaN until it does, so a weight it lacks cannot pass unnoticed (their buffers
    still get initial values).
    ``offload``: FSDP2's CPU offload -- parameters in host memory, buffers on ``device``."""
    from omniscale.parallel.load import init_parameters

    host = torch.device("cpu")
    model.to_empty(device=host if offload else device)
    with torch.random.fork_rng(devices=[]):
        for name, part in model.named_children():  # a part without a rule: AttributeError
            init_parameters(part, part.reset_module, seed, prefix=f"{name}.",
                            parameters=name not in loaded)
            if name in loaded:
                with torch.no_grad():
                    for p in part.parameters():
                        (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
    if offload:
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)


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


def build_model(config: ModelConfig, seed: int, device: torch.device) -> OmniModel:
    """The model of ``config``. On the meta device, what the trainer builds: shapes only, no
    memory and no values -- parallelize it, then :func:`init_weights` (or :func:`init_model`)
    gives each rank its shards. On any other device, the whole model there, initialised as
    :func:`init_model` initialises every layout of it (seeded by ``seed``): one process's
    starting weights, for tools, evaluation and tests."""
    with torch.device("meta"):
        model = OmniModel(config)
    if device.type != "meta":
        init_model(model, seed, device)
    return model


def decoder_from_checkpoint(cfg: RunConfig) -> bool:
    """Whether ``model.init_from`` gives every decoder weight (an earlier run, or a Hugging
    Face backbone), so the decoder need not be initialised (``init_weights``). Not under
    pipeline parallelism: a stage is initialised, then loaded over."""
    init = cfg.model.init_from
    return bool(init.run or init.backbone) and cfg.parallel.pp == 1


def build_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters ``optim.groups`` leaves trained (frozen ones get no state);
    matrices decay, vectors (norms, biases) do not. ``optimizer.lr_scales``: each param
    group's factor on the scheduled learning rate (``step.set_lr``)."""
    from omniscale.tools.train.optim_groups import Groups, param_groups

    o = cfg.optim
    groups, scales = param_groups(model, Groups(tuple(o.groups)), o.weight_decay)
    # fused: one kernel per dtype and device group, on GPUs and on the CPU alike (DTensors of
    # several meshes included: tests/parallel/test_grads.py). The per-tensor loop, torch's CPU
    # default, sends each of ~10 ops per parameter through DTensor's sharding propagation; on
    # a 2-rank CPU run that was a third of the first step.
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, fused=True)
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
