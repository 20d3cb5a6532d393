"""One optimizer step of the omni (and lm) task on one rank, and the metrics row it produces.

Encoders on this rank's encoder plan → reshard → backbone micro-batches (``media_step``) →
loss → backward → clip → AdamW. Gradients are summed across ranks by FSDP, so each rank's
loss is its summed token cross-entropy over the *global* count of target tokens (all-reduced
before the first micro-batch): the update equals the single-process one. The router losses
(per-token means over a micro-batch) are weighted by the micro-batch's share of the global
batch's tokens, so the z-loss is the global batch's mean however the plane packs it; the aux
loss's load fractions are each micro-batch's own (the global ones are known only after the
last micro-batch's forward), so it equals one process's where the packing is the same.

The step returns a ``records.StepRecord``: its metrics stay on the device until the loop
flushes them (once per ``log_every`` steps).

Every task's step takes ``(env, state, step, model, optimizer, batch)``: ``StepEnv``, what is
fixed for the run (config, ranks, groups, devices, the pipeline stage, ``faults``), and
``RunState``, what the run measures as it goes (clock, cost fit, stragglers, audit, guard),
kept apart so that nothing fixed is assigned after the rank is set up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omniscale.backbone.decoder import grouped_loss
from omniscale.kernels.transfer import HOST, host_to_device, to_device
from omniscale.layout import IGNORE_INDEX
from omniscale.parallel.sequence import sp_batch
from omniscale.tools.train import collectives
from omniscale.tools.train.build import lr_at
from omniscale.tools.train.compute_clock import ComputeClock
from omniscale.tools.train.config import RunConfig
from omniscale.tools.train.cost_model import CostFit, CostRefit
from omniscale.tools.train.faults import NO_FAULTS, Faults
from omniscale.tools.train.guard import UpdateGuard, guarded_update, seeded
from omniscale.tools.train.media_step import encode_and_reshard
from omniscale.tools.train.rank_speeds import SpeedTracker
from omniscale.tools.train.records import StepRecord, StepSums, step_record
from omniscale.tools.train.step_audit import StepAudit
from omniscale.tools.train.stragglers import StragglerTracker

if TYPE_CHECKING:
    import torch.distributed as dist

    from omniscale.parallel.pipeline import PipelineRunner


@dataclasses.dataclass(frozen=True)
class StepEnv:
    """What every step of a run needs besides the batch and is fixed for the run: set once,
    when the rank is laid out (``loop.py``), before the first step. What a run measures as it
    goes is its ``RunState``."""

    cfg: RunConfig
    world: int  # data ranks (the plane's dp: TP peers share one data rank)
    rank: int  # this process's data rank
    sources: tuple[str, ...]  # per-source metrics, in this order (the spec's at start)
    flops_alpha: float  # FLOPs per sequence = alpha·L + beta·L² (forward + backward)
    flops_beta: float
    peak_flops: float | None  # per rank, for MFU (None: not known for this device)
    # where the step's counters live: the process group's device (NCCL takes CUDA tensors only)
    device: torch.device = torch.device("cpu")
    group: dist.ProcessGroup | None = None  # the data ranks' group (this TP slice's); None: world
    writer: bool = True  # global rank 0: writes files, keeps the cost refit
    devices: int = 1  # every process of the job (for MFU)
    encoder_copies: int = 1  # TP peers encoding the same items (their gradients add up)
    tp_rank: int = 0  # this process's tensor-parallel rank
    pipeline: PipelineRunner | None = None  # this rank's stage when pp > 1
    faults: Faults = NO_FAULTS  # debug.* faults and hooks, narrowed to this rank

    @property
    def sum_group(self) -> dist.ProcessGroup | None:
        """Where a step's sums are added up: the data ranks, or the whole world under
        pipeline parallelism (each stage contributes its own figures)."""
        return None if self.pipeline is not None else self.group


@dataclasses.dataclass
class RunState:
    """What a rank's run measures and remembers from step to step (the trainer owns it; the
    step and ``records.flush`` update it): the compute clock, the cost fit the stragglers are
    judged by, rank 0's measurements for the cost refit, the stragglers, the step audit's
    counts and the update guard's loss history."""

    clock: ComputeClock  # per-rank compute seconds (waiting in collectives excluded)
    audit: StepAudit  # debug.audit_devices / count_host_syncs (step_audit.py); off by default
    guard: UpdateGuard | None = None  # None: every step applied, no verdict to wait for
    # the same clock per phase of the step (``Phases``), where phases end on the host when their
    # work does (CPU); None on CUDA: its kernels run after the host has moved on
    phase_clock: ComputeClock | None = None
    fit: CostFit = dataclasses.field(default_factory=CostFit)
    refit: CostRefit = dataclasses.field(default_factory=CostRefit)  # rank 0's measurements
    stragglers: StragglerTracker = dataclasses.field(default_factory=StragglerTracker)
    speeds: SpeedTracker = dataclasses.field(default_factory=SpeedTracker)  # for the planner

    @classmethod
    def start(cls, env: StepEnv, run_dir: Path, start_step: int) -> RunState:
        """A run's state at ``start_step``: the guard's history from the metrics of the steps
        before it (a resumed run judges its steps as the uninterrupted one did)."""
        cfg = env.cfg
        guard = seeded(cfg.guard, Path(run_dir) / "metrics.jsonl", start_step) \
            if cfg.guard.enabled else None
        return cls(clock=ComputeClock(env.device.type),
                   phase_clock=ComputeClock() if env.device.type == "cpu" else None,
                   audit=StepAudit(env.device, cfg.debug.audit_devices,
                                   cfg.debug.count_host_syncs),
                   guard=guard)


