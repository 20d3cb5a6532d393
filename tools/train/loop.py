"""One trainer rank: plane (rank 0's embedded one, or ``--plane URL``) → the rank's plane
session (``plane_session.PlaneSession``: every call to the plane) → RankLoader → the
task's model (``tasks.Task.build``), laid out by its ``parallelize_*`` → AdamW → the steps
(``trainer.Trainer``: train, commit, metrics, checkpoint).

The step itself is the task's (``tasks.TASKS``): ``step.train_step`` for omni and lm (encoders
on the encoder plan, reshard, backbone micro-batches; ``pipeline_step`` under pp),
``video_gen.video_gen_step`` for the rectified-flow DiT.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.plane import PlaneConfig
from omniscale.errors import UserError
from omniscale.loaders.pipeline import RankLoader
from omniscale.tools.train import checkpoint, collectives, optim_groups
from omniscale.tools.train.build import (
    build_optimizer,
    init_weights,
    model_config,
    resolve_towers,
)
from omniscale.tools.train.config import RunConfig, run_spec
from omniscale.tools.train.faults import Faults
from omniscale.tools.train.held_out import HeldOut, evaluates_in_ranks
from omniscale.tools.train.plane_session import PlaneSession
from omniscale.tools.train.step import StepEnv
from omniscale.tools.train.tasks import task_of
from omniscale.tools.train.torchrun import shared_ray
from omniscale.tools.train.trainer import Trainer


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
                 frozen_kinds: tuple[str, ...] = (), heads: int = 0) -> PlaneConfig:
    """The embedded plane's settings; ``cost``: the model's (α, β) FLOPs per sequence, the
    balancer's cost model (``ModelConfig.cost_coefficients``); ``frozen_kinds``: encoder kinds
    whose tower ``optim.groups`` freezes (priced forward only, ``optim_groups.Groups``);
    ``heads``: the query heads a rank's Ulysses exchange splits (:func:`attention_heads`)."""
    d = cfg.data
    # parallel.sp: the plane may split a sample over an aligned group of up to that many
    # ranks; longer text is truncated to what such a group holds, longer media samples skipped.
    extra = {}
    if d.costs:  # calibrated on this machine: seconds, encoders priced on their own
        from omniscale.tools.train.cost_model import read_cost_file

        extra = read_cost_file(d.costs)
    elif cost:
        extra = {"cost_linear": cost[0] / cost[1], "cost_quadratic": 1.0}
    if d.rank_speeds is not None and (len(d.rank_speeds) != dp or not all(
            math.isfinite(v) and v > 0 for v in d.rank_speeds)):
        raise UserError(f"data.rank_speeds: one finite speed > 0 per data rank; this run has "
                        f"{dp} data ranks, got {d.rank_speeds}")
    return PlaneConfig(dp=dp, micro_batch_tokens=d.micro_batch_tokens, window=d.window,
                       global_batch_tokens=d.global_batch_tokens, sp_max=cfg.parallel.sp,
                       snapshot_every=cfg.checkpoint_every, balance=d.balance,
                       interleave=tuple(d.balance_interleave or ()),
                       frozen_encoders=tuple(frozen_kinds), attention_heads=heads,
                       rank_speed=None if d.rank_speeds is None else tuple(d.rank_speeds),
                       **extra)


def planning_config(cfg: RunConfig, world: int) -> PlaneConfig:
    """The plane settings a run on ``world`` processes plans with: its embedded plane's
    (``plane_config`` with the layout's data ranks, the model's cost and the frozen towers),
    what an external plane must match (``launch.check_plane``, ``plane_args``)."""
    _, mcfg, dims, groups = layout(cfg, world)  # an impossible layout: one line
    cost = mcfg.cost_coefficients() if mcfg is not None else None  # as _train_rank's
    return plane_config(cfg, dims.dp_sp, cost, groups.frozen_kinds,
                        attention_heads(cfg, mcfg, dims))


