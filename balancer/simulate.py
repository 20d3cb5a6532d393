"""Run placement policies over the same stream of global batches and compare what they cost.

Our planner (``omniscale``) sees windows of ``config.window`` steps and may move samples
between the steps of a window; the baselines see one step at a time, as drawn. Every policy's
plans are rewritten to absolute steps and stream-wide sample indices, then judged by
:mod:`balancer.metrics` alone, so no policy grades itself.

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

from balancer.baselines import BASELINES
from balancer.metrics import displacement, exactly_once, ideal_time, step_times, violations
from balancer.stream import arrival_step, item_costs, llm_costs, take, window_samples, windows
from balancer.types import PlannerConfig, StepPlan, WindowSamples

OURS = "omniscale"
ALL_POLICIES = (OURS, *BASELINES)


@dataclass(frozen=True)
class PolicyRun:
    """One policy's global plans (one per step, in step order) and its time per step."""

    name: str
    plans: list[StepPlan]
    ms_S: np.ndarray  # float64: planner milliseconds charged to each step


def resolve(name: str):
    """(policy, windowed): ours plans whole windows, a baseline one step."""
    if name == OURS:
        from balancer.planner import plan_window

        return plan_window, True
    if name not in BASELINES:
        raise ValueError(f"policy {name!r}: expected one of {', '.join(ALL_POLICIES)}")
    baseline = BASELINES[name]
    return (lambda samples, costs, config: [baseline(samples, costs, config)]), False


def run_policy(name: str, stream: WindowSamples, step_offsets_S1: np.ndarray, costs,
               config: PlannerConfig) -> PolicyRun:
    """Plan every step of the stream with the named policy."""
    policy, windowed = resolve(name)
    spans = windows(step_offsets_S1, config.window if windowed else 1)
    plans: list[StepPlan] = []
    ms_S = np.zeros(len(step_offsets_S1) - 1, np.float64)
    calls = [(first, end, window_samples(stream, step_offsets_S1, first, end),
              dataclasses.replace(config, window=end - first) if windowed else config)
             for first, end in spans]
    for _, _, samples, step_config in calls:
        policy(samples, costs, step_config)  # warm-up: numba compiles on a path's first use
    for first, end, samples, step_config in calls:
        t0 = time.perf_counter()
        local = policy(samples, costs, step_config)
        ms_S[first:end] = (time.perf_counter() - t0) * 1e3 / (end - first)
        lo = int(step_offsets_S1[first])
        plans += [globalize(p, first, lo, int(stream.item_offsets_N1[lo])) for p in local]
    return PolicyRun(name, plans, ms_S)


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
              config: PlannerConfig, ideal: float) -> dict:
    """The policy's numbers (JSON-ready): balance, simulated time, displacement, validity."""
    planned = int(step_offsets_S1[-1])
    arrival_N = arrival_step(step_offsets_S1)
    imbalance_S = np.array([p.imbalance for p in run.plans])
    max_lb_S = np.array([p.rank_cost_R.max() / p.lower_bound if p.lower_bound > 0 else 1.0
                         for p in run.plans])
    times_S2 = np.array([step_times(p) for p in run.plans]).reshape(-1, 2)
    disp_N = np.zeros(planned, np.int64)
    for plan in run.plans:
        disp_N[plan.sample_P] = displacement(plan, arrival_N)
    num_items = int(stream.item_offsets_N1[planned])
    once = exactly_once(run.plans, planned, num_items)
    ddp, fsdp = (float(x) for x in times_S2.sum(axis=0))
    return {
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
    }


def compare(runs: list[PolicyRun], stream: WindowSamples, step_offsets_S1: np.ndarray, costs,
            config: PlannerConfig) -> dict:
    """Every run summarised, the ideal, and our speed-up over the best baseline per objective."""
    planned = take(stream, 0, int(step_offsets_S1[-1]))
    ideal = ideal_time(llm_costs(planned, costs), item_costs(planned, costs), config.dp)
    policies = {run.name: summarize(run, stream, step_offsets_S1, config, ideal) for run in runs}
    result = {
        "dp": config.dp, "window": config.window, "sp_max": config.sp_max,
        "epsilon": config.epsilon, "micro_batch_tokens": config.micro_batch_tokens,
        "samples": planned.num_samples, "items": planned.num_items,
        "steps": len(step_offsets_S1) - 1, "ideal_time": ideal, "policies": policies,
        "best_baseline": {}, "speedup_vs_best_baseline": {},
    }
    baselines = [name for name in policies if name != OURS]
    for objective in ("ddp", "fsdp"):
        if not baselines:
            continue
        best = min(baselines, key=lambda name: policies[name][f"{objective}_time"])
        result["best_baseline"][objective] = best
        if OURS in policies and policies[OURS][f"{objective}_time"] > 0:
            result["speedup_vs_best_baseline"][objective] = (
                policies[best][f"{objective}_time"] / policies[OURS][f"{objective}_time"])
    return result


def simulate(stream: WindowSamples | np.ndarray, step_offsets_S1: np.ndarray, costs,
             config: PlannerConfig, policies: tuple[str, ...] = ALL_POLICIES) -> dict:
    """Plan the stream's steps with each policy and compare them (see :func:`compare`).

    ``stream`` may be a plain array of lengths (text only, one source).
    """
    if not isinstance(stream, WindowSamples):
        stream = WindowSamples.from_lengths(stream)
    runs = [run_policy(name, stream, step_offsets_S1, costs, config) for name in policies]
    return compare(runs, stream, step_offsets_S1, costs, config)
