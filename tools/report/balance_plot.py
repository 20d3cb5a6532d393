"""The balancer at work on this run: each step's predicted step cost (the costliest rank) under
the run's plans, beside what the best baseline would have predicted for the same global batch
(the plane plans it on the side, ``dataplane.windows.best_baseline``), and the gain so far."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omniscale.tools.report.plots import Plot, _figure, _legend, _save
from omniscale.tools.report.series import scalar_series

OURS, BASELINE = "predicted_step_cost", "baseline_predicted_step_cost"


def predicted_gain(rows: list[dict]) -> float | None:
    """Σ the best baseline's predicted step costs over Σ ours, over the steps with both."""
    pairs = [(r[OURS], r[BASELINE]) for r in rows
             if isinstance(r.get(OURS), (int, float)) and isinstance(r.get(BASELINE), (int, float))]
    ours = sum(o for o, _ in pairs)
    return sum(b for _, b in pairs) / ours if pairs and ours > 0 else None


def plot_balancer(rows: list[dict], path: Path, accounting: str | None = None) -> Plot:
    plot = Plot("Balancer: predicted step cost against the best baseline", None)
    ours, base = scalar_series(rows, OURS), scalar_series(rows, BASELINE)
    if not len(ours[0]) or not len(base[0]):
        plot.notes.append("skipped: no baseline prediction recorded (the run's plans came "
                          "from a baseline, or an older plane)")
        return plot
    fig, (top, bottom) = _figure(2, height=2.8)
    top.plot(*ours, "-", lw=1.0, color="C0", label="ours (the plans trained)")
    top.plot(*base, "--", lw=1.0, color="C1", label="best baseline, same global batch")
    top.set_title("predicted step cost (costliest rank)")
    top.set_ylabel("cost")
    _legend(top, 2)
    common = np.intersect1d(ours[0], base[0])
    o = ours[1][np.isin(ours[0], common)]
    b = base[1][np.isin(base[0], common)]
    with np.errstate(divide="ignore", invalid="ignore"):
        bottom.plot(common, np.cumsum(b) / np.cumsum(o), "-", lw=1.0, color="C2")
    bottom.axhline(1.0, color="0.6", lw=0.6)
    bottom.set_title("predicted gain so far: Σ best baseline ÷ Σ ours")
    bottom.set_ylabel("×")
    bottom.set_xlabel("step")
    _save(fig, path)
    plot.file = path.name
    gain = predicted_gain(rows)
    if gain is not None:
        plot.notes.append(f"over the run: {gain:.3f}× predicted (a plan's window may move "
                          "samples between its steps, so single steps compare loosely)")
    return plot
