"""Balancer benchmark: our planner against the baselines, same data, same run.

    .venv/bin/python tools/bench/balance.py [--quick] [--out bench-balance.json]
    .venv/bin/python tools/bench/balance.py --scale [--timing-only] [--out balance_scale.json]

Data: text lengths lognormal(7.5, 1.5) clipped to 128K; the demo's real standard-library text
(its index's ``llm_tokens``, resampled with a fixed seed because the demo holds a few hundred
files and a 256-rank run needs thousands of samples); the omni mix. At 8, 64 and 256 ranks,
16 samples per rank per step, cost ``24576·L + L²``, window 4, ε 5%, micro-batch budget 16K
tokens. Baselines: the four policies without the split (labelled "no split": a sample over
the budget runs anyway, a violation), and each again with exactly our long-short split
(``+split``). Communication (SP all-to-all, encoder reshard) is charged to every policy from
`balancer.cost.CommModel` (a 32-layer, hidden-4096, bf16 model; a cost unit 1.97 ns) at each
bandwidth of ``BANDWIDTHS`` per rank: free (the earlier model); 200 GB/s, an NVLink-class
link inside a node; 25 GB/s and 12.5 GB/s, a 200 and a 100 Gb/s NIC per GPU across nodes. For
each bandwidth and ``sp_max`` 32 and 8: our planner and the four ``+split`` baselines (the
split depends on both). The headline ratio is against the best baseline that may split; the
ratio against the best no-split baseline is reported beside it. Then the planner alone at
4,096 samples per step on 64 ranks, for the time target. Targets are judged at the default
bandwidth (25 GB/s). FSDP step time is judged against the ideal (all compute over the ranks)
where 1.15 x ideal is reachable, else against a bound that includes the communication the
necessary splits pay (``comm_bound``: every sample over the budget on the smallest SP group
whose slices fit it).

``--scale`` (its own JSON, docs/bench/balance_scale.json): 4,096 and 16,384 ranks × 8 samples
per rank per step at 25 GB/s, sp_max 32, lognormal and omni: the planner's ms per step (wall
and CPU; the first call, numba's compile or cache load, timed apart) against <= 100 ms at
4,096 ranks, its growth against n log n, and every policy on the same stream.

Everything but the ms/step timings is a deterministic simulation; the
timings are noisy on a busy machine (the JSON records the load average at start and the git
commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from omniscale.balancer.baselines import BASELINES_NO_SPLIT, BASELINES_SPLIT
from omniscale.balancer.cost import CommModel, Costs
from omniscale.balancer.distributions import generate
from omniscale.balancer.metrics import FULL_CELL, ideal_time
from omniscale.balancer.simulate import OURS, compare, judged, run_policy
from omniscale.balancer.split import unit_cost
from omniscale.balancer.stream import item_costs, llm_costs, steps_by_count, take
from omniscale.balancer.types import PlannerConfig, WindowSamples, slice_tokens
from omniscale.tools.bench.provenance import provenance

ALPHA, BETA = 24576.0, 1.0
BUDGET = 16384
WINDOW, EPSILON = 4, 0.05
SP_MAX = (32, 8)
BANDWIDTHS = (math.inf, 200e9, 25e9, 12.5e9)  # bytes/s per rank; inf: communication is free
DEFAULT_BANDWIDTH = 25e9  # the targets are judged here
# issue #44 item 4: FSDP <= 1.15 x ideal at 64 and 256 ranks, or, where the necessary splits'
# communication alone puts the bound above that, <= 1.05 x the bound that includes it; omni
# >= 1.5 x the best fair baseline at 64 ranks; text never below 1.0 x
# (DDP, the bench's own: <= 1.05 x ideal, or the same 1.05 x the bound where it is above that)
TARGETS = {"imbalance_mean": 1.05, "ddp_over_ideal": 1.05, "ddp_over_bound": 1.05,
           "fsdp_over_ideal": 1.15, "fsdp_over_bound": 1.05, "speedup_64": 1.5,
           "text_speedup": 1.0, "ms_4096": 10.0}
REPO = Path(__file__).resolve().parents[2]


def costs_at(bandwidth: float) -> tuple[Costs, CommModel]:
    comm = CommModel(bandwidth=bandwidth)
    return Costs.from_llm(ALPHA, BETA, **comm.collectives()), comm


def bandwidth_label(bandwidth: float) -> str:
    return "free" if math.isinf(bandwidth) else f"{bandwidth / 1e9:g} GB/s"


def comm_json(comm: CommModel) -> dict:
    """CommModel.describe() with an infinite bandwidth as null (JSON has no infinity)."""
    d = comm.describe()
    if math.isinf(d["bandwidth_bytes_per_s"]):
        d["bandwidth_bytes_per_s"] = None
    return d


def demo_text_lengths(scale: str) -> np.ndarray:
    """``llm_tokens`` of the demo's ``text`` source (stdlib files), corrupt rows excluded."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from omniscale.loaders.index import index_paths
    from omniscale.tools.demo import generate as generate_demo

    with tempfile.TemporaryDirectory(prefix="bench-balance-") as tmp:
        root = Path(tmp) / "demo"
        generate_demo(root, scale=scale, progress=False)
        index_paths([root / "mix.yaml"], progress=False)
        table = pq.read_table(root / "train" / "text" / "_index.parquet",
                              columns=["llm_tokens", "error"])
    good = table.filter(pc.is_null(table["error"]))
    return good["llm_tokens"].to_numpy(zero_copy_only=False).astype(np.int64)


