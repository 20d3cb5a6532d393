"""One optimizer step of the omni task on one rank, and the metrics row it produces.

Encoders on this rank's encoder plan → reshard → backbone micro-batches (``media_step``) →
loss → backward → clip → AdamW. Gradients are summed across ranks by FSDP, so each rank's
loss is its summed token cross-entropy over the *global* count of target tokens (all-reduced
before the first micro-batch): the update equals the single-process one. The router losses
(per-token means over a micro-batch) are weighted by the micro-batch's share of the global
batch's tokens, so the z-loss is the global batch's mean however the plane packs it; the aux
loss's load fractions are each micro-batch's own (the global ones are known only after the
last micro-batch's forward), so it equals one process's where the packing is the same.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from omniscale.kernels.reference import IGNORE_INDEX
from omniscale.parallel.grads import clip_grad_norm, full_gradients
from omniscale.parallel.sequence import sp_batch
from omniscale.tools.train.build import lr_at
from omniscale.tools.train.media_step import encode_and_reshard
from omniscale.tools.train.metrics import CostFit, CostRefit


@dataclasses.dataclass
class StepContext:
    """What every step of a run needs besides the batch."""

    cfg: object  # RunConfig
    world: int  # data ranks (the plane's dp: TP peers share one data rank)
    rank: int  # this process's data rank
    sources: list[str]  # per-source metrics, in this order (the spec's at start)
    flops_alpha: float  # FLOPs per sequence = alpha·L + beta·L² (forward + backward)
    flops_beta: float
    peak_flops: float | None  # per rank, for MFU (None: not known for this device)
    # where the step's counters live: the process group's device (NCCL takes CUDA tensors only)
    device: torch.device = torch.device("cpu")
    group: object = None  # the data ranks' process group (this TP slice's); None: the world
    writer: bool = True  # global rank 0: writes files, keeps the cost refit
    devices: int = 1  # every process of the job (for MFU)
    encoder_copies: int = 1  # TP peers encoding the same items (their gradients add up)
    tp_rank: int = 0  # this process's tensor-parallel rank
    pipeline: object = None  # parallel.pipeline.PipelineRunner when pp > 1
    fit: CostFit = dataclasses.field(default_factory=CostFit)
    refit: CostRefit = dataclasses.field(default_factory=CostRefit)  # rank 0's measurements


def placeholder(empty):
    """A one-token stand-in for an empty (padded) micro-batch slot: every rank must run the
    same forward/backward passes for FSDP's collectives to line up, and a zero-length batch
    takes other code paths; its label is ignored, so it adds nothing to the loss."""
    one = torch.zeros(1, dtype=torch.int64)
    return dataclasses.replace(
        empty, input_ids_T=one, labels_T=torch.full((1,), IGNORE_INDEX, dtype=torch.int64),
        position_ids_T=one, mrope_3T=torch.zeros(3, 1, dtype=torch.int64),
        cu_seqlens_S1=torch.tensor([0, 1], dtype=torch.int32), max_seqlen=1,
        seq_len_full_S=torch.ones(1, dtype=torch.int64),
        seq_sp_size_S=torch.ones(1, dtype=torch.int64),
        seq_sp_index_S=torch.zeros(1, dtype=torch.int64), seq_refs=None)


def dump_gradients(ctx: StepContext, step: int, model: torch.nn.Module,
                   pp_group=None) -> None:
    """``debug.dump_grads_at_step``: the step's gradients before clipping, summed over the
    ranks (every stage's, given the pipeline's ``pp_group``), to ``RUN_DIR/grads-step-N.pt``
    (rank 0 writes; ``torch.load(..., weights_only=True)`` reads the dict). Tests compare them
    between 1 and N processes."""
    grads = full_gradients(model, pp_group)
    if ctx.writer:
        torch.save(grads, Path(ctx.cfg.output_dir) / f"grads-step-{step}.pt")


def distinct_skipped(batch, world: int, reported: float, group=None) -> float:
    """Corrupt samples skipped this step, each once: the rank training a sample and the rank
    encoding its media both decode it, and both skip it (``reported`` is the ranks' sum over
    ``group``, the ``world`` data ranks)."""
    if reported == 0 or world == 1:
        return reported
    from omniscale.loaders.assemble import sample_id

    ids: list = [None] * world
    dist.all_gather_object(ids, sorted(sample_id(bad) for bad, _ in batch.replaced),
                           group=group)
    return float(len(set().union(*map(set, ids))))


def source_groups(mb, sources: list[str]) -> torch.Tensor:
    """Each sequence's source index (a source added by a reload later: the last group)."""
    index = {name: i for i, name in enumerate(sources)}
    refs = mb.seq_refs or [None] * (mb.cu_seqlens_S1.numel() - 1)
    return torch.tensor([index.get(r.source, len(sources)) if r is not None else 0
                         for r in refs], dtype=torch.int64)


