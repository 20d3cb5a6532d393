"""A run's whole layout applied to its model in one fixed order (torchtitan's
`parallelize_llama`): TP → EP → SP → activation checkpointing → `torch.compile` per block →
FSDP/HSDP, each only when its axis is > 1 or its option is on; for `lm` with pp > 1, PP
first (`apply_pp` cuts the decoder into this rank's stage) and the rest on the stage.

The backbone goes on the backbone mesh and the encoders on **their own** mesh
(`encoder_dp_shard` × `encoder_tp`, `ParallelDims.build_encoder_mesh`), so the two groups are
sized independently: each rank encodes what the plane's encoder plan gives it, whatever its
backbone coordinates. One function per task (`parallelize_omni`, `parallelize_lm`,
`parallelize_video_gen`); the trainer calls one of them and nothing else of `parallel/`'s
`apply_*`.

`Settings` are the run's per-rank knobs beside the mesh sizes: activation checkpointing
(`none|selective|full`), mixed precision (`fp32|bf16`: bf16 parameters for compute, fp32
gradient reduction and fp32 master weights), per-block compile and CPU offload of parameters,
gradients and optimizer state (FSDP2's `CPUOffloadPolicy`). FSDP wraps the model whenever
more than one rank holds different data, or when bf16 or offload asks for its policies, even
in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from omniscale.parallel.checkpointing import apply_ac, decoder_blocks, encoder_blocks, encoders
from omniscale.parallel.expert import apply_ep
from omniscale.parallel.fsdp import apply_fsdp
from omniscale.parallel.mesh import ParallelDims
from omniscale.parallel.pipeline import SCHEDULES, PipelineRunner, apply_pp
from omniscale.parallel.sequence import apply_sp
from omniscale.parallel.tensor import apply_tp

AC_MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Settings:
    """How each rank runs its part of the layout (the run config's `parallel:` knobs)."""

    activation_checkpoint: str = "none"
    mixed_precision: str = "fp32"
    compile: bool = False
    cpu_offload: bool = False
    pp_schedule: str = "1f1b"  # with pp > 1: "gpipe" or "1f1b"
    pp_microbatches: int = 4  # micro-batches per schedule run (1F1B: at least pp)

    def __post_init__(self) -> None:
        if self.activation_checkpoint not in AC_MODES:
            raise ValueError(f"activation_checkpoint={self.activation_checkpoint!r}: choose "
                             f"one of {', '.join(AC_MODES)}")
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={self.pp_schedule!r}: choose one of "
                             f"{', '.join(SCHEDULES)}")
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: choose one of "
                             f"{', '.join(PRECISIONS)}")


@dataclass
class Meshes:
    """What `parallelize_*` built, for the step: `mesh` (backbone axes and flattened `dp`,
    `dp_sp`), `experts` (None without EP), `encoders` (None without encoders)."""

    mesh: DeviceMesh
    experts: DeviceMesh | None
    encoders: DeviceMesh | None
    pipeline: PipelineRunner | None = None  # pp > 1: this rank's stage and its schedule


def compile_blocks(model: nn.Module) -> None:
    """`torch.compile` every decoder and encoder block in place (`Module.compile`: parameter
    names, and so checkpoints, stay those of the eager model). Graph breaks are allowed: the
    varlen attention and the expert loop read `cu_seqlens` and expert counts on the host.
    Shapes are dynamic from the start: packed batches change length every micro-batch, and
    specialising on each length recompiles the blocks again and again."""
    for block in decoder_blocks(model):
        block.compile(dynamic=True)
    for encoder in encoders(model):
        for block in encoder_blocks(encoder):
            block.compile(dynamic=True)


