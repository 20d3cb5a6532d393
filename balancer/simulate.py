"""Run placement policies over the same stream of global batches and compare what they cost.

Our planner (``omniscale``) sees windows of ``config.window`` steps and may move samples
between the steps of a window; the baselines see one step at a time, as drawn. A ``+split``
baseline gets exactly the planner's split: the SP group size of every sample is decided on
the planner's windows by the planner's rule (`baselines.split_sizes`), outside the timed
call, and the baseline places the pieces of each step its own way. Every policy's plans are
rewritten to absolute steps and stream-wide sample indices and re-priced from their
placements alone (`reprice`: c/k plus the SP all-to-all per slice, the encoder cost where
each item is encoded, the reshard all-to-all), then judged by :mod:`balancer.metrics`, so no
policy grades itself and communication is charged to every policy alike.

The headline ratio is against the best baseline that may split (``best_baseline``,
``speedup_vs_best_baseline``); the no-split baselines' best is reported beside it, labelled
(``best_baseline_no_split``, ``speedup_vs_best_no_split_baseline``).

Planner time is ``time.perf_counter`` around each policy call, after an untimed warm-up pass
over every window: numba compiles a function the first time any window reaches it (the first
window with a split sample, say), and compilation is not planning. A window's time is shared
by its steps.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from omniscale.balancer.baselines import (
    BASELINES,
    BASELINES_NO_SPLIT,
    BASELINES_SPLIT,
    may_split,
    split_sizes,
)
from omniscale.balancer.metrics import (
    displacement,
    exactly_once,
    fsdp_breakdown,
    ideal_time,
    step_times,
    violations,
)
from omniscale.balancer.split import unit_cost
from omniscale.balancer.stream import (
    arrival_step,
    item_costs,
    llm_costs,
    take,
    window_samples,
    windows,
)
from omniscale.balancer.types import PlannerConfig, StepPlan, WindowSamples

OURS = "omniscale"
# ours planned for ranks that meet once a step (PlannerConfig.sync "step"): judged on the DDP
# objective in its stead (`compare`), as a user of that layout would plan
OURS_STEP_SYNC = OURS + "@step"
# ours and the per-step baselines (the static layouts of baselines.STATIC_LAYOUTS, which
# take no split decision, are compared end to end: tools/bench/e2e_long_tail.py)
ALL_POLICIES = (OURS, *BASELINES_NO_SPLIT, *BASELINES_SPLIT)


@dataclass(frozen=True)
class PolicyRun:
    """One policy's global plans (one per step, in step order) and its time per step."""

    name: str
    plans: list[StepPlan]
    ms_S: np.ndarray  # float64: planner milliseconds charged to each step
    # float64: each step's reshard all-to-all (cost units; None: none), between the phases
    reshard_S: np.ndarray | None = None
    # float64: each step's SP all-to-all, summed over ranks (cost units; inside mb_cost_RB)
    sp_comm_S: np.ndarray | None = None


def judged(names) -> list[str]:
    """The runs a comparison of ``names`` needs: ours also planned for ranks that meet once a
    step (``OURS_STEP_SYNC``, merged into ours' DDP figures by `compare`) when ours is there."""
    names = list(names)
    return [*names, OURS_STEP_SYNC] if OURS in names else names


def resolve(name: str):
    """(policy, windowed): ours plans whole windows, a baseline one step."""
    if name in (OURS, OURS_STEP_SYNC):
        from omniscale.balancer.planner import plan_window

        if name == OURS_STEP_SYNC:
            return (lambda samples, costs, config, **kw: plan_window(
                samples, costs, dataclasses.replace(config, sync="step"), **kw)), True
        return plan_window, True
    if name not in BASELINES:
        raise ValueError(f"policy {name!r}: expected one of {', '.join(ALL_POLICIES)}")
    baseline = BASELINES[name]
    return (lambda samples, costs, config, **kw: [baseline(samples, costs, config, **kw)]), False


def planner_split(stream: WindowSamples, step_offsets_S1: np.ndarray, costs,
                  config: PlannerConfig) -> np.ndarray:
    """SP group size of every planned sample as the planner decides it: per window of
    ``config.window`` steps (a short last window by its own length)."""
    sizes = []
    for first, end in windows(step_offsets_S1, config.window):
        samples = window_samples(stream, step_offsets_S1, first, end)
        sizes.append(split_sizes(samples, costs, config, n_steps=end - first))
    return np.concatenate(sizes) if sizes else np.zeros(0, np.int64)