def stream_for(dataset: str, n: int, seed: int, stdlib_N: np.ndarray | None) -> WindowSamples:
    if dataset == "stdlib":
        rng = np.random.default_rng(seed)
        return WindowSamples.from_lengths(stdlib_N[rng.integers(0, len(stdlib_N), n)])
    return generate(dataset, n, seed)


def comm_bound(stream: WindowSamples, offsets_S1: np.ndarray, costs, dp: int) -> float:
    """A lower bound on any plan's step time summed over the steps that includes the
    communication the necessary splits pay: all compute (the ideal) plus, for every sample
    longer than the micro-batch budget, the SP all-to-all of the smallest group whose slices
    fit it (a larger group only sends more: (k-1)/k of the sample), spread over the ranks."""
    planned = take(stream, 0, int(offsets_S1[-1]))
    tokens_N = planned.tokens_N
    k_N = np.ones(len(tokens_N), np.int64)
    while (over := slice_tokens(tokens_N, k_N) > BUDGET).any():
        k_N[over] *= 2
    cost_N = llm_costs(planned, costs)
    comm = float((unit_cost(cost_N, tokens_N, k_N, costs.sp_comm_per_token) * k_N
                  - cost_N).sum())
    return ideal_time(cost_N, item_costs(planned, costs), dp) + comm / dp


def run_case(dataset: str, dp: int, per_rank: int, steps: int, stdlib_N) -> dict:
    """The no-split baselines once (no communication to charge), then per bandwidth and
    sp_max our planner and the ``+split`` baselines, all on the same stream of steps."""
    per_step = dp * per_rank
    stream = stream_for(dataset, per_step * steps, seed=dp, stdlib_N=stdlib_N)
    offsets_S1 = steps_by_count(stream.num_samples, per_step)
    base = PlannerConfig(dp=dp, micro_batch_tokens=BUDGET, window=WINDOW, epsilon=EPSILON)
    free, _ = costs_at(math.inf)
    no_split = [run_policy(name, stream, offsets_S1, free, base) for name in BASELINES_NO_SPLIT]
    result = compare(no_split, stream, offsets_S1, free, base)
    for key in ("sp_max", "sp_comm_per_token", "reshard_per_token", "best_baseline",
                "speedup_vs_best_baseline", "speedup_vs_best_no_split_baseline"):
        result.pop(key)
    result["no_split_baselines"] = result.pop("policies")
    result["runs"] = []
    for bandwidth in BANDWIDTHS:
        costs, comm = costs_at(bandwidth)
        for sp_max in SP_MAX:
            config = dataclasses.replace(base, sp_max=sp_max)
            runs = [run_policy(name, stream, offsets_S1, costs, config)
                    for name in judged((OURS, *BASELINES_SPLIT))]
            r = compare(runs + no_split, stream, offsets_S1, costs, config)
            ours = r["policies"][OURS]
            ours["comm_over_ideal"] = (ours["sp_comm_per_rank"] + ours["reshard_comm"]) / \
                r["ideal_time"]
            bound = comm_bound(stream, offsets_S1, costs, dp)
            ours["fsdp_over_bound"] = ours["fsdp_time"] / bound
            ours["ddp_over_bound"] = ours["ddp_time"] / bound
            # no plan beats the bound, so the best baseline's time over it is the most any
            # planner can gain on this data: where it is under a target, the target is out of
            # reach for everyone, and how close ours comes to it is what is left to judge
            ceiling = {objective: r["policies"][name][f"{objective}_time"] / bound
                       for objective, name in r["best_baseline"].items()}
            result["runs"].append({
                "bandwidth": bandwidth_label(bandwidth), "sp_max": sp_max,
                "comm": comm_json(comm), "ours": r["policies"][OURS],
                "bound_time": bound, "bound_over_ideal": bound / r["ideal_time"],
                "speedup_ceiling_by_bound": ceiling,
                "split_baselines": {name: r["policies"][name] for name in BASELINES_SPLIT},
                **{key: r[key] for key in (
                    "best_baseline", "speedup_vs_best_baseline", "best_baseline_no_split",
                    "speedup_vs_best_no_split_baseline")}})
    result.update(dataset=dataset, samples_per_rank=per_rank)
    return result


