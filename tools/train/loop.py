"""One trainer rank: plane (rank 0's embedded one, or ``--plane URL``) → RankLoader → model
(FSDP over the ranks when more than one) → AdamW → commit → metrics → checkpoint.

The step itself is ``tools.train.step`` (omni and lm: encoders on the encoder plan, reshard,
backbone micro-batches) or ``tools.train.video_gen`` (the rectified-flow DiT).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.plane import PlaneConfig
from omniscale.errors import UserError
from omniscale.loaders.pipeline import RankLoader
from omniscale.tools.train import checkpoint, optim_groups
from omniscale.tools.train.build import (
    build_model,
    build_optimizer,
    init_weights,
    model_config,
)
from omniscale.tools.train.compute_clock import ComputeClock
from omniscale.tools.train.config import RunConfig, run_spec
from omniscale.tools.train.guard import report_suspects, seeded
from omniscale.tools.train.held_out import HeldOut, evaluates_in_ranks, flat
from omniscale.tools.train.metrics import MetricsWriter, Progress
from omniscale.tools.train.pipeline_step import pipeline_step
from omniscale.tools.train.profiler import step_profiler
from omniscale.tools.train.records import flush
from omniscale.tools.train.step import StepContext, train_step
from omniscale.tools.train.step_audit import StepAudit
from omniscale.tools.train.torchrun import shared_ray
from omniscale.tools.train.watchdog import StepWatchdog, injected_hang


@dataclass
class RankJob:
    """What the launcher hands every rank (picklable: it crosses a spawn)."""

    raw_config: dict
    run_dir: str
    spec: str  # absolute path of the mixing spec
    start_step: int  # 0, or the step of the checkpoint resumed from
    resume_from: str | None  # checkpoint directory
    store: str  # file:// rendezvous of the process group
    progress: bool = True
    plane_url: str | None = None  # an external plane (``omniscale plane serve``): no embedded one
    plane_token: str | None = None
    ray_address: str | None = None  # the job's Ray cluster (``data.loader: ray``)


def plane_config(cfg: RunConfig, dp: int, cost: tuple[float, float] | None = None,
                 frozen_kinds: tuple[str, ...] = ()) -> PlaneConfig:
    """The embedded plane's settings; ``cost``: the model's (α, β) FLOPs per sequence, the
    balancer's cost model (``ModelConfig.cost_coefficients``); ``frozen_kinds``: encoder kinds
    whose tower ``optim.groups`` freezes (priced forward only, ``optim_groups.Groups``)."""
    d = cfg.data
    # parallel.sp: the plane may split a sample over an aligned group of up to that many
    # ranks; longer text is truncated to what such a group holds, longer media samples skipped.
    extra = {}
    if d.costs:  # calibrated on this machine: seconds, encoders priced on their own
        from omniscale.tools.train.cost_model import read_cost_file

        extra = read_cost_file(d.costs)
    elif cost:
        extra = {"cost_linear": cost[0] / cost[1], "cost_quadratic": 1.0}
    return PlaneConfig(dp=dp, micro_batch_tokens=d.micro_batch_tokens, window=d.window,
                       global_batch_tokens=d.global_batch_tokens, sp_max=cfg.parallel.sp,
                       snapshot_every=cfg.checkpoint_every, balance=d.balance,
                       frozen_encoders=tuple(frozen_kinds), **extra)


def device_of(cfg: RunConfig, rank: int) -> torch.device:
    """This process's device: its node-local GPU (``LOCAL_RANK`` under torchrun: global ranks
    count across nodes; the spawning launcher's ranks are local already), or the CPU."""
    kind = cfg.parallel.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_process_group(device: torch.device, job: "RankJob", rank: int, world: int,
                       timeout_s: float) -> None:
    """The job's process group: gloo on CPU; on GPUs NCCL for device tensors *and* gloo for
    host ones (object collectives, the host-side counts), bound to this rank's device
    (``device_id``: NCCL connects eagerly and barriers know their GPU)."""
    gpu = device.type == "cuda"
    dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo", init_method=job.store,
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                            device_id=device if gpu else None)


def barrier(device: torch.device) -> None:
    """A barrier of the world on this rank's device (NCCL would otherwise guess the GPU)."""
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