def run_policy(name: str, stream: WindowSamples, step_offsets_S1: np.ndarray, costs,
               config: PlannerConfig) -> PolicyRun:
    """Plan every step of the stream with the named policy; re-price its plans (`reprice`)."""
    policy, windowed = resolve(name)
    spans = windows(step_offsets_S1, config.window if windowed else 1)
    sizes_N = planner_split(stream, step_offsets_S1, costs, config) if may_split(name) else None
    plans: list[StepPlan] = []
    ms_S = np.zeros(len(step_offsets_S1) - 1, np.float64)
    calls = [(first, end, window_samples(stream, step_offsets_S1, first, end),
              dataclasses.replace(config, window=end - first) if windowed else config,
              {} if sizes_N is None else {"sp_size_N": sizes_N[
                  int(step_offsets_S1[first]):int(step_offsets_S1[end])]})
             for first, end in spans]
    for _, _, samples, step_config, kw in calls:
        policy(samples, costs, step_config, **kw)  # warm-up: numba compiles on first use
    for first, end, samples, step_config, kw in calls:
        t0 = time.perf_counter()
        local = policy(samples, costs, step_config, **kw)
        ms_S[first:end] = (time.perf_counter() - t0) * 1e3 / (end - first)
        lo = int(step_offsets_S1[first])
        plans += [globalize(p, first, lo, int(stream.item_offsets_N1[lo])) for p in local]
    priced = [reprice(p, stream, costs, config.dp) for p in plans]
    return PolicyRun(name, [p for p, _, _ in priced], ms_S,
                     reshard_S=np.array([r for _, r, _ in priced], np.float64),
                     sp_comm_S=np.array([c for _, _, c in priced], np.float64))


def reprice(plan: StepPlan, stream: WindowSamples, costs,
            dp: int) -> tuple[StepPlan, float, float]:
    """(the plan with its cost grid and encoder cost recomputed from its placements, the
    reshard all-to-all of the step, the SP all-to-all summed over ranks), all in cost units.

    A placement of a sample of L tokens on a group of k costs its rank c(L)/k plus
    ``costs.sp_comm_per_token`` × ⌈L/k⌉ × (k−1)/k; an item costs its encoder cost on the rank
    that encodes it; items encoded away from their consumer move their LLM tokens'
    embeddings in one all-to-all, as long as the rank that sends or receives the most takes
    (``costs.reshard_per_token`` per token). ``plan`` is global (stream-wide indices).
    """
    tokens_P = stream.tokens_N[plan.sample_P]
    k_P = plan.sp_size_P.astype(np.int64)
    compute_P = costs.llm(tokens_P)
    cost_P = unit_cost(compute_P, tokens_P, k_P, costs.sp_comm_per_token)
    comm_P = cost_P - compute_P / k_P
    if plan.sp_tokens_P is not None:
        cost_P = _speed_sized_parts(plan, tokens_P, k_P, cost_P, costs)
    mb_cost_RB = np.zeros((dp, plan.num_micro_batches), np.float64)
    np.add.at(mb_cost_RB, (plan.rank_P, plan.micro_batch_P), cost_P)
    item_M = plan.item_M
    encoder_cost_R = np.bincount(
        plan.encode_rank_M, minlength=dp,
        weights=costs.item_cost(stream.item_size_M[item_M], stream.item_kind_M[item_M]))
    moved_M = plan.encode_rank_M != plan.consume_rank_M
    reshard = 0.0
    if moved_M.any():
        tokens_M = stream.item_tokens_M[item_M][moved_M].astype(np.float64)
        sent_R = np.bincount(plan.encode_rank_M[moved_M], weights=tokens_M, minlength=dp)
        recv_R = np.bincount(plan.consume_rank_M[moved_M], weights=tokens_M, minlength=dp)
        reshard = costs.reshard_per_token * float(max(sent_R.max(), recv_R.max()))
    priced = dataclasses.replace(plan, mb_cost_RB=mb_cost_RB,
                                 encoder_cost_R=encoder_cost_R.astype(np.float64),
                                 reshard=bool(plan.reshard or moved_M.any()))
    return priced, reshard, float(comm_P.sum())