def time_planner(costs, dp: int = 64, per_step: int = 4096, steps: int = 8,
                 repeats: int = 5) -> dict:
    """Our planner's ms per step with ``per_step`` samples in each step on ``dp`` ranks: the
    median over ``repeats`` runs of the same ``steps`` steps (one run's mean moved from 10 to
    15 ms for the same code on this machine)."""
    stream = generate("lognormal", per_step * steps, seed=11)
    config = PlannerConfig(dp=dp, micro_batch_tokens=BUDGET, window=WINDOW, epsilon=EPSILON,
                           sp_max=SP_MAX[0])
    runs = [run_policy(OURS, stream, steps_by_count(stream.num_samples, per_step), costs,
                       config).ms_S for _ in range(repeats)]
    means = [float(ms_S.mean()) for ms_S in runs]
    return {"dp": dp, "samples_per_step": per_step, "repeats": repeats,
            "ms_per_step": float(np.median(means)), "ms_per_step_runs": means,
            "ms_max_step": float(max(ms_S.max() for ms_S in runs))}


SCALE_RANKS = (4096, 16384)
SCALE_PER_RANK = 8
SCALE_MS_TARGET = (4096, 100.0)  # issue #44 item 5: <= 100 ms per step at 4,096 ranks


def time_scale(dataset: str, dp: int, windows: int) -> dict:
    """Our planner alone at ``dp`` ranks × 8 samples per step (25 GB/s, sp_max 32): wall and
    CPU (this thread's) milliseconds per step over ``windows`` windows of 4 steps, after a
    first call timed apart (numba's compile, or its on-disk cache's load, and first-touch
    allocation: once per process), and the plans' quality."""
    from omniscale.balancer.planner import plan_window
    from omniscale.balancer.stream import window_samples

    costs = costs_at(DEFAULT_BANDWIDTH)[0]
    per_step = dp * SCALE_PER_RANK
    stream = stream_for(dataset, per_step * WINDOW * windows, seed=dp, stdlib_N=None)
    offsets_S1 = steps_by_count(stream.num_samples, per_step)
    config = PlannerConfig(dp=dp, micro_batch_tokens=BUDGET, window=WINDOW, epsilon=EPSILON,
                           sp_max=SP_MAX[0])
    calls = [window_samples(stream, offsets_S1, k * WINDOW, (k + 1) * WINDOW)
             for k in range(windows)]
    t0 = time.perf_counter()
    plan_window(calls[0], costs, config)
    first_ms = (time.perf_counter() - t0) * 1e3
    wall, cpu, plans = [], [], []
    for samples in calls:
        t0, c0 = time.perf_counter(), time.thread_time()
        plans += plan_window(samples, costs, config)
        wall.append((time.perf_counter() - t0) * 1e3 / WINDOW)
        cpu.append((time.thread_time() - c0) * 1e3 / WINDOW)
    return {"dataset": dataset, "dp": dp, "samples_per_step": per_step, "steps": len(plans),
            "first_call_ms": first_ms, "ms_per_step": float(np.mean(wall)),
            "ms_max_window_step": float(np.max(wall)), "cpu_ms_per_step": float(np.mean(cpu)),
            "imbalance_mean": float(np.mean([p.imbalance for p in plans])),
            "fsdp_time": float(sum(p.fsdp_time for p in plans)),
            "ddp_time": float(sum(p.ddp_time for p in plans)),
            "micro_batches_mean": float(np.mean([p.num_micro_batches for p in plans]))}