def _share_url(url: str | None, rank: int, run_dir: Path) -> str:
    """Rank 0's plane URL to every rank (a broadcast; also left in RUN_DIR/plane.url)."""
    box = [url]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        (run_dir / "plane.url").write_text(box[0] + "\n")
    return box[0]


# Known, harmless torch warnings a user cannot act on: DeviceMesh's notice about slicing
# flattened dims (parallel.mesh bookkeeps them) and DCP's single-process load notice.
QUIET = ("Slicing a flattened dim from root mesh",
         "torch.distributed is disabled, unavailable or uninitialized")


def quiet_torch_notices() -> None:
    for message in QUIET:
        warnings.filterwarnings("ignore", message=message)


def train_rank(rank: int, world: int, job: RankJob) -> None:
    quiet_torch_notices()
    cfg = RunConfig.model_validate(job.raw_config)
    run_dir = Path(job.run_dir)
    device = device_of(cfg, rank)
    cfg = cfg.on_device(device.type)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    init_process_group(device, job, rank, world, cfg.watchdog.collective_timeout_s)
    try:
        with shared_ray(cfg, job, rank) as job:
            _train_rank(rank, world, job, cfg, run_dir, device)
    finally:
        dist.destroy_process_group()


def _train_rank(rank: int, world: int, job: RankJob, cfg: RunConfig, run_dir: Path,
                device: torch.device) -> None:
    plane = loader = None
    try:
        spec, mcfg, dims, groups = layout(cfg, world)  # every rank, before the plane starts
        video = mcfg is None
        if job.resume_from:  # a refused checkpoint leaves RUN_DIR/plane as it was
            checkpoint.verify(Path(job.resume_from))
        if rank == 0 and job.plane_url is None:
            cost = mcfg.cost_coefficients() if mcfg is not None else None
            plane = start_embedded(job.spec, run_dir / "plane",
                                   plane_config(cfg, dims.dp_sp, cost, groups.frozen_kinds),
                                   restore_step=job.start_step if job.resume_from else None)
        url = _share_url(job.plane_url or (plane.url if plane else None), rank, run_dir)
        # the plane plans for the data ranks; TP peers load (and commit) the same plan
        data_rank = dims.data_rank(rank)
        loader = make_loader(cfg, url, data_rank, spec, job)
        if video:
            from omniscale.tools.train.video_gen import build_video_model, video_gen_step

            model, step_fn = build_video_model(cfg, spec, device), video_gen_step
        else:
            # on the meta device: init_weights gives each rank memory for its own shards
            # only, after parallelization (pipeline stages are cut from the meta model too)
            model = build_model(mcfg, cfg.seed, torch.device("meta"))
            step_fn = train_step
        optim_groups.freeze(model, groups)  # before FSDP builds its units (parallel.fsdp)
        from omniscale.parallel.fsdp import MixedUnitError

        try:
            meshes = parallelize(cfg)(model, dims, settings_of(cfg, device), device.type)
        except MixedUnitError as e:
            raise optim_groups.unit_error(groups, model, e) from None
        if meshes.pipeline is not None:
            step_fn = pipeline_step
        init_weights(model, cfg, device, resume=bool(job.resume_from))
        optimizer = build_optimizer(model, cfg)
        if job.resume_from:
            checkpoint.load(Path(job.resume_from), model, optimizer, verified=True)
        alpha, beta = mcfg.cost_coefficients() if mcfg is not None else (0.0, 0.0)
        ctx = StepContext(cfg, dims.dp_sp, data_rank, [s.name for s in spec.sources], alpha,
                          beta, peak_flops(cfg, device), device=device,
                          group=meshes.mesh["dp_sp"].get_group()
                          if dims.tp * dims.pp > 1 else None,
                          writer=rank == 0, devices=world,
                          encoder_copies=dims.tp // dims.encoder_tp, tp_rank=dims.tp_rank(rank),
                          pipeline=meshes.pipeline, clock=ComputeClock(device.type),
                          audit=StepAudit(device, cfg.debug.audit_devices,
                                          cfg.debug.count_host_syncs))
        held_out = HeldOut(cfg, run_dir, mcfg.vocab_size if mcfg is not None else None, ctx) \
            if evaluates_in_ranks(cfg) else None
        _loop(ctx, run_dir, job, model, optimizer, loader, spec, step_fn, held_out)
        loader.wait_commits()
        barrier(device)  # nobody stops the plane while another rank still talks to it
    finally:
        if loader is not None:  # a refused commit is raised unless an error is in flight
            loader.close(raise_commit_errors=sys.exc_info()[0] is None)
        if plane is not None:
            plane.stop()