def _speed_sized_parts(plan: StepPlan, tokens_P: np.ndarray, k_P: np.ndarray,
                       unit_P: np.ndarray, costs) -> np.ndarray:
    """Each placement's part of a split sample whose slices (and heads) the planner sized by
    the ranks' speeds (``balancer.speed_split``): the sample's work (``unit`` × k, its
    communication included) × ((1 − φ)·t + φ·g), t its share of the tokens, g of the query
    heads (1/k when equal), φ the attention share; whole samples keep ``unit_P``."""
    split_P = k_P > 1
    held_P = np.where(split_P, plan.sp_tokens_P, 0).astype(np.float64)
    t_P = held_P / np.maximum(np.bincount(plan.sample_P, weights=held_P)[plan.sample_P], 1.0)
    if plan.sp_heads_P is not None:
        heads_P = np.where(split_P, plan.sp_heads_P, 0).astype(np.float64)
        g_P = heads_P / np.maximum(np.bincount(plan.sample_P, weights=heads_P)[plan.sample_P],
                                   1.0)
    else:
        g_P = 1.0 / k_P
    work_P = unit_P * k_P
    share_P = np.clip(costs.llm.beta * tokens_P.astype(np.float64) ** 2
                      / np.maximum(work_P, 1e-300), 0.0, 1.0)
    part_P = work_P * ((1.0 - share_P) * t_P + share_P * g_P)
    return np.where(split_P, part_P, unit_P)


def globalize(plan: StepPlan, first_step: int, first_sample: int, first_item: int) -> StepPlan:
    """The plan with its step absolute and its sample and item indices stream-wide."""
    return dataclasses.replace(
        plan, step=first_step + plan.step, sample_P=plan.sample_P + first_sample,
        item_M=plan.item_M + first_item, item_sample_M=plan.item_sample_M + first_sample)


def rank_loads(run: PolicyRun) -> np.ndarray:
    """Predicted cost per step and rank, encoder included (float64 [S, R])."""
    rows = []
    for plan in run.plans:
        load_R = plan.rank_cost_R.astype(np.float64)
        if plan.encoder_cost_R is not None:
            load_R = load_R + plan.encoder_cost_R
        rows.append(load_R)
    return np.stack(rows) if rows else np.zeros((0, 0))


def summarize(run: PolicyRun, stream: WindowSamples, step_offsets_S1: np.ndarray,
              config: PlannerConfig, ideal: float, micro_batch: float = 0.0) -> dict:
    """The policy's numbers (JSON-ready): balance, simulated time, displacement, validity.
    ``micro_batch``: the fixed cost every rank pays per micro-batch slot (``Costs.micro_batch``:
    a calibrated cost file's FSDP gathers and launches; 0 in the default model)."""
    planned = int(step_offsets_S1[-1])
    arrival_N = arrival_step(step_offsets_S1)
    imbalance_S = np.array([p.imbalance for p in run.plans])
    # the slowest rank's time over the step's bound, both in time (cost / speed with speeds)
    max_lb_S = np.array([p.rank_time_R.max() / p.lower_bound if p.lower_bound > 0 else 1.0
                         for p in run.plans])
    times_S2 = np.array([step_times(p) for p in run.plans]).reshape(-1, 2)
    if run.reshard_S is not None:
        times_S2 = times_S2 + run.reshard_S[:, None]  # a phase every rank waits for
    if micro_batch:
        times_S2 = times_S2 + micro_batch * np.array(
            [[p.num_micro_batches] for p in run.plans], np.float64)
    disp_N = np.zeros(planned, np.int64)
    for plan in run.plans:
        disp_N[plan.sample_P] = displacement(plan, arrival_N)
    num_items = int(stream.item_offsets_N1[planned])
    once = exactly_once(run.plans, planned, num_items)
    ddp, fsdp = (float(x) for x in times_S2.sum(axis=0))
    zero_S = np.zeros(len(run.plans))
    return {
        "may_split": run.name == OURS or may_split(run.name),
        "steps": len(run.plans),
        "imbalance_mean": float(imbalance_S.mean()),
        "imbalance_p95": float(np.percentile(imbalance_S, 95)),
        "max_over_lb_mean": float(max_lb_S.mean()),
        "max_over_lb_max": float(max_lb_S.max()),
        "ddp_time": ddp,
        "fsdp_time": fsdp,
        "ddp_over_ideal": ddp / ideal if ideal > 0 else 1.0,
        "fsdp_over_ideal": fsdp / ideal if ideal > 0 else 1.0,
        "displacement_mean": float(disp_N.mean()) if planned else 0.0,
        "displacement_max": int(disp_N.max()) if planned else 0,
        "planner_ms_per_step": float(run.ms_S.mean()),
        "planner_ms_max_step": float(run.ms_S.max()),
        "micro_batches_mean": float(np.mean([p.num_micro_batches for p in run.plans])),
        "violations": sum(violations(p, stream.tokens_N, config.dp, config.micro_batch_tokens)
                          for p in run.plans),
        "exactly_once": once["ok"],
        "exactly_once_detail": once,
        # communication, cost units summed over steps: the SP all-to-all over ranks / dp
        # (a mean rank's share), the reshard all-to-all as every rank waits for it
        "sp_comm_per_rank": float((run.sp_comm_S if run.sp_comm_S is not None
                                   else zero_S).sum()) / config.dp,
        "reshard_comm": float((run.reshard_S if run.reshard_S is not None
                               else zero_S).sum()),
        "fsdp_breakdown": fsdp_breakdown(run.plans, stream.tokens_N, config.dp,
                                         config.micro_batch_tokens, ideal, run.reshard_S,
                                         micro_batch),
    }