def scale_case(dataset: str, dp: int, steps: int) -> dict:
    """Our planner and every baseline (with and without our split) on the same stream at
    ``dp`` ranks × 8 samples, 25 GB/s, sp_max 32: the simulation's comparison at scale."""
    costs = costs_at(DEFAULT_BANDWIDTH)[0]
    per_step = dp * SCALE_PER_RANK
    stream = stream_for(dataset, per_step * steps, seed=dp, stdlib_N=None)
    offsets_S1 = steps_by_count(stream.num_samples, per_step)
    config = PlannerConfig(dp=dp, micro_batch_tokens=BUDGET, window=WINDOW, epsilon=EPSILON,
                           sp_max=SP_MAX[0])
    t0 = time.perf_counter()
    runs = [run_policy(name, stream, offsets_S1, costs, config)
            for name in judged((OURS, *BASELINES_SPLIT, *BASELINES_NO_SPLIT))]
    result = compare(runs, stream, offsets_S1, costs, config)
    result.update(dataset=dataset, samples_per_rank=SCALE_PER_RANK,
                  bandwidth=bandwidth_label(DEFAULT_BANDWIDTH),
                  seconds=time.perf_counter() - t0)
    return result


def run_scale(ranks: list[int], timing_only: bool) -> dict:
    """The scale section (``--scale``): planner timing at each size, then (unless
    ``timing_only``) the full comparison; targets: <= 100 ms per step at 4,096 ranks."""
    timing = []
    for dp in ranks:
        for dataset in ("lognormal", "omni"):
            timing.append(time_scale(dataset, dp, windows=2 if dp <= 4096 else 1))
            t = timing[-1]
            print(f"planner {dataset} {dp} ranks: {t['ms_per_step']:.1f} ms/step wall, "
                  f"{t['cpu_ms_per_step']:.1f} ms CPU (first call {t['first_call_ms']:.0f} ms)",
                  flush=True)
    cases = [] if timing_only else [scale_case(dataset, dp, 2 * WINDOW if dp <= 4096 else WINDOW)
                                    for dp in ranks for dataset in ("lognormal", "omni")]
    dp_t, ms_t = SCALE_MS_TARGET
    checks = [{"target": f"planner ms/step, {t['dataset']}, {dp_t:,} ranks x {SCALE_PER_RANK}"
                         " samples (JIT excluded: first_call_ms)",
               "measured": t["ms_per_step"], "goal": f"<= {ms_t:g}",
               "met": t["ms_per_step"] <= ms_t} for t in timing if t["dp"] == dp_t]
    by = {(t["dataset"], t["dp"]): t for t in timing}
    growth = []
    for dataset in ("lognormal", "omni"):
        sizes = sorted(dp for d, dp in by if d == dataset)
        for small, big in zip(sizes, sizes[1:]):
            n0, n1 = small * SCALE_PER_RANK, big * SCALE_PER_RANK
            growth.append({"dataset": dataset, "from": small, "to": big,
                           "cpu_ms_ratio": by[(dataset, big)]["cpu_ms_per_step"]
                           / by[(dataset, small)]["cpu_ms_per_step"],
                           "n_log_n_ratio": n1 * math.log(n1) / (n0 * math.log(n0))})
    return {"samples_per_rank": SCALE_PER_RANK, "bandwidth": bandwidth_label(DEFAULT_BANDWIDTH),
            "sp_max": SP_MAX[0], "timing": timing, "growth": growth, "cases": cases,
            "targets": checks}


