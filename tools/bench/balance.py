"""Balancer benchmark: our planner against the baselines, same data, same run.

    .venv/bin/python tools/bench/balance.py [--quick] [--out bench-balance.json]

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
bandwidth (25 GB/s). Everything but the ms/step timings is a deterministic simulation; the
timings are noisy on a busy machine (the JSON records the load average at start and the git
commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from omniscale.balancer.baselines import BASELINES_NO_SPLIT, BASELINES_SPLIT
from omniscale.balancer.cost import CommModel, Costs
from omniscale.balancer.distributions import generate
from omniscale.balancer.simulate import OURS, compare, run_policy
from omniscale.balancer.stream import steps_by_count
from omniscale.balancer.types import PlannerConfig, WindowSamples
from omniscale.tools.bench.provenance import provenance

ALPHA, BETA = 24576.0, 1.0
BUDGET = 16384
WINDOW, EPSILON = 4, 0.05
SP_MAX = (32, 8)
BANDWIDTHS = (math.inf, 200e9, 25e9, 12.5e9)  # bytes/s per rank; inf: communication is free
DEFAULT_BANDWIDTH = 25e9  # the targets are judged here
TARGETS = {"imbalance_mean": 1.05, "ddp_over_ideal": 1.05, "fsdp_over_ideal": 1.05,
           "speedup_64": 1.5, "ms_4096": 10.0}
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
                    for name in (OURS, *BASELINES_SPLIT)]
            r = compare(runs + no_split, stream, offsets_S1, costs, config)
            ours = r["policies"][OURS]
            ours["comm_over_ideal"] = (ours["sp_comm_per_rank"] + ours["reshard_comm"]) / \
                r["ideal_time"]
            result["runs"].append({
                "bandwidth": bandwidth_label(bandwidth), "sp_max": sp_max,
                "comm": comm_json(comm), "ours": r["policies"][OURS],
                "split_baselines": {name: r["policies"][name] for name in BASELINES_SPLIT},
                **{key: r[key] for key in (
                    "best_baseline", "speedup_vs_best_baseline", "best_baseline_no_split",
                    "speedup_vs_best_no_split_baseline")}})
    result.update(dataset=dataset, samples_per_rank=per_rank)
    return result


def time_planner(costs, dp: int = 64, per_step: int = 4096, steps: int = 8) -> dict:
    """Our planner's ms per step with ``per_step`` samples in each step on ``dp`` ranks."""
    stream = generate("lognormal", per_step * steps, seed=11)
    config = PlannerConfig(dp=dp, micro_batch_tokens=BUDGET, window=WINDOW, epsilon=EPSILON,
                           sp_max=SP_MAX[0])
    run = run_policy(OURS, stream, steps_by_count(stream.num_samples, per_step), costs, config)
    return {"dp": dp, "samples_per_step": per_step, "ms_per_step": float(run.ms_S.mean()),
            "ms_max_step": float(run.ms_S.max())}


def headline_table(cases: list[dict]) -> Table:
    table = Table(title=f"balancer benchmark: ours (W={WINDOW}, eps={EPSILON}) vs the best "
                        f"baseline with our split, and without (no split); cost {ALPHA:g}*L + "
                        f"{BETA:g}*L^2, budget {BUDGET} tokens; times / ideal (compute only)")
    for col in ("data", "ranks", "sp", "bandwidth", "imb mean", "DDP/ideal", "FSDP/ideal",
                "comm/ideal", "best +split (DDP)", "its DDP/ideal", "x DDP", "x FSDP",
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
                          f"{comm:.3f}", best,
                          f"{run['split_baselines'][best]['ddp_over_ideal']:.3f}",
                          f"{s['ddp']:.2f}", f"{s['fsdp']:.2f}",
                          f"{best0['ddp_over_ideal']:.3f}", f"{s0['ddp']:.2f}",
                          f"{s0['fsdp']:.2f}", f"{ours['planner_ms_per_step']:.2f}",
                          str(ours["violations"]), "yes" if ours["exactly_once"] else "NO")
    return table


