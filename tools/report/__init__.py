"""``omniscale report RUN_DIR``: PNG plots of a training run and an ``index.html`` showing them.

Reads ``RUN_DIR/metrics.jsonl`` (one row per step, tools/train/loop.py) and the held-out
evaluation, draws loss, throughput, mixture (realized vs target), per-rank load, expert
load, the balancer's predicted gain and the ranks' measured speeds, and writes them with a
summary table to ``RUN_DIR/report/`` (or ``--out``), with links to the profiler's traces
when the run has any (``RUN_DIR/profile``). A field no row records skips its plot with a note
on the page; a missing or corrupt metrics file is a UserError naming the file and line.
"""

from __future__ import annotations

import os
from pathlib import Path

from omniscale.tools.report.balance_plot import plot_balancer
from omniscale.tools.report.inputs import (
    read_accounting,
    read_eval_results,
    read_metrics_rows,
    read_traces,
)
from omniscale.tools.report.page import render
from omniscale.tools.report.plots import PLOTS, Plot
from omniscale.tools.report.speeds_plot import plot_rank_speeds

FIGURES = (*PLOTS, ("balancer.png", plot_balancer),  # in the report's order
           ("rank_speeds.png", plot_rank_speeds))


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the report; returns the path of its ``index.html``."""
    run_dir = Path(run_dir)
    rows = read_metrics_rows(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    accounting = read_accounting(run_dir)
    plots = []
    for file_name, draw in FIGURES:
        (out / file_name).unlink(missing_ok=True)  # a plot skipped now must not show a stale PNG
        try:
            plots.append(draw(rows, out / file_name, accounting))
        except (TypeError, ValueError, KeyError, IndexError) as e:
            # Rows are data from disk: a shape no plot expects costs that plot, not the report.
            plots.append(Plot(file_name.removesuffix(".png").replace("_", " "), None,
                              [f"skipped: could not draw from these rows "
                               f"({type(e).__name__}: {e})"]))
    eval_results, eval_note = read_eval_results(run_dir)
    index = out / "index.html"
    # links relative to the page, so the run directory can move with its report
    traces = [Path(os.path.relpath(t, out)).as_posix() for t in read_traces(run_dir)]
    index.write_text(render(run_dir, rows, plots, eval_results, eval_note, traces),
                     encoding="utf-8")
    return index


def report_command(run_dir: str, out_dir: str | None) -> int:
    index = build_report(run_dir, out_dir)
    drawn = sum((index.parent / name).exists() for name, _ in FIGURES)
    print(f"wrote {index} ({drawn} of {len(FIGURES)} plots; open it in a browser)")
    return 0
