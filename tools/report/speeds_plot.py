"""Uneven ranks on this run: each data rank's measured speed, its share of the predicted work
and the step time, with the steps the plane was told new speeds from (``rank_speed``,
``rank_predicted_cost``, ``step_s``, ``rank_speeds_sent``: ``tools.train.rank_speeds``). A rank
that slows shows its speed falling, then its share, then the step time coming back."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omniscale.tools.report.plots import Plot, _figure, _integer_ticks, _legend, _save
from omniscale.tools.report.series import quiet_nan, scalar_series, vector_series


def speed_changes(rows: list[dict]) -> list[tuple[int, int, list[float]]]:
    """(measured after step, applies from step, relative speeds; [] for equal) of every change
    the plane was told."""
    return [(r["step"], r["rank_speeds_sent"]["applies_at_step"],
             list(r["rank_speeds_sent"]["speeds"])) for r in rows
            if isinstance(r.get("rank_speeds_sent"), dict)]


def plot_rank_speeds(rows: list[dict], path: Path, accounting: str | None = None) -> Plot:
    plot = Plot("Rank speeds: work follows each rank's measured speed", None)
    speed_steps, speed = vector_series(rows, "rank_speed")
    cost_steps, cost = vector_series(rows, "rank_predicted_cost")
    if not len(speed_steps) or cost.shape[1] < 2:
        plot.notes.append("skipped: no rank speeds recorded (one data rank, or a run before "
                          "they were measured)")
        return plot
    changes = speed_changes(rows)
    fig, (top, middle, bottom) = _figure(3, height=2.4)
    with quiet_nan():
        share = cost / np.nansum(cost, axis=1, keepdims=True)
    ranks = speed.shape[1]
    for rank in range(ranks):
        color = f"C{rank % 10}"
        top.plot(speed_steps, speed[:, rank], "-", lw=1.0, color=color, label=f"rank {rank}")
        middle.plot(cost_steps, share[:, rank], "-", lw=1.0, color=color)
    middle.axhline(1 / cost.shape[1], color="0.6", lw=0.6)
    bottom.plot(*scalar_series(rows, "step_s"), "-", lw=1.0, color="0.2")
    for _, applies, _ in changes:
        for ax in (top, middle, bottom):
            ax.axvline(applies, color="C3", lw=0.6, ls=":")
    top.set_title("measured speed, relative to the fastest (dotted: planned with new speeds "
                  "from)")
    top.set_ylabel("speed")
    _legend(top, ranks)
    middle.set_title("share of the step's predicted work")
    middle.set_ylabel("share")
    bottom.set_title("step time")
    bottom.set_ylabel("s")
    bottom.set_xlabel("step")
    for ax in (top, middle, bottom):
        _integer_ticks(ax.xaxis)
    _save(fig, path)
    plot.file = path.name
    for after, applies, speeds in changes:
        told = ", ".join(f"{v:.2f}" for v in speeds) if speeds else "equal"
        plot.notes.append(f"measured after step {after}, planned from step {applies}: {told}")
    if not changes:
        plot.notes.append("the plane was told no speeds (ranks within 10% of each other, "
                          "deterministic mode, or data.plan_by_rank_speed off)")
    return plot
