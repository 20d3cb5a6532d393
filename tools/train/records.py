"""A step's metrics, kept on the device until the loop logs them.

A step function returns a `StepRecord`: its sums on the device (this rank's share), the
step's global counts (already summed over the data ranks: the loss needed them first), its
gradient norm (a device scalar), and what this rank knows on the host (predicted cost,
compute and data-wait seconds, sequence lengths, replaced samples). The loop keeps the
records of `log_every` steps and `flush` turns them into one metrics row per step with one
all-reduce, one all-gather and one object gather, and one host synchronisation: nothing in a
step waits for its metrics. A checkpoint flushes first, so every step it covers is logged.

Sums are all-reduced over `StepEnv.sum_group` (the data ranks; the whole world under
pipeline parallelism, where each figure is contributed by one stage), timings gathered over
the data ranks; what the timings update (the cost fit, the stragglers, rank 0's refit
measurements) is the run's `RunState` (tools/train/step.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from omniscale.tools.train import collectives


@dataclasses.dataclass
class StepSums:
    """What one step adds up on this rank, on the device: per source group (G) the loss sum,
    target tokens, samples and tokens; the router loss; the experts' load per MoE layer
    (L×E)."""

    loss_G: torch.Tensor
    n_G: torch.Tensor
    samples_G: torch.Tensor
    tokens_G: torch.Tensor
    router: torch.Tensor
    load_LE: torch.Tensor | None = None

    @classmethod
    def zeros(cls, n_groups: int, device: torch.device) -> StepSums:
        loss_G, n_G, samples_G, tokens_G = torch.zeros(4, n_groups, dtype=torch.float64,
                                                       device=device)
        return cls(loss_G, n_G, samples_G, tokens_G,
                   torch.zeros((), dtype=torch.float64, device=device))

    def flat(self) -> torch.Tensor:
        parts = [self.loss_G, self.n_G, self.samples_G, self.tokens_G, self.router.reshape(1)]
        if self.load_LE is not None:
            parts.append(self.load_LE.reshape(-1).to(torch.float64))
        return torch.cat(parts)

    @classmethod
    def from_flat(cls, values: torch.Tensor, n_groups: int,
                  load_shape: tuple[int, ...] | None) -> StepSums:
        g = n_groups
        load = values[4 * g + 1:].reshape(load_shape) if load_shape is not None else None
        return cls(values[:g], values[g:2 * g], values[2 * g:3 * g], values[3 * g:4 * g],
                   values[4 * g], load)


@dataclasses.dataclass
class StepRecord:
    """One step as the step function left it (module docstring). `row(record, sums, counts,
    times, skipped)` builds the metrics row from the reduced sums and the counts (CPU
    float64 tensors), the timing fields and the distinct skipped samples."""

    step: int
    lr: float
    grad_norm: torch.Tensor
    counts: torch.Tensor  # summed over the data ranks already
    sums: torch.Tensor  # this rank's share
    row: Callable
    wall_s: float  # the step's wall-clock seconds on this rank (waits included)
    compute_s: float  # of which computing (compute_clock.ComputeClock)
    data_wait_s: float
    predicted_cost: float
    plan: dict  # the plan's predicted imbalance and step cost, and the best baseline's
    micro_batches: int
    skipped: int  # corrupt samples this rank skipped
    replaced: list = dataclasses.field(default_factory=list)  # their sample ids
    lengths: list[int] | None = None  # sequence lengths, for the cost refit
    io: dict = dataclasses.field(default_factory=dict)  # the loader's reads (StepBatch.io)
    update_skipped: str | None = None  # why the guard did not apply the step (guard.py)
    host_syncs: dict | None = None  # this rank's, by op (``debug.count_host_syncs``)
    phases: dict = dataclasses.field(default_factory=dict)  # name: (wall, compute) (step.Phases)


def step_record(step: int, batch, **fields) -> StepRecord:
    """A record with the batch's host-side facts filled in."""
    from omniscale.loaders.assemble import sample_id

    meta = batch.metadata
    return StepRecord(step=step, data_wait_s=batch.data_wait_s,
                      predicted_cost=meta.get("predicted_cost", 0.0),
                      plan={"imbalance_predicted": meta.get("imbalance"),
                            "predicted_step_cost": meta.get("step_max_cost"),
                            "baseline_predicted_step_cost": meta.get("baseline_step_cost"),
                            "baseline_policy": meta.get("baseline")},
                      micro_batches=len(batch.micro_batches), skipped=len(batch.skipped),
                      replaced=sorted(sample_id(bad) for bad, _ in batch.replaced),
                      io=dict(getattr(batch, "io", {})), **fields)