def layout(cfg: RunConfig, world: int):
    """``(spec, model config, ParallelDims, optim_groups.Groups)`` of the run over ``world``
    processes (the model config is None for video_gen); a one-line UserError when the layout
    or ``optim.groups`` cannot work. The launcher checks it before it spawns anything, every
    rank again before the plane starts."""
    spec = run_spec(cfg, cfg.data.spec)
    hf = cfg.model.init_from.backbone or cfg.model.init_from.vision or cfg.model.init_from.audio
    if cfg.task == "video_gen" and hf:
        raise UserError("model.init_from: the video_gen task's DiT has no Hugging Face "
                        "counterpart (omni and lm start from Qwen3 / Qwen3-MoE)")
    mcfg = None if cfg.task == "video_gen" else model_config(cfg, spec.media, spec.tokenizer)
    return spec, mcfg, parallel_dims(cfg, world, mcfg), optim_groups.check(cfg, spec, mcfg)


def parallel_dims(cfg: RunConfig, world: int, mcfg):
    """The run's layout from ``parallel:`` (a one-line UserError naming the axis when it cannot
    work, on every rank before the plane starts)."""
    p = cfg.parallel
    if p.pp > 1 and cfg.task != "lm":
        raise UserError(f"parallel.pp={p.pp}: pipeline stages run the lm task only (stage 0 "
                        f"takes token ids; task is {cfg.task})")
    if p.pp > 1 and p.pp_schedule == "1f1b" and p.pp_microbatches < p.pp:
        raise UserError(f"parallel.pp_microbatches={p.pp_microbatches}: 1F1B needs at least "
                        f"pp={p.pp} micro-batches per schedule run")
    if p.encoder_tp not in (1, p.tp):
        # an encoder TP group must encode the same items: the backbone's TP peers do
        raise UserError(f"parallel.encoder_tp={p.encoder_tp}: must be 1 or tp={p.tp} (its "
                        f"ranks must encode the same items, as TP peers do)")
    if mcfg is None:  # the DiT attends with its own blocks
        for name in ("ep", "sp"):
            if getattr(p, name) > 1:
                raise UserError(f"parallel.{name}={getattr(p, name)}: for the omni and lm tasks "
                                f"only")
    dims = mesh_dims(cfg, world)
    if mcfg is not None:
        try:
            dims.validate_for(mcfg)
        except ValueError as e:
            raise UserError(f"parallel.{e} (with --nproc {world})") from None
    return dims


def mesh_dims(cfg: RunConfig, world: int):
    """``ParallelDims`` of ``parallel:`` over ``world`` processes (a one-line UserError when
    the sizes cannot split it)."""
    from omniscale.parallel import ParallelDims

    p = cfg.parallel
    try:
        return ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, ep=p.ep, sp=p.sp,
                            tp=p.tp, pp=p.pp, encoder_dp_shard=p.encoder_dp_shard,
                            encoder_tp=p.encoder_tp, world_size=world)
    except ValueError as e:
        raise UserError(f"parallel.{e} (with --nproc {world})") from None


def settings_of(cfg: RunConfig, device: torch.device):
    """``parallel.parallelize.Settings`` of the run (mixed_precision auto: bf16 on CUDA)."""
    from omniscale.parallel.parallelize import Settings

    p = cfg.parallel
    precision = p.mixed_precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return Settings(activation_checkpoint=p.activation_checkpoint, mixed_precision=precision,
                    compile=p.compile, cpu_offload=p.cpu_offload, pp_schedule=p.pp_schedule,
                    pp_microbatches=p.pp_microbatches)


def parallelize(cfg: RunConfig):
    """The task's ``parallelize_*`` (parallel/parallelize.py)."""
    from omniscale.parallel import parallelize as plans

    if cfg.task == "lm":  # pipeline stages exchange micro-batches padded to the budget
        return partial(plans.parallelize_lm, microbatch_tokens=cfg.data.micro_batch_tokens)
    return {"omni": plans.parallelize_omni, "video_gen": plans.parallelize_video_gen}[cfg.task]


