"""The trainer smoke run of tools/bench/gpu_check.sh, summarised: median tokens/s, MFU and step
time over the steps after warm-up, peak device memory, the run's settings, into one JSON.

    python tools/bench/_gpu_train_summary.py RUN_DIR --out gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from omniscale.tools.bench.provenance import provenance
from omniscale.tools.train.metrics import read_metrics

WARMUP = 5  # steps left out: compilation, allocator growth, the first plans


def summarise(run: Path) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    if len(rows) <= WARMUP:
        raise SystemExit(f"{run}: {len(rows)} steps in metrics.jsonl; need more than {WARMUP}")
    steady = rows[WARMUP:]

    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None
    config = yaml.safe_load((run / "config.yaml").read_text()) \
        if (run / "config.yaml").exists() else None
    return {"steps": len(rows), "steps_measured": len(steady), "tokens_per_s": median(
        "tokens_per_s"), "mfu": median("mfu"), "tflops_per_s": median("tflops_per_s"),
        "step_s": median("step_s"), "peak_mem_gib": max(
            (r.get("peak_mem_gib") or 0.0) for r in rows) or None,
        "final_loss": rows[-1]["loss"], "config": config, "provenance": provenance()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    summary = summarise(args.run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {summary['mfu']}, peak "
          f"{summary['peak_mem_gib']} GiB over {summary['steps_measured']} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