def _measure(ctx: StepContext, batch, seconds: list[float]) -> None:
    """Every rank's sequence lengths of this step to rank 0, for the cost refit."""
    lengths = [int(n) for mb in batch.micro_batches
               for n in (mb.cu_seqlens_S1[1:] - mb.cu_seqlens_S1[:-1]).tolist()]
    gathered: list = [None] * ctx.world
    dist.all_gather_object(gathered, lengths, group=ctx.group)
    if ctx.writer:
        ctx.refit.add(gathered, seconds)


def _flops(mbs, alpha: float, beta: float) -> float:
    total = 0.0
    for mb in mbs:
        lengths = (mb.cu_seqlens_S1[1:] - mb.cu_seqlens_S1[:-1]).double()
        total += float((alpha * lengths + beta * lengths ** 2).sum())
    return total


@dataclasses.dataclass
class StepSums:
    """What one step adds up on this rank, on the device, all-reduced once after backward:
    per source group (G) the loss sum, target tokens, samples and tokens; the router loss;
    the experts' load per MoE layer (L×E)."""

    loss_G: torch.Tensor
    n_G: torch.Tensor
    samples_G: torch.Tensor
    tokens_G: torch.Tensor
    router: torch.Tensor
    load_LE: torch.Tensor | None = None

    @classmethod
    def zeros(cls, n_groups: int, device: torch.device) -> "StepSums":
        loss_G, n_G, samples_G, tokens_G = torch.zeros(4, n_groups, dtype=torch.float64,
                                                       device=device)
        return cls(loss_G, n_G, samples_G, tokens_G,
                   torch.zeros((), dtype=torch.float64, device=device))

    def all_reduce(self, group) -> None:
        n = self.loss_G.numel()
        stats = torch.cat([self.loss_G, self.n_G, self.samples_G, self.tokens_G,
                           self.router.reshape(1)])
        dist.all_reduce(stats, group=group)
        self.loss_G, self.n_G, self.samples_G, self.tokens_G = stats[:4 * n].reshape(4, n)
        self.router = stats[-1]
        if self.load_LE is not None and self.load_LE.numel():
            dist.all_reduce(self.load_LE, group=group)


@dataclasses.dataclass
class StepCounts:
    """The global batch's counts (all-reduced before the first micro-batch: every rank's
    loss is divided by the global target-token count)."""

    target_tokens: float
    tokens: float
    flops: float
    skipped: float
    media_moved: float
    sp_split_samples: float

    @property
    def loss_divisor(self) -> float:
        return max(self.target_tokens, 1.0)


