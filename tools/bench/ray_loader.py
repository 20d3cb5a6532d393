"""What the Ray path costs: the job's Ray decoding pools against DataLoader worker processes,
on the same plans.

    .venv/bin/python tools/bench/ray_loader.py [--steps 40] [--workers 2] [--rounds 4]
        [--workload mixed] [--out docs/bench/ray_loader.json]

The loader benchmark's workload (``loader.py``: the tiny demo's tar sources, an embedded plane
at dp 1, 16,384-token steps, every step committed) read two ways: a ``RankLoader`` with
``--workers`` DataLoader workers (the baseline, the default loader), and a ``RayRankLoader``
on a Ray instance of this machine's CPUs with its default pools (planned to fit, one actor per
source at least). Ray's start and each loader's start (to its first step: the pools measure
costs and start actors, the workers fork) are reported apart and not timed as throughput.
The two alternate over ``--rounds`` rounds (the order swapping each round); the headline is
the median of the per-round ratios of Ray's samples/s to the workers', with the data-wait of
each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from omniscale.tools.bench.loader import WORKLOADS, demo_spec, run_ours  # noqa: E402
from omniscale.tools.bench.provenance import provenance  # noqa: E402


def run_ray(spec_path: Path, steps: int) -> dict:
    """The workload through the job's default Ray pools (a fresh local Ray instance each
    run; its start timed apart, like the loader's)."""
    import ray

    from omniscale.loaders.ray_cluster import start_local
    from omniscale.tools.train.plane_session import ray_loader_for

    started = time.perf_counter()
    start_local("omniscale-bench")
    ray_start = time.perf_counter() - started
    try:
        return {**run_ours(spec_path, steps, 0, lambda url, spec: ray_loader_for(
            url, 0, {s.name: s.path for s in spec.sources}, spec.tokenizer, spec.media,
            prefetch_steps=2)), "ray_start_s": ray_start}
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "omniscale-bench")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="rounds, the order swapping")
    ap.add_argument("--workload", choices=list(WORKLOADS), default="mixed")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    started = provenance()
    spec_path = demo_spec(args.data, args.workload)
    rounds = []
    for r in range(args.rounds):
        runs = {}
        for side in (("ray", "workers") if r % 2 == 0 else ("workers", "ray")):
            runs[side] = run_ray(spec_path, args.steps) if side == "ray" else \
                run_ours(spec_path, args.steps, args.workers)
        for side in runs.values():
            side.pop("drawn_per_source", None)
        ratio = runs["ray"]["samples_per_s"] / runs["workers"]["samples_per_s"]
        rounds.append({**runs, "ratio": ratio})
        print(f"round {r + 1}/{args.rounds}: Ray {runs['ray']['samples_per_s']:7.1f} "
              f"samples/s (data wait {runs['ray']['data_wait_s']:.1f} s), workers "
              f"{runs['workers']['samples_per_s']:7.1f} (data wait "
              f"{runs['workers']['data_wait_s']:.1f} s): {ratio:.2f}x", flush=True)
    ratios = [r["ratio"] for r in rounds]
    median = {side: {k: statistics.median(r[side][k] for r in rounds)
                     for k in ("samples_per_s", "data_wait_s")} for side in ("ray", "workers")}
    for side, k in (("ray", "ray_start_s"), ("ray", "start_s"), ("workers", "start_s")):
        median[side][k] = statistics.median(r[side][k] for r in rounds)
    print(f"{args.workload}: Ray pools {statistics.median(ratios):.2f}x the DataLoader workers' "
          f"samples/s ({min(ratios):.2f}-{max(ratios):.2f}); Ray start "
          f"{median['ray']['ray_start_s']:.1f} s, pools start (to the first step) "
          f"{median['ray']['start_s']:.1f} s, workers' {median['workers']['start_s']:.1f} s")
    result = {"command": " ".join(["tools/bench/ray_loader.py"] + (argv or sys.argv[1:])),
              **started, "workload": args.workload, "workers": args.workers,
              "rounds": rounds, "median": median,
              "ratio": {"median": statistics.median(ratios), "min": min(ratios),
                        "max": max(ratios)},
              "load_avg_after": os.getloadavg()[0]}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