def headline_table(cases: list[dict]) -> Table:
    table = Table(title=f"balancer benchmark: ours (W={WINDOW}, eps={EPSILON}) vs the best "
                        f"baseline with our split, and without (no split); cost {ALPHA:g}*L + "
                        f"{BETA:g}*L^2, budget {BUDGET} tokens; times / ideal (compute only)")
    for col in ("data", "ranks", "sp", "bandwidth", "imb mean", "DDP/ideal", "FSDP/ideal",
                "FSDP/bound", "comm/ideal", "best +split (DDP)", "its DDP/ideal", "x DDP", "x FSDP",
                "no split: best DDP/ideal", "x DDP no split", "x FSDP no split", "ms/step",
                "viol", "once"):
        table.add_column(col, justify="left" if col in ("data", "best +split (DDP)",
                                                        "bandwidth") else "right",
                         no_wrap=True)
    for case in cases:
        for run in case["runs"]:
            ours, s, s0 = run["ours"], run["speedup_vs_best_baseline"], \
                run["speedup_vs_best_no_split_baseline"]
            best = run["best_baseline"]["ddp"]
            best0 = case["no_split_baselines"][run["best_baseline_no_split"]["ddp"]]
            comm = ours["comm_over_ideal"]
            table.add_row(case["dataset"], str(case["dp"]), str(run["sp_max"]),
                          run["bandwidth"], f"{ours['imbalance_mean']:.3f}",
                          f"{ours['ddp_over_ideal']:.3f}", f"{ours['fsdp_over_ideal']:.3f}",
                          f"{ours['fsdp_over_bound']:.3f}", f"{comm:.3f}", best,
                          f"{run['split_baselines'][best]['ddp_over_ideal']:.3f}",
                          f"{s['ddp']:.2f}", f"{s['fsdp']:.2f}",
                          f"{best0['ddp_over_ideal']:.3f}", f"{s0['ddp']:.2f}",
                          f"{s0['fsdp']:.2f}", f"{ours['planner_ms_per_step']:.2f}",
                          str(ours["violations"]), "yes" if ours["exactly_once"] else "NO")
    return table


def breakdown_table(cases: list[dict]) -> Table:
    """Where the FSDP time goes at the default bandwidth, sp_max 32, ours and the best
    ``+split`` baseline (FSDP): ``metrics.fsdp_breakdown``'s parts over the ideal, beside
    the bound with the necessary splits' communication."""
    table = Table(title=f"FSDP time / ideal, part by part ({bandwidth_label(DEFAULT_BANDWIDTH)}"
                        f", sp_max {SP_MAX[0]}): work = compute + SP all-to-all; idle in slots "
                        f"(beside split slices; in cells >= {FULL_CELL:.0%} of the token budget)")
    for col in ("data", "ranks", "policy", "FSDP/ideal", "bound/ideal", "work", "slot idle",
                "beside splits", "full cells", "encoder idle", "reshard"):
        table.add_column(col, justify="left" if col in ("data", "policy") else "right",
                         no_wrap=True)
    for case in cases:
        run = at_default(case, SP_MAX[0])
        best = run["best_baseline"]["fsdp"]
        for name, policy in ((OURS, run["ours"]), (best, run["split_baselines"][best])):
            parts = policy["fsdp_breakdown"]
            table.add_row(case["dataset"], str(case["dp"]), name,
                          f"{policy['fsdp_over_ideal']:.3f}", f"{run['bound_over_ideal']:.3f}",
                          *(f"{parts[k]:.3f}" for k in (
                              "work", "slot_idle", "slot_idle_beside_splits",
                              "slot_idle_in_full_cells", "encoder_idle", "reshard")))
    return table


def at_default(case: dict, sp_max: int) -> dict:
    """The case's run at the default bandwidth and this sp_max."""
    label = bandwidth_label(DEFAULT_BANDWIDTH)
    return next(r for r in case["runs"] if r["bandwidth"] == label and r["sp_max"] == sp_max)