def at_default(case: dict, sp_max: int) -> dict:
    """The case's run at the default bandwidth and this sp_max."""
    label = bandwidth_label(DEFAULT_BANDWIDTH)
    return next(r for r in case["runs"] if r["bandwidth"] == label and r["sp_max"] == sp_max)


def target_checks(cases: list[dict], timing: dict) -> list[dict]:
    """Each target of the issue with the measured figure and whether it is met: at the
    default bandwidth, sp_max 32, against the best baseline that may split."""
    at = f"{bandwidth_label(DEFAULT_BANDWIDTH)}, sp_max {SP_MAX[0]}"
    runs32 = [(c, at_default(c, SP_MAX[0])) for c in cases]
    worst = max(r["ours"]["imbalance_mean"] for _, r in runs32)
    worst_time = max(r["ours"]["ddp_over_ideal"] for _, r in runs32)
    worst_fsdp = max(r["ours"]["fsdp_over_ideal"] for _, r in runs32)
    violations = sum(r["ours"]["violations"] for c in cases for r in c["runs"])
    once = all(r["ours"]["exactly_once"] for c in cases for r in c["runs"])
    checks = [
        (f"mean imbalance (worst case, sp_max {SP_MAX[0]})", worst,
         f"<= {TARGETS['imbalance_mean']}", worst <= TARGETS["imbalance_mean"]),
        (f"DDP step time / ideal (worst case, {at})", worst_time,
         f"<= {TARGETS['ddp_over_ideal']}", worst_time <= TARGETS["ddp_over_ideal"]),
        (f"FSDP step time / ideal (worst case, {at})", worst_fsdp,
         f"<= {TARGETS['fsdp_over_ideal']}", worst_fsdp <= TARGETS["fsdp_over_ideal"]),
        *((f"speed-up vs best baseline with our split ({r['best_baseline']['ddp']}), "
           f"{c['dataset']} at 64 ranks, {at} (DDP)", r["speedup_vs_best_baseline"]["ddp"],
           f">= {TARGETS['speedup_64']}",
           r["speedup_vs_best_baseline"]["ddp"] >= TARGETS["speedup_64"])
          for c, r in runs32 if c["dp"] == 64),
        (f"planner ms/step, {timing['samples_per_step']} samples on {timing['dp']} ranks",
         timing["ms_per_step"], f"<= {TARGETS['ms_4096']}", timing["ms_per_step"]
         <= TARGETS["ms_4096"]),
        ("budget violations (ours)", violations, "0", violations == 0),
        ("every sample planned exactly once (ours)", once, "True", once),
    ]
    return [{"target": t, "measured": m, "goal": g, "met": bool(ok)} for t, m, g, ok in checks]


def run_provenance() -> dict:
    return {**provenance(),
            "timing_note": "ms/step figures are wall-clock and noisy on a busy machine; all "
                           "other figures are deterministic simulations"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 ranks, 4 steps, tiny demo")
    parser.add_argument("--out", default="bench-balance.json", help="JSON output path")
    args = parser.parse_args(argv)
    console = Console(width=240)
    started = run_provenance()
    dps, steps, scale = ((8, 64), 4, "tiny") if args.quick else ((8, 64, 256), 8, "small")
    t0 = time.perf_counter()
    stdlib_N = demo_text_lengths(scale)
    console.print(f"demo stdlib text ({scale}): {len(stdlib_N)} samples, median "
                  f"{int(np.median(stdlib_N))}, max {int(stdlib_N.max())} tokens (resampled)")
    cases = [run_case(dataset, dp, 16, steps, stdlib_N)
             for dataset in ("lognormal", "stdlib", "omni") for dp in dps]
    timing = time_planner(costs_at(DEFAULT_BANDWIDTH)[0], steps=4 if args.quick else 8)
    console.print(headline_table(cases))
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
