"""One trainer rank: plane (rank 0) → RankLoader → omni model (FSDP over the ranks when more
than one) → AdamW → commit → metrics → checkpoint.

The step, per micro-batch: the rank encodes the media of its own micro-batches and decodes
them (``OmniModel.forward``: encode where consumed; the plan's encoder items and
``parallel.reshard`` are the next step). Gradients are summed across ranks by FSDP, so each
rank's loss is its summed token cross-entropy over the *global* count of target tokens
(all-reduced before the first micro-batch): the update equals the single-process one.
"""

from __future__ import annotations

import dataclasses

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dataplane.embedded import start_embedded
from dataplane.plane import PlaneConfig
from dataplane.spec import load_spec
from loaders.pipeline import RankLoader
from tools.train import checkpoint
from tools.train.build import build_model, build_optimizer, lr_at, model_config
from tools.train.config import RunConfig
from tools.train.metrics import CostFit, MetricsWriter, Progress

IGNORE = -100


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


def plane_config(cfg: RunConfig, dp: int) -> PlaneConfig:
    d = cfg.data
    # sp_max=1: this first cut has no sequence parallelism, so no sample is split over ranks
    # (longer text is truncated to a micro-batch, longer media samples skipped by the plane).
    return PlaneConfig(dp=dp, micro_batch_tokens=d.micro_batch_tokens, window=d.window,
                       global_batch_tokens=d.global_batch_tokens, sp_max=1,
                       snapshot_every=cfg.checkpoint_every)


def device_of(cfg: RunConfig, rank: int) -> torch.device:
    kind = cfg.parallel.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _share_url(url: str | None, rank: int, run_dir: Path) -> str:
    """Rank 0's plane URL to every rank (a broadcast; also left in RUN_DIR/plane.url)."""
    box = [url]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        (run_dir / "plane.url").write_text(box[0] + "\n")
    return box[0]


def train_rank(rank: int, world: int, job: RankJob) -> None:
    cfg = RunConfig.model_validate(job.raw_config)
    run_dir = Path(job.run_dir)
    device = device_of(cfg, rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=job.store, rank=rank, world_size=world)
    plane = loader = None
    try:
        if rank == 0:
            plane = start_embedded(job.spec, run_dir / "plane", plane_config(cfg, world),
                                   restore_step=job.start_step if job.resume_from else None)
        url = _share_url(plane.url if plane else None, rank, run_dir)
        spec = load_spec(job.spec)
        loader = RankLoader(url, rank, {s.name: s.path for s in spec.sources}, spec.tokenizer,
                            spec.media, num_workers=cfg.data.workers,
                            prefetch_steps=cfg.data.prefetch_steps, policy=cfg.data.policy,
                            start_step=job.start_step)
        mcfg = model_config(cfg, spec.media, spec.tokenizer)
        model = build_model(mcfg, cfg.seed, device)
        if world > 1:
            from parallel import ParallelDims, apply_fsdp

            dims = ParallelDims(dp_shard=world, world_size=world)
            dims.validate_for(mcfg)
            apply_fsdp(model, dims.build_mesh(device.type),
                       encoder_mesh=dims.build_encoder_mesh(device.type))
        optimizer = build_optimizer(model, cfg)
        if job.resume_from:
            checkpoint.load(Path(job.resume_from), model, optimizer)
        _loop(cfg, rank, world, run_dir, job, model, optimizer, loader, plane)
        dist.barrier()  # nobody stops the plane while another rank still talks to it
    finally:
        if loader is not None:
            loader.close()
        if plane is not None:
            plane.stop()
        dist.destroy_process_group()


def _grad_norm(model: torch.nn.Module, clip: float) -> float:
    """Clip by the global gradient norm. Encoders and backbone are sharded over different
    meshes, so the norm is taken per mesh (each a DTensor reduced to a full scalar) and
    combined, then every gradient is scaled by the same factor."""
    params = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    squares = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.double() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)
    torch.nn.utils.clip_grads_with_norm_(params, clip, total.float(), foreach=False)
    return float(total)