def compare(runs: list[PolicyRun], stream: WindowSamples, step_offsets_S1: np.ndarray, costs,
            config: PlannerConfig) -> dict:
    """Every run summarised, the ideal, and our speed-up per objective over the best baseline
    that may split (the headline) and over the best no-split baseline (labelled so).

    The ideal is compute only (all predicted cost / ranks, or over the summed speeds of ranks
    of given speeds, ``config.rank_speed``): communication is what a policy pays on top of
    it. With speeds every policy's plans are judged in time (a rank's work over its speed);
    the baselines place blind to them, as they would."""
    planned = take(stream, 0, int(step_offsets_S1[-1]))
    ideal = ideal_time(llm_costs(planned, costs), item_costs(planned, costs), config.dp,
                       config.speed_R)
    policies = {run.name: summarize(run, stream, step_offsets_S1, config, ideal,
                                    costs.micro_batch) for run in runs}
    step_sync = policies.pop(OURS_STEP_SYNC, None)
    if step_sync is not None and OURS in policies:  # ours on DDP: as planned for DDP
        policies[OURS].update({key: step_sync[key] for key in ("ddp_time", "ddp_over_ideal")},
                              ddp_planned_with_sync="step")
    result = {
        "dp": config.dp, "window": config.window, "sp_max": config.sp_max,
        "epsilon": config.epsilon, "micro_batch_tokens": config.micro_batch_tokens,
        "sp_comm_per_token": costs.sp_comm_per_token,
        "reshard_per_token": costs.reshard_per_token,
        "rank_speed": None if config.rank_speed is None else list(config.rank_speed),
        "samples": planned.num_samples, "items": planned.num_items,
        "steps": len(step_offsets_S1) - 1, "ideal_time": ideal, "policies": policies,
    }
    for best_key, speedup_key, split in (
            ("best_baseline", "speedup_vs_best_baseline", True),
            ("best_baseline_no_split", "speedup_vs_best_no_split_baseline", False)):
        baselines = [name for name in policies if name != OURS and may_split(name) == split]
        best_of, speedup = {}, {}
        for objective in ("ddp", "fsdp"):
            if not baselines:
                continue
            best = min(baselines, key=lambda name: policies[name][f"{objective}_time"])
            best_of[objective] = best
            if OURS in policies and policies[OURS][f"{objective}_time"] > 0:
                speedup[objective] = (policies[best][f"{objective}_time"]
                                      / policies[OURS][f"{objective}_time"])
        result[best_key], result[speedup_key] = best_of, speedup
    return result


def simulate(stream: WindowSamples | np.ndarray, step_offsets_S1: np.ndarray, costs,
             config: PlannerConfig, policies: tuple[str, ...] = ALL_POLICIES) -> dict:
    """Plan the stream's steps with each policy and compare them (see :func:`compare`).

    ``stream`` may be a plain array of lengths (text only, one source). Ours is planned
    twice when both objectives are judged (``OURS_STEP_SYNC``: the plan a DDP job makes).
    """
    if not isinstance(stream, WindowSamples):
        stream = WindowSamples.from_lengths(stream)
    runs = [run_policy(name, stream, step_offsets_S1, costs, config)
            for name in judged(policies)]
    return compare(runs, stream, step_offsets_S1, costs, config)