def attention_heads(cfg: RunConfig, mcfg, dims) -> int:
    """The query heads of the decoder on a rank (its TP share) when samples may be split over
    SP groups and ``data.heads_by_speed`` -- the planner may then size a split's heads by the
    ranks' speeds -- else 0 (H/k heads each)."""
    heads = getattr(mcfg, "n_heads", 0) if mcfg is not None else 0
    return heads // dims.tp if cfg.parallel.sp > 1 and cfg.data.heads_by_speed and heads else 0


def rank_threads(world: int) -> int:
    """A rank's intra-op threads: its share of the machine's cores, no more than it may run
    on (``OMNISCALE_CPU_BIND``, ``taskset``) nor than ``OMP_NUM_THREADS`` when set (as torch
    itself honours it): a job sharing the machine sets it, since more threads than free cores
    spin waiting for each other; torchrun sets 1 unless it is set."""
    threads = min((os.cpu_count() or 1) // world, len(os.sched_getaffinity(0)))
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        threads = min(threads, int(omp))
    return max(1, threads)


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


def _share_url(url: str | None, rank: int, run_dir: Path) -> str:
    """Rank 0's plane URL to every rank (a broadcast; also left in RUN_DIR/plane.url)."""
    url = collectives.share_plane_url(url)
    if rank == 0:
        (run_dir / "plane.url").write_text(url + "\n")
    return url


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
    torch.set_num_threads(rank_threads(world))
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
    plane = loader = session = None
    try:
        spec, mcfg, dims, groups = layout(cfg, world)  # every rank, before the plane starts
        task = task_of(cfg)
        if job.resume_from:  # a refused checkpoint leaves RUN_DIR/plane as it was
            checkpoint.verify(Path(job.resume_from))
        if rank == 0 and job.plane_url is None:
            cost = mcfg.cost_coefficients() if mcfg is not None else None
            plane = start_embedded(job.spec, run_dir / "plane",
                                   plane_config(cfg, dims.dp_sp, cost, groups.frozen_kinds,
                                                attention_heads(cfg, mcfg, dims)),
                                   restore_step=job.start_step if job.resume_from else None)
        url = _share_url(job.plane_url or (plane.url if plane else None), rank, run_dir)
        # the plane plans for the data ranks; TP peers load (and commit) the same plan
        data_rank = dims.data_rank(rank)
        session = PlaneSession(url, data_rank, token=job.plane_token)
        loader = make_loader(cfg, session, spec, job)
        model = task.build(cfg, spec, mcfg, device)
        optim_groups.freeze(model, groups)  # before FSDP builds its units (parallel.fsdp)
        from omniscale.parallel.fsdp import MixedUnitError

        try:
            meshes = task.parallelize(cfg)(model, dims, settings_of(cfg, device), device.type)
        except MixedUnitError as e:
            raise optim_groups.unit_error(groups, model, e) from None
        step_fn = task.step if meshes.pipeline is None else task.pipeline_step
        init_weights(model, cfg, device, resume=bool(job.resume_from))
        optimizer = build_optimizer(model, cfg)
        if job.resume_from:
            checkpoint.load(Path(job.resume_from), model, optimizer, verified=True)
        alpha, beta = mcfg.cost_coefficients() if mcfg is not None else (0.0, 0.0)
        faults = Faults.of(cfg.debug, rank, data_rank, writer=rank == 0,
                           output_dir=cfg.output_dir)
        env = StepEnv(cfg, dims.dp_sp, data_rank, tuple(s.name for s in spec.sources), alpha,
                      beta, peak_flops(cfg, device), device=device,
                      group=meshes.mesh["dp_sp"].get_group() if dims.tp * dims.pp > 1 else None,
                      writer=rank == 0, devices=world,
                      encoder_copies=dims.tp // dims.encoder_tp, tp_rank=dims.tp_rank(rank),
                      pipeline=meshes.pipeline, faults=faults)
        held_out = HeldOut(cfg, run_dir, mcfg.vocab_size if mcfg is not None else None, env) \
            if evaluates_in_ranks(cfg) else None
        Trainer(env, run_dir, job, model, optimizer, loader, session, spec, step_fn,
                held_out).run()
        session.wait_commits()
        # nobody stops the plane while another rank still talks to it
        collectives.end_of_run_barrier(device)
        if plane is not None:  # the launcher lists them (launch.corrupt_report, suspect_report)
            session.write_reports(run_dir)
    finally:
        try:
            if loader is not None:
                loader.close()
        finally:
            if session is not None:  # a refused commit is raised unless an error is in flight
                session.close(raise_commit_errors=sys.exc_info()[0] is None)
            if plane is not None:
                plane.stop()


def layout(cfg: RunConfig, world: int):
    """``(spec, model config, ParallelDims, optim_groups.Groups)`` of the run over ``world``
    processes (the model config is None for video_gen); a one-line UserError when the layout
    or ``optim.groups`` cannot work. The launcher checks it before it spawns anything, every
    rank again before the plane starts."""
    spec = run_spec(cfg, cfg.data.spec)
    hf = cfg.model.init_from.backbone or cfg.model.init_from.vision or cfg.model.init_from.audio
    task = task_of(cfg)
    if hf and not task.init_from_hf:
        raise UserError(f"model.init_from: the {task.name} task's model has no Hugging Face "
                        f"counterpart (omni and lm start from Qwen3 / Qwen3-MoE)")
    resolve_towers(cfg, spec)  # model.vision/audio auto (the launcher's ranks: done already)
    mcfg = model_config(cfg, spec.media, spec.tokenizer) if task.language_model else None
    return spec, mcfg, parallel_dims(cfg, world, mcfg), optim_groups.check(cfg, spec, mcfg)


def parallel_dims(cfg: RunConfig, world: int, mcfg):
    """The run's layout from ``parallel:`` (a one-line UserError naming the axis when it cannot
    work, on every rank before the plane starts)."""
    p = cfg.parallel
    if p.pp > 1 and task_of(cfg).pipeline_step is None:
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


def make_loader(cfg: RunConfig, session: PlaneSession, spec, job: RankJob):
    """The rank's loader, fed by its plane session's plan source and reporting to it:
    DataLoader worker processes (``data.loader: workers``) or per-source Ray actor pools
    (``ray``: the job's, in its Ray cluster, ``loaders.ray_cluster``)."""
    # one plan fetched ahead of the loader's own read-ahead: a fetch is milliseconds, and
    # every plan fetched is one the plane can no longer re-plan (a slowed rank's speeds)
    args = (session.plans(job.start_step, 1), session.report,
            session.rank, spec.locations, spec.tokenizer, spec.media)
    # The omni step reshards encoder outputs, so a rank decodes only the media it encodes.
    kw = dict(num_workers=cfg.data.workers, prefetch_steps=cfg.data.prefetch_steps,
              policy=cfg.data.policy, start_step=job.start_step,
              skip_moved_media=task_of(cfg).media_resharded, special_tokens=spec.special_tokens,
              indexes=spec.indexes, cache=cache_config(cfg),
              cache_prefetch_steps=cfg.data.cache_prefetch_steps)
    if cfg.data.loader == "workers":
        return RankLoader(*args, **kw)
    from omniscale.loaders.ray_cluster import connect, job_namespace
    from omniscale.loaders.ray_loaders import RayRankLoader, pools_name_for

    # A plane running as a Ray actor names its job's namespace: the pools join it there.
    connect(job.ray_address or cfg.data.ray_address,
            session.ray_namespace() or job_namespace(job.run_dir))
    # The pools follow the schedule once a window (the plane draws a window ahead).
    return RayRankLoader(*args, pools_name=pools_name_for(session.url),
                         mixture=session.mixture_weights, actor_cpus=cfg.data.ray_actor_cpus,
                         placement_timeout=cfg.data.ray_placement_timeout_s,
                         autoscale_cpus=cfg.data.ray_autoscale_cpus,
                         resize_every=cfg.data.window, **kw)


def cache_config(cfg: RunConfig):
    """The node-local cache of remote sources' bytes (``data.cache_dir``), or None."""
    if cfg.data.cache_dir is None:
        return None
    from omniscale.loaders.block_cache import CacheConfig

    return CacheConfig(os.path.abspath(os.path.expanduser(cfg.data.cache_dir)),
                       cfg.data.cache_bytes)


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