def _loop(cfg, rank, world, run_dir, job, model, optimizer, loader, plane) -> None:
    writer = MetricsWriter(run_dir / "metrics.jsonl", job.start_step) if rank == 0 else None
    bar = Progress(rank == 0 and job.progress, cfg.steps, job.start_step)
    fit = CostFit()
    client = loader.client
    try:
        for step in range(job.start_step, cfg.steps):
            batch = next(loader)
            assert batch.step == step, (batch.step, step)
            row = _train_step(cfg, step, world, model, optimizer, batch, fit)
            loader.commit(step)
            done = step + 1
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                checkpoint.save(run_dir, done, model, optimizer, client, rank)
                row["checkpoint"] = done
            if writer is not None:
                writer.write(row)
            bar.update(f"loss {row['loss']:.3f}  lr {row['lr']:.2e}  "
                       f"{row['tokens_per_s']:,.0f} tok/s")
    finally:
        bar.close()
        if writer is not None:
            writer.close()


def _placeholder(empty):
    """A one-token stand-in for an empty (padded) micro-batch slot: every rank must run the
    same forward/backward passes for FSDP's collectives to line up, and a zero-length batch
    takes other code paths; its label is ignored, so it adds nothing to the loss."""
    one = torch.zeros(1, dtype=torch.int64)
    return dataclasses.replace(
        empty, input_ids_T=one, labels_T=torch.full((1,), IGNORE, dtype=torch.int64),
        position_ids_T=one, mrope_3T=torch.zeros(3, 1, dtype=torch.int64),
        cu_seqlens_S1=torch.tensor([0, 1], dtype=torch.int32), max_seqlen=1,
        seq_len_full_S=torch.ones(1, dtype=torch.int64),
        seq_sp_size_S=torch.ones(1, dtype=torch.int64),
        seq_sp_index_S=torch.zeros(1, dtype=torch.int64))


def _train_step(cfg, step, world, model, optimizer, batch, fit: CostFit) -> dict:
    start = time.perf_counter()
    mbs = batch.micro_batches
    n_local = sum(int((mb.labels_T != IGNORE).sum()) for mb in mbs)
    tokens_local = sum(mb.num_tokens for mb in mbs)
    counts = torch.tensor([n_local, tokens_local], dtype=torch.float64)
    dist.all_reduce(counts)
    n_global = max(float(counts[0]), 1.0)
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64)
    router = torch.zeros((), dtype=torch.float64)
    load_LE = None
    for mb in mbs:
        if mb.num_tokens == 0:
            mb = _placeholder(mb)
        out = model(mb)
        n_mb = out["n_tokens"].detach()
        loss = (out["loss_sum"] + out["aux"]["router_loss"] * n_mb) / n_global
        loss.backward()
        loss_sum += out["loss_sum"].detach().double().cpu()
        router += (out["aux"]["router_loss"].detach() * n_mb).double().cpu()
        load = out["aux"]["load_LE"].detach().cpu().to(torch.float64)
        load_LE = load if load_LE is None else load_LE + load
    grad_norm = _grad_norm(model, cfg.optim.grad_clip)
    optimizer.step()
    compute_s = time.perf_counter() - start

    stats = torch.stack([loss_sum, router])
    dist.all_reduce(stats)
    if load_LE is not None and load_LE.numel():
        dist.all_reduce(load_LE)
        model.decoder.update_bias(load_LE)
    meta = batch.metadata
    per_rank = torch.tensor([meta.get("predicted_cost", 0.0), compute_s, batch.data_wait_s],
                            dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    costs = [float(g[0]) for g in gathered]
    secs = [float(g[1]) for g in gathered]
    waits = [float(g[2]) for g in gathered]
    predicted = fit.k * max(costs) if fit.k is not None else None
    fit.update(costs, secs)
    step_s = max(s + w for s, w in zip(secs, waits))
    row = {"step": step, "loss": float(stats[0]) / n_global,
           "router_loss": float(stats[1]) / n_global, "lr": lr, "grad_norm": grad_norm,
           "tokens": int(counts[1]), "target_tokens": int(counts[0]),
           "tokens_per_s": float(counts[1]) / max(step_s, 1e-9), "step_s": step_s,
           "data_wait_frac": max(waits) / max(step_s, 1e-9),
           "predicted_step_s": predicted, "measured_step_s": max(secs),
           "rank_compute_s": secs, "rank_predicted_cost": costs,
           "imbalance_predicted": meta.get("imbalance"),
           "imbalance_measured": max(secs) / (sum(secs) / len(secs)),
           "micro_batches": len(batch.micro_batches), "skipped": len(batch.skipped)}
    if load_LE is not None and load_LE.numel():
        mean = load_LE.mean(dim=1, keepdim=True).clamp_min(1e-9)
        row["expert_load_max_over_mean"] = [round(float(v), 4) for v in
                                            (load_LE / mean).max(dim=1).values]
        row["expert_load"] = load_LE.to(torch.int64).tolist()
    return row