def placeholder(empty):
    """A one-token stand-in for an empty (padded) micro-batch slot: every rank must run the
    same forward/backward passes for FSDP's collectives to line up, and a zero-length batch
    takes other code paths; its label is ignored, so it adds nothing to the loss."""
    host = dict(dtype=torch.int64, device=HOST)  # a host batch, as the loader's are
    one = torch.zeros(1, **host)
    return dataclasses.replace(
        empty, input_ids_T=one, labels_T=torch.full((1,), IGNORE_INDEX, **host),
        position_ids_T=one, mrope_3T=torch.zeros(3, 1, **host),
        cu_seqlens_S1=torch.tensor([0, 1], dtype=torch.int32, device=HOST), max_seqlen=1,
        seq_len_full_S=torch.ones(1, **host), seq_sp_size_S=torch.ones(1, **host),
        seq_sp_index_S=torch.zeros(1, **host), seq_refs=None)


def source_groups(mb, sources: Sequence[str]) -> torch.Tensor:
    """Each sequence's source index (a source added by a reload later: the last group)."""
    index = {name: i for i, name in enumerate(sources)}
    refs = mb.seq_refs or [None] * (mb.cu_seqlens_S1.numel() - 1)
    return torch.tensor([index.get(r.source, len(sources)) if r is not None else 0
                         for r in refs], dtype=torch.int64, device=HOST)


def _flops(mbs, alpha: float, beta: float) -> float:
    total = 0.0
    for mb in mbs:
        lengths = (mb.cu_seqlens_S1[1:] - mb.cu_seqlens_S1[:-1]).double()
        total += float((alpha * lengths + beta * lengths ** 2).sum())
    return total


@dataclasses.dataclass
class StepCounts:
    """The global batch's counts, summed over the data ranks before the first micro-batch
    (every rank's loss is divided by the global target-token count), kept on the device:
    ``values`` = target tokens, tokens, FLOPs, media items moved, samples split over SP."""

    values: torch.Tensor

    @property
    def loss_divisor(self) -> torch.Tensor:
        return self.values[0].clamp_min(1.0)

    @property
    def routed(self) -> torch.Tensor:  # tokens through the routers: every token
        return self.values[1].clamp_min(1.0)


def set_lr(optimizer, step: int, cfg) -> float:
    """The step's scheduled learning rate (returned, and logged), times each param group's
    ``optim.groups`` scale (``build.build_optimizer``'s ``optimizer.lr_scales``)."""
    lr = lr_at(step, cfg)
    scales = getattr(optimizer, "lr_scales", None) or [1.0] * len(optimizer.param_groups)
    for group, scale in zip(optimizer.param_groups, scales, strict=True):
        group["lr"] = lr * scale
    return lr


def global_counts(env: StepEnv, batch, micro_batches, media_moved: int = 0
                  ) -> StepCounts:
    """The step's counts summed over the data ranks (``micro_batches``: as this rank runs
    them, placeholders included)."""
    n_local = sum(int((mb.labels_T != IGNORE_INDEX).sum()) for mb in micro_batches)
    tokens_local = sum(mb.num_tokens for mb in batch.micro_batches)
    flops = _flops(batch.micro_batches, env.flops_alpha, env.flops_beta)
    # slices of samples split over an SP group, counted where slice 0 is
    split_local = sum(int(((mb.seq_sp_size_S > 1) & (mb.seq_sp_index_S == 0)).sum())
                      for mb in batch.micro_batches if mb.seq_refs is not None)
    # made on the host and copied without waiting (torch.tensor(..., device=cuda) would wait)
    counts = to_device([n_local, tokens_local, flops, media_moved, split_local], env.device,
                       torch.float64)
    return StepCounts(collectives.sum_step_counts(counts, env.group))