def _timing(env, state, record: StepRecord, costs: list[float], secs: list[float],
            walls: list[float], waits: list[float]) -> dict:
    """Per-rank predicted cost vs measured compute seconds (their imbalance is the honest
    one: waiting excluded), the data wait, the wall-clock step the slowest rank sets, each
    rank's slowdown against the cost fit and the stragglers (``stragglers``; every task's
    row has these)."""
    k = state.fit.k  # from the steps before this one: the prediction this step is judged by
    predicted = k * max(costs) if k is not None else None
    watchdog = env.cfg.watchdog
    slow, lines = state.stragglers.observe(record.step, costs, secs, k,
                                           watchdog.straggler_factor, watchdog.straggler_steps)
    if env.writer:
        for line in lines:
            print(line, flush=True)
    state.fit.update(costs, secs)
    slow.update(state.speeds.observe(record.step, costs, secs))  # rank_speeds.SpeedTracker
    step_s = max(s + w for s, w in zip(walls, waits))
    return {"step_s": step_s, "data_wait_frac": max(waits) / max(step_s, 1e-9),
            "predicted_step_s": predicted, "measured_step_s": max(secs),
            "rank_compute_s": secs, "rank_wall_s": walls, "rank_predicted_cost": costs,
            "compute_clock": state.clock.kind,
            **record.plan,
            "imbalance_measured": max(secs) / max(sum(secs) / len(secs), 1e-12), **slow}


def flush(env, state, records: list[StepRecord]) -> list[dict]:
    """The rows of `records` (every rank calls it at the same step; rows on every rank);
    ``env``: the run's ``step.StepEnv``, ``state``: its ``step.RunState``."""
    if not records:
        return []
    host = torch.tensor([[r.predicted_cost, r.compute_s, r.wall_s, r.data_wait_s, r.skipped]
                         for r in records], dtype=torch.float64, device=env.device)
    sums, gathered, objects = collectives.flush_metrics(
        torch.cat([r.sums for r in records]), host,
        [(r.lengths, r.replaced, r.io, r.phases) for r in records], env.world, env.sum_group,
        env.group)
    # the one host synchronisation of the interval
    sums = sums.cpu()
    per_rank = torch.stack(gathered, dim=1).tolist()  # [step][rank][field]
    norms = torch.stack([r.grad_norm.double().reshape(()).cpu() for r in records]).tolist()
    rows, offset = [], 0
    for i, record in enumerate(records):
        size = record.sums.numel()
        costs, secs, walls, waits, skipped = (list(column) for column in zip(*per_rank[i]))
        times = _timing(env, state, record, costs, secs, walls, waits)
        reported = sum(skipped)
        if reported and env.world > 1:  # the rank training a sample and the one encoding
            # its media both decode it, and both skip it: each sample once
            reported = len(set().union(*(set(map(tuple, o[i][1])) for o in objects)))
        if record.lengths is not None and env.writer:
            state.refit.add([o[i][0] for o in objects], secs)
        row = record.row(record, sums[offset:offset + size], record.counts.cpu(), times,
                         int(reported))
        row["grad_norm"] = norms[i]
        if record.update_skipped is not None:
            row["update_skipped"] = record.update_skipped
        if record.host_syncs is not None:  # rank 0's (step_audit.py)
            row["host_syncs"] = record.host_syncs
            row["host_syncs_per_micro_batch"] = (sum(record.host_syncs.values())
                                                 / max(record.micro_batches, 1))
        io = _data_io([o[i][2] for o in objects], sum(row.get("mix_samples", {}).values()))
        if io:
            row["data_io"] = io
        row.update(_phases([o[i][3] for o in objects]))
        rows.append(row)
        offset += size
    return rows


def _phases(per_rank: list[dict]) -> dict:
    """Each phase's wall and compute seconds per rank (``step.Phases``), when every rank
    timed them (CPU)."""
    names = list(per_rank[0]) if per_rank and all(per_rank) else []
    if not names:
        return {}
    return {"rank_phase_wall_s": {n: [p[n][0] for p in per_rank] for n in names},
            "rank_phase_compute_s": {n: [p[n][1] for p in per_rank] for n in names}}


def _data_io(per_rank: list[dict], samples: int | None) -> dict:
    """The step's object-store reads over all ranks (``loaders.remote_io.READ_STATS``), with
    the cache hit rate and the bytes fetched per sample trained; {} when every source is
    local."""
    from omniscale.loaders.remote_io import add_stats

    total: dict[str, int] = {}
    for io in per_rank:
        add_stats(total, io or {})
    if not any(total.values()):
        return {}
    blocks = total.get("cache_hits", 0) + total.get("cache_misses", 0)
    total["cache_hit_rate"] = total.get("cache_hits", 0) / blocks if blocks else None
    if samples:
        total["store_bytes_per_sample"] = total.get("store_bytes", 0) / samples
    return total
