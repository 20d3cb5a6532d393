"""Sources in an object store against the same data on local disk: loader throughput,
data-wait, bytes and requests, with the store's latency swept.

    .venv/bin/python tools/bench/remote.py [--steps 8] [--workers 2] [--rounds 3]
        [--latency-ms 0 20 100] [--workload mixed] [--scale medium] [--out docs/bench/remote.json]

The loader benchmark's workload (``loader.py``: the demo's tar sources, mixed; ``--scale
medium`` and ``--steps 8`` by default, so that a run reads each sample once and the cache
gains nothing from the data's own repeats -- a source past one epoch is warned about and
listed in the JSON), an embedded plane
at dp 1, 16,384-token steps, every step committed, ``--workers`` DataLoader workers) read
from local disk (the baseline) and from a local S3 server (``tools/s3_server.py``: moto in its
own process, the demo copied there by ``omniscale data copy``; the latency is added per
request on the server side), three ways:

- ``direct``: no cache; each work item's samples fetched with coalesced ranged reads;
- ``cold``: an empty ``data.cache_dir``, filled ahead of the workers from the next
  ``--ahead`` steps' plans (the plane knows them);
- ``warm``: the same cache again, now holding what the cold run fetched (a second epoch, a
  restarted job, another rank of the node).

The loader runs flat out (no training step), so its samples/s is the most a trainer could
take and every second of it is data-wait: the strictest test of the store path. Per run:
samples/s, data-wait, requests per step and bytes fetched per sample (the server's counters
over the whole run: its first step and what the loader read ahead past the last one included,
so they rise with the read-ahead's depth) against the mean size of the samples read, and the
same for the measured steps' own work items alone (their batches' reader counters; a cache's
plan prefetch reads apart and is not in them). The four alternate within each round, the order
rotating; the headline per latency is the median of the per-round ratios to local disk.
Target: ``cold`` with 20 ms per request at least 0.9x local.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from omniscale.tools.bench.loader import WORKLOADS, demo_spec, run_ours  # noqa: E402
from omniscale.tools.bench.provenance import provenance  # noqa: E402

SIDES = ("local", "direct", "cold", "warm")
TARGET = 0.9  # cold cache with prefetch, 20 ms per request, vs local disk


def remote_loader(cache_dir: Path | None, workers: int, ahead: int):
    """A ``run_ours`` loader factory over the spec's (remote) locations."""
    from omniscale.loaders.block_cache import CacheConfig
    from omniscale.loaders.pipeline import RankLoader
    from omniscale.tools.train.plane_session import loader_for

    cache = CacheConfig(str(cache_dir), 1 << 30) if cache_dir is not None else None
    return lambda url, spec: loader_for(
        url, 0, RankLoader, spec.locations, spec.tokenizer, spec.media, num_workers=workers,
        prefetch_steps=2, indexes=spec.indexes, cache=cache,
        cache_prefetch_steps=ahead if cache is not None else 0)


def mean_sample_bytes(spec_path: Path, drawn: dict[str, int]) -> float:
    """The mean byte size of the samples drawn, from the indexes (weighted by source)."""
    import pyarrow.compute as pc

    from omniscale.dataplane.spec import load_spec
    from omniscale.index_schema import read_index

    spec = load_spec(spec_path)
    total = count = 0
    for s in spec.sources:
        n = drawn.get(s.name, 0)
        if n:
            size = read_index(s.index, columns=["size"]).column("size")
            total += n * pc.mean(size).as_py()
            count += n
    return total / max(count, 1)


def run_side(side: str, specs: dict, server, cache_dir: Path, steps: int, workers: int,
             ahead: int) -> dict:
    if side == "local":
        return run_ours(specs["local"], steps, workers)
    if side in ("direct", "cold"):
        shutil.rmtree(cache_dir, ignore_errors=True)
    before = server.stats()
    out = run_ours(specs["remote"], steps, workers, remote_loader(
        None if side == "direct" else cache_dir, workers, ahead))
    after = server.stats()
    samples = max(out["samples"], 1)
    # The store's counters: the whole run, its first step and what the loader read ahead past
    # the last step included (a worker keeps items in flight), over steps + 1.
    out["requests_per_step"] = (after["requests"] - before["requests"]) / (steps + 1)
    out["fetched_bytes_per_sample"] = (after["bytes_out"] - before["bytes_out"]) / samples
    # The measured steps' own work items (their batches' reader counters): what a step costs
    # whatever the read-ahead; a cache's plan prefetch is not in them (it reads apart).
    io = out.pop("io", {})
    out["own_requests_per_step"] = io.get("store_requests", 0) / steps
    out["own_fetched_bytes_per_sample"] = io.get("store_bytes", 0) / samples
    return out