def compute_device(device_type: str) -> torch.device:
    """This process's compute device of the type (the current GPU: the trainer sets it)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _needs_fsdp(dims: ParallelDims, settings: Settings) -> bool:
    return (dims.dp_replicate * dims.dp_shard * dims.sp > 1 or dims.encoder_dp_shard *
            dims.encoder_dp_replicate > 1 or settings.mixed_precision == "bf16"
            or settings.cpu_offload)


def _parallelize(model: nn.Module, dims: ParallelDims, settings: Settings,
                 device_type: str) -> Meshes:
    mesh = dims.build_mesh(device_type)
    has_encoders = bool(encoders(model))
    encoder_mesh = dims.build_encoder_mesh(device_type) if has_encoders else None
    return _apply(model, dims, settings, device_type, mesh, encoder_mesh)


def _apply(model: nn.Module, dims: ParallelDims, settings: Settings, device_type: str,
           mesh: DeviceMesh, encoder_mesh: DeviceMesh | None) -> Meshes:
    """Every axis but PP, in the fixed order, on `model` (a whole model or a pipeline stage)."""
    if dims.tp > 1 or dims.encoder_tp > 1:
        apply_tp(model, mesh["tp"], encoder_mesh["encoder_tp"]
                 if encoder_mesh is not None and dims.encoder_tp > 1 else None)
    expert_mesh = dims.build_expert_mesh(device_type) if dims.ep > 1 else None
    if expert_mesh is not None:
        apply_ep(model, expert_mesh["ep"])
    if dims.sp > 1:
        # the plane's long-short split: aligned groups of up to `sp` of the data ranks
        apply_sp(model, mesh["dp_sp"], dims.sp)
    if settings.activation_checkpoint != "none":
        apply_ac(model, settings.activation_checkpoint)
    if settings.compile:
        compile_blocks(model)
    if _needs_fsdp(dims, settings):
        apply_fsdp(model, mesh, mixed_precision=settings.mixed_precision == "bf16",
                   encoder_mesh=encoder_mesh, expert_mesh=expert_mesh,
                   cpu_offload=settings.cpu_offload)
    return Meshes(mesh, expert_mesh, encoder_mesh)


def parallelize_omni(model: nn.Module, dims: ParallelDims, settings: Settings,
                     device_type: str = "cpu") -> Meshes:
    """The omni model (`backbone.omni.OmniModel`, encoders included), in place."""
    dims.validate_for(model.config)
    return _parallelize(model, dims, settings, device_type)


def parallelize_lm(model: nn.Module, dims: ParallelDims, settings: Settings,
                   device_type: str = "cpu", microbatch_tokens: int | None = None) -> Meshes:
    """A text-only model (an `OmniModel` without encoders), in place. With pp > 1 PP comes
    first: `model.decoder` becomes this rank's stage (`apply_pp`: the same parameter names,
    the other stages' layers dropped), the other axes are applied to the stage, and
    `Meshes.pipeline` runs it. Every micro-batch a stage runs is padded to
    `microbatch_tokens` (the packer's budget)."""
    if dims.pp == 1:
        return parallelize_omni(model, dims, settings, device_type)
    dims.validate_for(model.config)
    if encoders(model):
        raise ValueError(f"pp={dims.pp}: stage 0 takes token ids, so a model with encoders "
                         f"cannot be pipelined yet")
    if microbatch_tokens is None:
        raise ValueError(f"pp={dims.pp}: parallelize_lm needs microbatch_tokens")
    if settings.pp_schedule == "1f1b" and settings.pp_microbatches < dims.pp:
        raise ValueError(f"pp_microbatches={settings.pp_microbatches}: 1F1B needs at least "
                         f"pp={dims.pp} micro-batches per schedule run")
    mesh = dims.build_mesh(device_type)
    # the stages exchange activations in the compute dtype, which FSDP applies only later
    runner = apply_pp(model.decoder, mesh["pp"], settings.pp_schedule,
                      settings.pp_microbatches, microbatch_tokens=microbatch_tokens,
                      activation_dtype=torch.bfloat16 if settings.mixed_precision == "bf16"
                      else None, device=compute_device(device_type))
    model.decoder = runner.module  # frees the other stages' layers
    meshes = _apply(runner.module, dims, settings, device_type, mesh, None)
    meshes.pipeline = runner
    return meshes


def parallelize_video_gen(model: nn.Module, dims: ParallelDims, settings: Settings,
                          device_type: str = "cpu") -> Meshes:
    """The video DiT: data parallelism, checkpointing, compile and precision only (its
    attention runs on its own blocks: no TP, EP or SP)."""
    for name in ("tp", "ep", "sp", "pp", "encoder_tp"):
        if getattr(dims, name) > 1:
            raise ValueError(f"{name}={getattr(dims, name)}: the video_gen task runs data "
                             f"parallel only")
    return _parallelize(model, dims, settings, device_type)