def make_loader(cfg: RunConfig, url: str, rank: int, spec, job: RankJob):
    """The rank's loader: DataLoader worker processes (``data.loader: workers``) or per-source
    Ray actor pools (``ray``: the job's, in its Ray cluster, ``loaders.ray_cluster``)."""
    args = (url, rank, spec.locations, spec.tokenizer, spec.media)
    # The omni step reshards encoder outputs, so a rank decodes only the media it encodes.
    kw = dict(num_workers=cfg.data.workers, prefetch_steps=cfg.data.prefetch_steps,
              policy=cfg.data.policy, start_step=job.start_step, token=job.plane_token,
              skip_moved_media=cfg.task == "omni", special_tokens=spec.special_tokens,
              indexes=spec.indexes, cache=cache_config(cfg),
              cache_prefetch_steps=cfg.data.cache_prefetch_steps)
    if cfg.data.loader == "workers":
        return RankLoader(*args, **kw)
    from omniscale.loaders.ray_cluster import connect, job_namespace
    from omniscale.loaders.ray_loaders import RayRankLoader

    # A plane running as a Ray actor names its job's namespace: the pools join it there.
    connect(job.ray_address or cfg.data.ray_address,
            plane_ray_namespace(url, job.plane_token) or job_namespace(job.run_dir))
    # The pools follow the schedule once a window (the plane draws a window ahead).
    return RayRankLoader(*args, actor_cpus=cfg.data.ray_actor_cpus,
                         placement_timeout=cfg.data.ray_placement_timeout_s,
                         autoscale_cpus=cfg.data.ray_autoscale_cpus,
                         resize_every=cfg.data.window, **kw)


def cache_config(cfg: RunConfig):
    """The node-local cache of remote sources' bytes (``data.cache_dir``), or None."""
    if cfg.data.cache_dir is None:
        return None
    from omniscale.loaders.remote_cache import CacheConfig

    return CacheConfig(os.path.abspath(os.path.expanduser(cfg.data.cache_dir)),
                       cfg.data.cache_bytes)


def plane_ray_namespace(url: str, token: str | None) -> str | None:
    """The Ray namespace of a plane served as a Ray actor (``plane serve --ray``), else None."""
    from omniscale.dataplane.client import PlaneClient

    with PlaneClient(url, token=token, timeout=10.0, retry_for=30.0) as client:
        return client.status().get("ray_namespace")


def peak_flops(cfg: RunConfig, device: torch.device) -> float | None:
    """Per-device peak for MFU: ``parallel.peak_tflops``, else a known GPU's dense bf16 peak,
    else None (a CPU's peak is not known: MFU is left out, achieved TFLOP/s still logged)."""
    if cfg.parallel.peak_tflops:
        return cfg.parallel.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in (("H200", 989.0), ("H100", 989.0), ("A100", 312.0)):
            if key in name:
                return tflops * 1e12
    return None


def _target_mix(spec, step: int, tokens_before: int) -> dict[str, float]:
    """The schedule's weights for this step (by steps or tokens, as the schedule counts)."""
    x = step if spec.schedule.unit == "steps" else tokens_before
    return {k: round(v, 6) for k, v in spec.schedule.weights_at(x).items()}


def _refit(ctx: StepContext, client) -> dict | None:
    """Fit the cost model to the measured step times; send it to the plane unless the run
    is deterministic (then plans depend on data alone and the fit is only logged)."""
    fitted = ctx.refit.fit()
    if fitted is None:
        return None
    if not ctx.cfg.deterministic:
        fitted["applies_at_step"] = client.set_costs(fitted["linear"],
                                                     fitted["quadratic"])["applies_at_step"]
    return fitted