def target_checks(cases: list[dict], timing: dict) -> list[dict]:
    """Each target of the issue with the measured figure and whether it is met: at the
    default bandwidth, sp_max 32, against the best baseline that may split (text: every
    sp_max and both objectives)."""
    at = f"{bandwidth_label(DEFAULT_BANDWIDTH)}, sp_max {SP_MAX[0]}"
    runs32 = [(c, at_default(c, SP_MAX[0])) for c in cases]
    worst = max(r["ours"]["imbalance_mean"] for _, r in runs32)
    violations = sum(r["ours"]["violations"] for c in cases for r in c["runs"])
    once = all(r["ours"]["exactly_once"] for c in cases for r in c["runs"])
    checks = [
        (f"mean imbalance (worst case, sp_max {SP_MAX[0]})", worst,
         f"<= {TARGETS['imbalance_mean']}", worst <= TARGETS["imbalance_mean"]),
        step_time_check("ddp", runs32, "8-256", at),
        step_time_check("fsdp", [(c, r) for c, r in runs32 if c["dp"] in (64, 256)], "64 and 256",
                        at),
        *(text_check(dataset, [(c, r) for c in cases if c["dataset"] == dataset
                               for r in c["runs"]
                               if r["bandwidth"] == bandwidth_label(DEFAULT_BANDWIDTH)])
          for dataset in ("lognormal", "stdlib")),
        *(omni_check(c, r, at) for c, r in runs32 if c["dp"] == 64 and c["dataset"] == "omni"),
        (f"planner ms/step, {timing['samples_per_step']} samples on {timing['dp']} ranks",
         timing["ms_per_step"], f"<= {TARGETS['ms_4096']}", timing["ms_per_step"]
         <= TARGETS["ms_4096"]),
        ("budget violations (ours)", violations, "0", violations == 0),
        ("every sample planned exactly once (ours)", once, "True", once),
    ]
    return [{"target": t, "measured": m, "goal": g, "met": bool(ok)} for t, m, g, ok in checks]


def step_time_check(objective: str, runs: list[tuple[dict, dict]], ranks: str, at: str) -> tuple:
    """DDP or FSDP step time against the ideal where its target over ideal is reachable, and
    against the bound with the necessary splits' communication (``comm_bound``) where that
    bound alone is above it: the worst case's ratio against what applies to it."""
    over_ideal = TARGETS[f"{objective}_over_ideal"]
    over_bound = TARGETS[f"{objective}_over_bound"]
    ratios = [r["ours"][f"{objective}_over_ideal"] / over_ideal
              if r["bound_over_ideal"] <= over_ideal
              else r["ours"][f"{objective}_over_bound"] / over_bound for _, r in runs]
    c, r = runs[int(np.argmax(ratios))]
    by_bound = r["bound_over_ideal"] > over_ideal
    name = objective.upper()
    what = (f"{name} step time / bound with the necessary splits' comm (the bound "
            f"{r['bound_over_ideal']:.3f} x ideal)" if by_bound else f"{name} step time / ideal")
    value = r["ours"][f"{objective}_over_{'bound' if by_bound else 'ideal'}"]
    goal = over_bound if by_bound else over_ideal
    return (f"{what}, worst case at {ranks} ranks ({c['dataset']} at {c['dp']}), {at}",
            value, f"<= {goal} ({over_ideal} x ideal, or {over_bound} x the bound where it is "
                   "above that)", value <= goal)


def omni_check(case: dict, run: dict, at: str) -> tuple:
    """Omni at 64 ranks against the best baseline that may split, the lower of DDP and FSDP,
    with the most any plan could gain there: the baseline's time over ``comm_bound``."""
    objective = min(run["speedup_vs_best_baseline"], key=run["speedup_vs_best_baseline"].get)
    speedup = run["speedup_vs_best_baseline"][objective]
    return (f"speed-up vs best baseline with our split ({run['best_baseline'][objective]}), "
            f"{case['dataset']} at 64 ranks, {at} (the lower of DDP and FSDP: "
            f"{objective.upper()}; no plan can pass "
            f"{run['speedup_ceiling_by_bound'][objective]:.3f}x there, the best baseline's "
            "time over the bound with the necessary splits' comm)", speedup,
            f">= {TARGETS['speedup_64']}", speedup >= TARGETS["speedup_64"])


def text_check(dataset: str, runs: list[tuple[dict, dict]]) -> tuple:
    """Text never below the best fair baseline: the least speed-up over every size, sp_max
    and objective at the default bandwidth."""
    worst = min((v, c["dp"], r["sp_max"], k) for c, r in runs
                for k, v in r["speedup_vs_best_baseline"].items())
    return (f"speed-up vs best baseline with our split, {dataset}: the least over 8-256 ranks, "
            f"sp_max {' and '.join(map(str, SP_MAX))}, DDP and FSDP, "
            f"{bandwidth_label(DEFAULT_BANDWIDTH)} ({worst[1]} ranks, sp_max {worst[2]}, "
            f"{worst[3].upper()})", worst[0], f">= {TARGETS['text_speedup']}",
            worst[0] >= TARGETS["text_speedup"])