def set_lr(optimizer, step: int, cfg) -> float:
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def global_counts(ctx: StepContext, batch, micro_batches, media_moved: int = 0
                  ) -> StepCounts:
    """The step's counts summed over the data ranks (``micro_batches``: as this rank runs
    them, placeholders included)."""
    n_local = sum(int((mb.labels_T != IGNORE_INDEX).sum()) for mb in micro_batches)
    tokens_local = sum(mb.num_tokens for mb in batch.micro_batches)
    flops = _flops(batch.micro_batches, ctx.flops_alpha, ctx.flops_beta)
    # slices of samples split over an SP group, counted where slice 0 is
    split_local = sum(int(((mb.seq_sp_size_S > 1) & (mb.seq_sp_index_S == 0)).sum())
                      for mb in batch.micro_batches if mb.seq_refs is not None)
    counts = torch.tensor([n_local, tokens_local, flops, len(batch.skipped), media_moved,
                           split_local], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(counts, group=ctx.group)
    counts[3] = distinct_skipped(batch, ctx.world, float(counts[3]), ctx.group)
    return StepCounts(*counts.tolist())


def _backbone(ctx: StepContext, model, prepared, batch, counts: StepCounts) -> StepSums:
    """Phase 1: each micro-batch's forward and backward through the backbone (the encoders'
    turn comes after every micro-batch, ``StepMedia.backward``)."""
    n_groups = len(ctx.sources) + 1
    sums = StepSums.zeros(n_groups, ctx.device)
    routed_global = max(counts.tokens, 1.0)  # tokens through the routers: every token
    for (mb, items), routed in zip(prepared, batch.micro_batches):
        groups_S = source_groups(mb, ctx.sources)
        with sp_batch(model, mb):  # split sequences' attention over their SP group
            out = model.forward_with_media(mb, items, seq_group_S=groups_S,
                                           num_groups=n_groups)
        # The router losses are per-token means over the micro-batch: weighted by its share
        # of the global batch's tokens (a placeholder's: 0), they add up to the global mean.
        router_share = routed.num_tokens / routed_global
        loss = out["loss_sum"] / counts.loss_divisor + out["aux"]["router_loss"] * router_share
        loss.backward()
        sums.loss_G += out["loss_sum_G"].detach().double()
        sums.n_G += out["n_tokens_G"].detach().double()
        if mb.seq_refs is not None:
            lengths_S = (mb.cu_seqlens_S1[1:] - mb.cu_seqlens_S1[:-1]).double()
            first_S = (mb.seq_sp_index_S == 0).double()  # a split sample counts once
            sums.samples_G += torch.bincount(groups_S, weights=first_S,
                                             minlength=n_groups).to(ctx.device)
            sums.tokens_G += torch.bincount(groups_S, weights=lengths_S,
                                            minlength=n_groups).to(ctx.device)
        sums.router += out["aux"]["router_loss"].detach().double() * router_share
        load = out["aux"]["load_LE"].detach().to(torch.float64)
        sums.load_LE = load if sums.load_LE is None else sums.load_LE + load
    return sums


def train_step(ctx: StepContext, step: int, model, optimizer, batch) -> dict:
    """encode → reshard → backbone micro-batches → reshard and encoder backward → clip →
    AdamW → metrics."""
    cfg = ctx.cfg
    start = time.perf_counter()
    lr = set_lr(optimizer, step, cfg)
    optimizer.zero_grad(set_to_none=True)
    media = encode_and_reshard(model, batch, ctx.rank, ctx.world, group=ctx.group,
                               copies=ctx.encoder_copies)
    prepared = [media.items_for(mb) for mb in batch.micro_batches]
    prepared = [(mb if mb.num_tokens else placeholder(mb), items) for mb, items in prepared]
    counts = global_counts(ctx, batch, [mb for mb, _ in prepared], media.moved)
    sums = _backbone(ctx, model, prepared, batch, counts)
    media.backward()
    if step == cfg.debug.dump_grads_at_step:
        dump_gradients(ctx, step, model)
    grad_norm = clip_grad_norm(model, cfg.optim.grad_clip)
    optimizer.step()
    compute_s = time.perf_counter() - start
    sums.all_reduce(ctx.group)
    if sums.load_LE is not None and sums.load_LE.numel():
        model.decoder.update_bias(sums.load_LE)
    return metrics_row(ctx, step, batch, lr, grad_norm, compute_s, counts, sums)


def timing(ctx: StepContext, batch, compute_s: float) -> dict:
    """Per-rank predicted cost vs measured seconds, the data wait, and the step time the
    slowest rank sets (every task's row has these)."""
    meta = batch.metadata
    per_rank = torch.tensor([meta.get("predicted_cost", 0.0), compute_s, batch.data_wait_s],
                            dtype=torch.float64, device=ctx.device)
    gathered = [torch.zeros_like(per_rank) for _ in range(ctx.world)]
    dist.all_gather(gathered, per_rank, group=ctx.group)
    costs = [float(g[0]) for g in gathered]
    secs = [float(g[1]) for g in gathered]
    waits = [float(g[2]) for g in gathered]
    predicted = ctx.fit.k * max(costs) if ctx.fit.k is not None else None
    ctx.fit.update(costs, secs)
    step_s = max(s + w for s, w in zip(secs, waits))
    return {"step_s": step_s, "data_wait_frac": max(waits) / max(step_s, 1e-9),
            "predicted_step_s": predicted, "measured_step_s": max(secs),
            "rank_compute_s": secs, "rank_predicted_cost": costs,
            "imbalance_predicted": meta.get("imbalance"),
            "imbalance_measured": max(secs) / (sum(secs) / len(secs))}


def metrics_row(ctx: StepContext, step: int, batch, lr: float, grad_norm: float, compute_s: float,
         counts: StepCounts, sums: StepSums) -> dict:
    times = timing(ctx, batch, compute_s)
    step_s = times["step_s"]
    _measure(ctx, batch, times["rank_compute_s"])
    names = ctx.sources + ["(other)"]
    flops_per_s = counts.flops / max(step_s, 1e-9)
    row = {"step": step, "loss": float(sums.loss_G.sum()) / counts.loss_divisor,
           "router_loss": float(sums.router), "lr": lr, "grad_norm": grad_norm,
           "tokens": int(counts.tokens), "target_tokens": int(counts.target_tokens),
           "tokens_per_s": counts.tokens / max(step_s, 1e-9), **times,
           "tflops_per_s": flops_per_s / 1e12,
           "mfu": (flops_per_s / (ctx.peak_flops * ctx.devices) if ctx.peak_flops else None),
           "micro_batches": len(batch.micro_batches), "skipped": int(counts.skipped),
           "media_items_moved": int(counts.media_moved),
           "sp_split_samples": int(counts.sp_split_samples),
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