def _loop(ctx: StepContext, run_dir, job, model, optimizer, loader, spec, step_fn,
          held_out=None) -> None:
    """The steps from ``job.start_step``: train, commit, evaluate (``held_out``:
    ``held_out.HeldOut``, every ``eval.every`` steps and after the last), log, checkpoint."""
    cfg, rank = ctx.cfg, dist.get_rank()  # the global rank: files are written by rank 0
    writer = MetricsWriter(run_dir / "metrics.jsonl", job.start_step, cfg.metrics.wandb,
                           job.raw_config) if ctx.writer else None
    bar = Progress(ctx.writer, job.progress, cfg.steps, job.start_step, cfg.log_every)
    client = loader.client
    tokens_before = [writer.tokens_before if writer is not None else 0]
    # checkpoint.async_save: the writer thread coordinates on a gloo group of its own
    async_group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None
    pending = None  # the checkpoint being written in the background
    records = []  # steps trained since the last log, their metrics still on the device
    if cfg.guard.enabled:
        ctx.guard = seeded(cfg.guard, run_dir / "metrics.jsonl", job.start_step)
    watchdog = StepWatchdog(cfg.watchdog.step_timeout_s, run_dir, rank, job.start_step) \
        if cfg.watchdog.step_timeout_s > 0 else None
    profiler = step_profiler(cfg, run_dir, rank, ctx.device, job.start_step)
    try:
        for step in range(job.start_step, cfg.steps):
            batch = next(loader)
            assert batch.step == step, (batch.step, step)
            injected_hang(cfg, step, rank)
            records.append(step_fn(ctx, step, model, optimizer, batch))
            skipped = records[-1].update_skipped
            if skipped is not None:  # before the commit: the plane still holds its plans
                report_suspects(client, step, batch, skipped, rank)
            loader.commit(step)
            if watchdog is not None:
                watchdog.beat(step)
            if skipped is not None and ctx.guard.stops_run:
                _log(ctx, flush(ctx, records), writer, bar, spec, client, tokens_before, None)
                ctx.guard.stop(step, skipped, run_dir)
            done = step + 1
            held = None
            if held_out is not None and held_out.due(done):
                with watchdog.paused(step) if watchdog else contextlib.nullcontext():
                    held = held_out.evaluate(model, done)
            save = done % cfg.checkpoint_every == 0 or (done == cfg.steps
                                                         and cfg.checkpoint.final)
            if save or done % cfg.log_every == 0 or held:  # every step it covers is logged
                rows = flush(ctx, records)
                if held:
                    rows[-1]["eval"] = flat(held)
                _log(ctx, rows, writer, bar, spec, client, tokens_before,
                     checkpoint=done if save else None,
                     pools=getattr(loader, "pool_stats", None))
                records = []
            if save:
                loader.wait_commits()  # a checkpoint at ``done``: every step before committed
                checkpoint.finish(pending, run_dir, rank, cfg.checkpoint.keep_last)
                pending = checkpoint.save(run_dir, done, model, optimizer, client, rank,
                                          cfg.checkpoint.keep_last, async_group,
                                          kill_in_save=cfg.debug.kill_in_save == done)
            if profiler is not None:  # profile.steps: the step is the whole iteration
                profiler.step(step)
        checkpoint.finish(pending, run_dir, rank, cfg.checkpoint.keep_last)
    finally:
        if watchdog is not None:
            watchdog.close()
        bar.close()
        if writer is not None:
            writer.close()
        if profiler is not None:
            profiler.close()


def _log(ctx: StepContext, rows: list[dict], writer, bar, spec, client, tokens_before: list,
         checkpoint: int | None, pools=None) -> None:
    """Write a log interval's rows (rank 0) with what only the loop knows: the schedule's
    target mix, the cost refit, peak memory, the checkpoint the last row's step starts, the
    Ray decoding pools (``pools``: ``RayRankLoader.pool_stats``)."""
    cfg = ctx.cfg
    for row in rows:
        step = row["step"]
        if ctx.device.type == "cuda":  # this rank's peak since the start (GiB)
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30
        row["balance"] = cfg.data.balance  # the placement policy the plans came from
        if pools is not None:
            row["data_pools"] = pools()
        if "mix_samples" in row:
            row["mix_target"] = _target_mix(spec, step, tokens_before[0])
        if ctx.writer and cfg.data.refit_costs_every and \
                (step + 1) % cfg.data.refit_costs_every == 0:
            row["cost_refit"] = _refit(ctx, client)
        tokens_before[0] += row["tokens"]
        if checkpoint == step + 1:
            row["checkpoint"] = checkpoint
        if writer is not None:
            writer.write(row)
        bar.update(f"loss {row['loss']:.3f}  lr {row['lr']:.2e}  "
                   f"{row['tokens_per_s']:,.0f} tok/s")
    ctx.stragglers.tell(client, ctx.writer)  # the plane's status names them (changes only)