def run_provenance() -> dict:
    return {**provenance(),
            "timing_note": "ms/step figures are wall-clock and noisy on a busy machine; all "
                           "other figures are deterministic simulations"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 ranks, 4 steps, tiny demo")
    parser.add_argument("--out", default="bench-balance.json", help="JSON output path")
    parser.add_argument("--scale", action="store_true",
                        help="only the scale section: 4,096 and 16,384 ranks x 8 samples")
    parser.add_argument("--scale-ranks", default=",".join(map(str, SCALE_RANKS)),
                        help="job sizes of --scale (default 4096,16384)")
    parser.add_argument("--timing-only", action="store_true",
                        help="with --scale: the planner's timing alone, no comparison")
    parser.add_argument("--note", help="with --scale: a line recorded in the JSON (which "
                        "code was measured, when it is not this checkout's)")
    args = parser.parse_args(argv)
    console = Console(width=240)
    started = run_provenance()
    if args.scale:
        t0 = time.perf_counter()
        out = {"command": " ".join(["tools/bench/balance.py", *(argv or sys.argv[1:])]),
               **started, **({"note": args.note} if args.note else {}),
               "alpha": ALPHA, "beta": BETA, "budget": BUDGET, "window": WINDOW,
               "epsilon": EPSILON, "comm_model": comm_json(costs_at(DEFAULT_BANDWIDTH)[1]),
               **run_scale([int(x) for x in args.scale_ranks.split(",")], args.timing_only)}
        for c in out["targets"]:
            console.print(f"{'PASS' if c['met'] else 'MISS'}  {c['target']}: "
                          f"{c['measured']:.1f} (target {c['goal']})")
        for case in out["cases"]:
            ours = case["policies"][OURS]
            console.print(f"{case['dataset']} {case['dp']} ranks: imbalance "
                          f"{ours['imbalance_mean']:.4f}, FSDP/ideal {ours['fsdp_over_ideal']:.3f}"
                          f", x best +split (FSDP) {case['speedup_vs_best_baseline']['fsdp']:.3f}"
                          f" ({case['seconds']:.0f} s)")
        out["seconds"] = time.perf_counter() - t0
        Path(args.out).write_text(json.dumps(out, indent=1))
        console.print(f"wrote {args.out} ({out['seconds']:.1f} s)")
        return 0
    dps, steps, scale = ((8, 64), 4, "tiny") if args.quick else ((8, 64, 256), 8, "small")
    t0 = time.perf_counter()
    stdlib_N = demo_text_lengths(scale)
    console.print(f"demo stdlib text ({scale}): {len(stdlib_N)} samples, median "
                  f"{int(np.median(stdlib_N))}, max {int(stdlib_N.max())} tokens (resampled)")
    cases = [run_case(dataset, dp, 16, steps, stdlib_N)
             for dataset in ("lognormal", "stdlib", "omni") for dp in dps]
    timing = time_planner(costs_at(DEFAULT_BANDWIDTH)[0], steps=4 if args.quick else 8,
                          repeats=1 if args.quick else 5)
    console.print(headline_table(cases))
    console.print(breakdown_table(cases))
    checks = target_checks(cases, timing)
    for c in checks:
        measured = f"{c['measured']:.3f}" if isinstance(c["measured"], float) else c["measured"]
        console.print(f"{'PASS' if c['met'] else 'MISS'}  {c['target']}: {measured} "
                      f"(target {c['goal']})")
    out = {"quick": args.quick, **started, "alpha": ALPHA, "beta": BETA, "budget": BUDGET,
           "window": WINDOW, "epsilon": EPSILON, "sp_max": list(SP_MAX),
           "bandwidths": [bandwidth_label(b) for b in BANDWIDTHS],
           "default_bandwidth": bandwidth_label(DEFAULT_BANDWIDTH),
           "comm_model": comm_json(costs_at(DEFAULT_BANDWIDTH)[1]),
           "stdlib_samples": int(len(stdlib_N)), "cases": cases, "planner_timing": timing,
           "targets": checks, "seconds": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    console.print(f"wrote {args.out} ({out['seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