def main(argv: list[str] | None = None) -> dict:
    from omniscale.tools.data_copy import copy_specs
    from omniscale.tools.s3_server import S3Server

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "omniscale-bench")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ahead", type=int, default=4, help="steps of plans the cache prefetches")
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0, 100.0])
    ap.add_argument("--workload", choices=list(WORKLOADS), default="mixed")
    ap.add_argument("--scale", choices=("tiny", "small", "medium"), default="medium",
                    help="demo scale: large enough that a run reads no sample twice (a cold "
                         "cache must not be warmed by the data's own repeats)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    started = provenance()
    local = demo_spec(args.data, args.workload, args.scale)
    os.environ.update(S3Server.env())
    results = []
    with S3Server() as server, tempfile.TemporaryDirectory() as scratch:
        server.make_bucket("bench")
        remote, = copy_specs([local], "s3://bench/demo", server.storage_options,
                             suffix="_s3", progress=False)
        specs = {"local": local, "remote": remote}
        cache_dir = Path(scratch) / "cache"
        for latency in args.latency_ms:
            server.control(latency_ms=latency)
            rounds = []
            for r in range(args.rounds):
                order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
                # warm needs the cold run's cache: it always follows cold
                order = tuple(s for s in order if s != "warm")
                order = order[:order.index("cold") + 1] + ("warm",) + order[
                    order.index("cold") + 1:]
                runs = {s: run_side(s, specs, server, cache_dir, args.steps, args.workers,
                                    args.ahead) for s in order}
                wrapped = sorted({n for run in runs.values()
                                  for n, e in run["epochs"].items() if e})
                if wrapped:  # a source's second epoch: the cache serves repeats
                    print(f"warning: {', '.join(wrapped)} went past one epoch; the cold "
                          "cache's figures are flattered (a larger --scale, fewer --steps)",
                          flush=True)
                base = runs["local"]["samples_per_s"]
                ratios = {s: runs[s]["samples_per_s"] / base for s in SIDES if s != "local"}
                rounds.append({"runs": runs, "ratio": ratios})
                print(f"{latency:5.0f} ms round {r + 1}/{args.rounds}: local {base:6.1f} "
                      f"samples/s; " + ", ".join(
                          f"{s} {runs[s]['samples_per_s']:6.1f} ({ratios[s]:.2f}x, "
                          f"{runs[s]['requests_per_step']:.1f} req/step, "
                          f"{runs[s]['fetched_bytes_per_sample'] / 1024:.0f} KiB/sample; "
                          f"the steps' own {runs[s]['own_requests_per_step']:.1f}, "
                          f"{runs[s]['own_fetched_bytes_per_sample'] / 1024:.0f} KiB)"
                          for s in SIDES if s != "local"), flush=True)
            drawn = rounds[0]["runs"]["local"]["drawn_per_source"]
            row = {"latency_ms": latency, "rounds": rounds,
                   "past_one_epoch": sorted({n for r in rounds for run in r["runs"].values()
                                             for n, e in run["epochs"].items() if e}),
                   "mean_sample_bytes": mean_sample_bytes(local, drawn)}
            for s in SIDES:
                row[s] = {k: statistics.median(r["runs"][s][k] for r in rounds)
                          for k in ("samples_per_s", "data_wait_s")
                          + (("requests_per_step", "fetched_bytes_per_sample",
                              "own_requests_per_step", "own_fetched_bytes_per_sample")
                             if s != "local" else ())}
                if s != "local":
                    values = [r["ratio"][s] for r in rounds]
                    row[s]["ratio"] = {"median": statistics.median(values),
                                       "min": min(values), "max": max(values)}
            results.append(row)
            for r in rounds:
                for run in r["runs"].values():
                    run.pop("drawn_per_source", None)
    at20 = next((r for r in results if r["latency_ms"] == 20.0), None)
    verdict = None
    if at20 is not None:
        verdict = at20["cold"]["ratio"]["median"] >= TARGET
        print(f"cold cache with plan prefetch at 20 ms: {at20['cold']['ratio']['median']:.2f}x "
              f"local disk (target {TARGET}x: {'met' if verdict else 'NOT met'})")
    result = {"command": " ".join(["tools/bench/remote.py"] + (argv or sys.argv[1:])),
              **started, "workload": args.workload, "workers": args.workers,
              "steps": args.steps, "ahead": args.ahead, "latencies": results,
              "target": {"cold_at_20ms_vs_local": TARGET, "met": verdict},
              "load_avg_after": os.getloadavg()[0]}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