def source_losses(model, mb, hidden_TD: torch.Tensor, groups_S: torch.Tensor,
                  n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_G, n_G)``: the micro-batch's summed cross-entropy and counted targets per
    source group (each group's rows scored apart: the split costs no extra logits)."""
    lengths_S = (mb.cu_seqlens_S1[1:] - mb.cu_seqlens_S1[:-1]).cpu()
    group_T = torch.repeat_interleave(groups_S.cpu(), lengths_S)  # on the host: no sync
    return grouped_loss(lambda h, y: model.decoder.loss(h, y)[0], hidden_TD,
                        host_to_device(mb.labels_T, hidden_TD.device), group_T, n_groups)


def _backbone(env: StepEnv, step: int, model, prepared, batch, counts: StepCounts
              ) -> StepSums:
    """Phase 1: each micro-batch's forward and backward through the backbone (the encoders'
    turn comes after every micro-batch, ``StepMedia.backward``)."""
    n_groups = len(env.sources) + 1
    sums = StepSums.zeros(n_groups, env.device)
    for (mb, items), routed in zip(prepared, batch.micro_batches):
        groups_S = source_groups(mb, env.sources)
        # split sequences' attention over their SP group, in backward too: activation
        # checkpointing recomputes the attention there
        with sp_batch(model, mb):
            hidden_TD, aux = model.decode(mb, items)
            loss_G, n_G = source_losses(model, mb, hidden_TD, groups_S, n_groups)
            loss_G = env.faults.on_loss(step, loss_G)
            # The router losses are per-token means over the micro-batch: weighted by its
            # share of the global batch's tokens (a placeholder's: 0), they add up to the
            # global mean.
            router_share = routed.num_tokens / counts.routed
            loss = loss_G.sum() / counts.loss_divisor + aux["router_loss"] * router_share
            loss.backward()
        sums.loss_G += loss_G.detach().double()
        sums.n_G += n_G.detach().double()
        sums.router += aux["router_loss"].detach().double() * router_share
        load = aux["load_LE"].detach().to(torch.float64)
        sums.load_LE = load if sums.load_LE is None else sums.load_LE + load
    sums.samples_G, sums.tokens_G = mix_counts(env, batch.micro_batches)
    return sums


def mix_counts(env: StepEnv, micro_batches) -> torch.Tensor:
    """``[2, G]`` on the device: samples and tokens of each source group, counted on the
    host from the batch (a sample split over an SP group once) and copied in one go."""
    n_groups = len(env.sources) + 1
    mix = torch.zeros(2, n_groups, dtype=torch.float64, device=HOST)
    for mb in micro_batches:
        if mb.seq_refs is None:
            continue
        groups_S = source_groups(mb, env.sources)
        lengths_S = (mb.cu_seqlens_S1[1:] - mb.cu_seqlens_S1[:-1]).double()
        first_S = (mb.seq_sp_index_S == 0).double()  # a split sample counts once
        mix[0] += torch.bincount(groups_S, weights=first_S, minlength=n_groups)
        mix[1] += torch.bincount(groups_S, weights=lengths_S, minlength=n_groups)
    return host_to_device(mix, env.device)


def update_bias(env: StepEnv, model, load_LE: torch.Tensor | None,
                rows: slice = slice(None)) -> None:
    """Aux-loss-free balancing: the step's expert loads summed over the ranks now (only when
    the model moves its biases: otherwise they wait for the log interval's reduction);
    ``rows``: the MoE layers this rank holds (a pipeline stage's)."""
    moe = model.config.moe
    if moe is None or moe.bias_update_rate <= 0 or load_LE is None:
        return
    load_LE = collectives.sum_expert_loads(load_LE.clone(), env.sum_group)
    model.decoder.update_bias(load_LE[rows])


class Phases:
    """Each phase's (wall, compute) seconds of one step on this rank (``RunState.phase_clock``;
    nothing on CUDA): where a step's time goes, so two plans' steps can be told apart by
    more than their total (the metrics row's ``rank_phase_compute_s``)."""

    def __init__(self, clock: ComputeClock | None) -> None:
        self.clock, self.seconds = clock, {}
        if clock is not None:
            clock.start()

    def end(self, name: str) -> None:
        if self.clock is not None:
            self.seconds[name] = self.clock.lap()


def train_step(env: StepEnv, state: RunState, step: int, model, optimizer, batch
               ) -> StepRecord:
    """encode → reshard → backbone micro-batches → reshard and encoder backward → clip →
    AdamW → record."""
    cfg = env.cfg
    state.clock.start()
    phases = Phases(state.phase_clock)
    env.faults.in_compute(step)  # inside the clock: it counts as compute
    lr = set_lr(optimizer, step, cfg)
    optimizer.zero_grad(set_to_none=True)
    with state.audit.compute(model):
        media = encode_and_reshard(model, batch, env.rank, env.world, group=env.group,
                                   copies=env.encoder_copies)
        prepared = [media.items_for(mb) for mb in batch.micro_batches]
        prepared = [(mb if mb.num_tokens else placeholder(mb), items) for mb, items in prepared]
        counts = global_counts(env, batch, [mb for mb, _ in prepared], media.moved)
        phases.end("encode")  # the encoders' forward and the reshard
        sums = _backbone(env, step, model, prepared, batch, counts)
        phases.end("backbone")
        media.backward()
        phases.end("media_backward")  # the reshard's and the encoders' backward
    env.faults.before_clip(step, model)
    with state.audit.compute(model):
        grad_norm = collectives.clip_grad_norm(model, cfg.optim.grad_clip)
    skipped = guarded_update(state.guard, optimizer, sums.loss_G.sum(), counts.values[0],
                             grad_norm, contributes=env.tp_rank == 0)
    if skipped is None:
        update_bias(env, model, sums.load_LE)
    phases.end("update")  # clip, the guard's verdict, AdamW
    return omni_record(env, state, step, batch, lr, grad_norm, state.clock.stop(), counts,
                       sums, skipped, phases.seconds)


def sequence_lengths(batch) -> list[int]:
    return [int(n) for mb in batch.micro_batches
            for n in (mb.cu_seqlens_S1[1:] - mb.cu_seqlens_S1[:-1]).tolist()]


def omni_record(env: StepEnv, state: RunState, step: int, batch, lr: float,
                grad_norm: torch.Tensor, seconds: tuple[float, float], counts: StepCounts,
                sums: StepSums, update_skipped: str | None = None,
                phases: dict | None = None) -> StepRecord:
    """The step's record; ``seconds``: (wall, compute) of ``ComputeClock.stop``;
    ``update_skipped``: why the guard did not apply the step (``guard.guarded_update``)."""
    load_shape = tuple(sums.load_LE.shape) if sums.load_LE is not None else None
    return step_record(step, batch, lr=lr, grad_norm=grad_norm, counts=counts.values,
                       sums=sums.flat(), row=partial(_omni_row, env, load_shape),
                       wall_s=seconds[0], compute_s=seconds[1],
                       lengths=sequence_lengths(batch), update_skipped=update_skipped,
                       phases=phases or {},
                       host_syncs=state.audit.take() if state.audit.count_syncs else None)


def _omni_row(env: StepEnv, load_shape, record: StepRecord, flat: torch.Tensor,
              counts: torch.Tensor, times: dict, skipped: int) -> dict:
    sums = StepSums.from_flat(flat, len(env.sources) + 1, load_shape)
    target_tokens, tokens, flops, moved, split = counts.tolist()
    step_s = times["step_s"]
    names = [*env.sources, "(other)"]
    flops_per_s = flops / max(step_s, 1e-9)
    row = {"step": record.step, "loss": float(sums.loss_G.sum()) / max(target_tokens, 1.0),
           "router_loss": float(sums.router), "lr": record.lr,
           "tokens": int(tokens), "target_tokens": int(target_tokens),
           "tokens_per_s": tokens / max(step_s, 1e-9), **times,
           "tflops_per_s": flops_per_s / 1e12,
           "mfu": (flops_per_s / (env.peak_flops * env.devices) if env.peak_flops else None),
           "micro_batches": record.micro_batches, "skipped": skipped,
           "media_items_moved": int(moved), "sp_split_samples": int(split),
           "source_loss": {n: float(s / c) for n, s, c in zip(names, sums.loss_G, sums.n_G)
                           if c > 0},
           "mix_samples": {n: int(s) for n, s in zip(names, sums.samples_G) if s > 0},
           "mix_tokens": {n: int(t) for n, t in zip(names, sums.tokens_G) if t > 0}}
    load_LE = sums.load_LE
    if load_LE is not None and load_LE.numel():
        mean = load_LE.mean(dim=1, keepdim=True).clamp_min(1e-9)
        row["expert_load_max_over_mean"] = [round(float(v), 4) for v in
                                            (load_LE / mean).max(dim=1).values]
        row["expert_load"] = load_LE.to(torch.int64).tolist()
    return row
