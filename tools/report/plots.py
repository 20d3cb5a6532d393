"""The report's figures, one PNG each, from the rows of ``metrics.jsonl``.

Every plot function takes the rows and the PNG path and returns a :class:`Plot`: drawn (with
notes on what it left out) or skipped (with the reason). Rows are read defensively -- a field
that is missing, null or of the wrong type in a row counts as "not recorded at that step" --
because one run's file can mix rows of different trainer versions (a resumed run).

Matplotlib is used through ``Figure`` (Agg canvas, no pyplot): no global backend switch and no
figure registry to leak from a long-lived process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omniscale.tools.report.inputs import is_number
from omniscale.tools.report.series import (
    binned_columns,
    dict_series,
    on_step_grid,
    padded,
    per_step_mean_ratio,
    quiet_nan,
    scalar_series,
    smoothed,
    vector_series,
)


@dataclass
class Plot:
    title: str
    file: str | None  # the PNG's name next to index.html; None when skipped
    notes: list[str] = field(default_factory=list)


# -- figures -----------------------------------------------------------------------------------
def _figure(panels: int, width: float = 10.0, height: float = 3.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * panels + 0.4), layout="constrained")
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    return fig, list(axes)


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def _integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))  # ranks, layers, experts: no rank 0.25


def _legend(ax, entries: int) -> None:
    if 0 < entries <= 16:  # past that a legend hides the plot and names nothing readable
        ax.legend(fontsize="small", loc="best")


def plot_loss(rows: list[dict], path: Path, accounting: str | None = None) -> Plot:
    plot = Plot("Loss", None)
    steps, loss = scalar_series(rows, "loss")
    src_steps, sources, src_loss = dict_series(rows, "source_loss")
    if not len(steps) and not sources:
        plot.notes.append("skipped: no row records `loss` or `source_loss`")
        return plot
    fig, axes = _figure(2 if (len(steps) and sources) else 1)
    if len(steps):
        ax = axes[0]
        ax.plot(steps, loss, color="C0", alpha=0.35, lw=0.8, label="per step")
        ax.plot(steps, smoothed(loss), color="C0", lw=1.8, label="smoothed")
        ax.set_title("training loss (token cross-entropy)")
        ax.set_ylabel("loss")
        _legend(ax, 2)
    else:
        plot.notes.append("total `loss` not recorded")
    if sources:
        ax = axes[-1]
        for i, name in enumerate(sources):
            ax.plot(src_steps, src_loss[:, i], color=f"C{i % 10}", alpha=0.25, lw=0.7)
            ax.plot(src_steps, smoothed(src_loss[:, i]), color=f"C{i % 10}", lw=1.5,
                    label=name)
        ax.set_title("loss per source (mean over its tokens in the step; bold: smoothed)")
        ax.set_ylabel("loss")
        _legend(ax, len(sources))
    else:
        plot.notes.append("per-source loss not recorded (rows have no `source_loss`)")
    axes[-1].set_xlabel("step")
    _save(fig, path)
    plot.file = path.name
    return plot


def plot_throughput(rows: list[dict], path: Path, accounting: str | None = None) -> Plot:
    plot = Plot("Throughput", None)
    tokens = scalar_series(rows, "tokens_per_s")
    times = {key: scalar_series(rows, key) for key in
             ("step_s", "measured_step_s", "predicted_step_s")}
    wait = scalar_series(rows, "data_wait_frac")
    panels = [name for name, present in (("tokens", len(tokens[0])),
                                         ("times", any(len(s) for s, _ in times.values())),
                                         ("wait", len(wait[0]))) if present]
    for name, field_name in (("tokens", "tokens_per_s"), ("times", "step_s"),
                             ("wait", "data_wait_frac")):
        if name not in panels:
            plot.notes.append(f"`{field_name}` not recorded")
    if not panels:
        plot.notes.insert(0, "skipped: no throughput fields recorded")
        return plot
    fig, axes = _figure(len(panels), height=2.6)
    for ax, name in zip(axes, panels):
        if name == "tokens":
            ax.plot(*tokens, color="C2", alpha=0.35, lw=0.8)
            ax.plot(tokens[0], smoothed(tokens[1]), color="C2", lw=1.8)
            ax.set_title("tokens/s (all ranks; bold: smoothed)")
            ax.set_ylabel("tokens/s")
        elif name == "times":
            styles = {"step_s": ("step (compute + data wait)", "-"),
                      "measured_step_s": ("slowest rank's compute", "-"),
                      "predicted_step_s": ("predicted from the plan's cost", "--")}
            for i, (key, (label, style)) in enumerate(styles.items()):
                if len(times[key][0]):
                    ax.plot(*times[key], style, color=f"C{i + 3}", lw=1.0, label=label)
            ax.set_title("seconds per step")
            ax.set_ylabel("s")
            _legend(ax, 3)
        else:
            ax.plot(*wait, color="C1", lw=1.0)
            ax.set_ylim(bottom=0)
            ax.set_title("fraction of the step spent waiting for data (slowest rank)")
            ax.set_ylabel("fraction")
    axes[-1].set_xlabel("step")
    _save(fig, path)
    plot.file = path.name
    return plot


def plot_mixture(rows: list[dict], path: Path, accounting: str | None = None) -> Plot:
    """Realized share per source against the schedule's (normalised) weights, counted in the
    spec's unit (``accounting``): per step, and cumulative -- the cumulative target is the
    mean of the per-step targets weighted by each step's total, so a schedule that changes
    over the run is compared like for like."""
    plot = Plot("Mixture: realized vs target", None)
    key, unit = "mix_tokens", "token"
    if accounting == "samples":
        if any(isinstance(r.get("mix_samples"), dict) and r["mix_samples"] for r in rows):
            key, unit = "mix_samples", "sample"
        else:
            plot.notes.append("the spec's weights count samples but rows have no "
                              "`mix_samples`: token shares shown, which differ from the "
                              "weights by each source's mean length")
    elif accounting is None:
        plot.notes.append("the spec's accounting is unknown (no readable config.yaml and "
                          "spec): token shares shown")
    steps, names, drawn = dict_series(rows, key)
    if not names:
        plot.notes = [f"skipped: rows have no `{key}` ({unit}s per source per step)"]
        return plot
    drawn = np.nan_to_num(drawn)  # a source absent from a step drew nothing there
    mixed_rows = [r for r in rows if isinstance(r.get(key), dict) and r[key]]
    # A source the schedule wanted but that never drew anything is the one to see: keep it.
    for row in mixed_rows:
        weights = row.get("mix_target")
        for name in (weights if isinstance(weights, dict) else ()):
            if str(name) not in names:
                names.append(str(name))
                drawn = np.concatenate([drawn, np.zeros((len(drawn), 1))], axis=1)
    target = np.full(drawn.shape, np.nan)  # the same rows, in the same order, as dict_series
    for i, row in enumerate(mixed_rows):
        weights = row.get("mix_target")
        if isinstance(weights, dict):
            for j, name in enumerate(names):
                weight = weights.get(name)
                if is_number(weight):
                    target[i, j] = weight
    with quiet_nan():
        total = drawn.sum(axis=1)
        share = drawn / np.where(total > 0, total, np.nan)[:, None]
        target_share = target / np.nansum(target, axis=1, keepdims=True)
        has_target = np.isfinite(target_share).any(axis=1)
        cumulative = np.cumsum(drawn, axis=0) / np.cumsum(total)[:, None]
        weighted_target = np.nan_to_num(target_share) * total[:, None]
        target_total = np.cumsum(np.where(has_target, total, 0))
        cumulative_target = np.cumsum(weighted_target, axis=0) / \
            np.where(target_total > 0, target_total, np.nan)[:, None]
    if not has_target.any():
        plot.notes.append("no `mix_target` recorded: realized shares only")
    fig, axes = _figure(2)
    for j, name in enumerate(names):
        color = f"C{j % 10}"
        axes[0].plot(steps, cumulative[:, j], color=color, lw=1.6, label=name)
        axes[1].plot(steps, share[:, j], color=color, lw=0.8, alpha=0.6, label=name)
        if has_target.any():
            axes[0].plot(steps, cumulative_target[:, j], "--", color=color, lw=1.2)
            axes[1].plot(steps, target_share[:, j], "--", color=color, lw=1.4)
    axes[0].set_title(f"cumulative {unit} share per source (solid) vs target (dashed)")
    axes[1].set_title(f"per step: realized {unit} share (thin) vs schedule weight, normalised "
                      "(dashed)")
    for ax in axes:
        ax.set_ylabel("share")
        ax.set_ylim(0, max(1e-3, float(np.nanmax(np.r_[share.ravel(), target_share.ravel(),
                                                           0.0]))) * 1.08)
    _legend(axes[0], len(names))
    axes[-1].set_xlabel("step")
    _save(fig, path)
    final = ", ".join(
        f"{name} {cumulative[-1, j]:.3f}" + (f" (target {cumulative_target[-1, j]:.3f})"
                                             if np.isfinite(cumulative_target[-1, j]) else "")
        for j, name in enumerate(names))
    plot.notes.append(f"final cumulative {unit} share: {final}")
    plot.file = path.name
    return plot


def _heatmap(fig, ax, steps: np.ndarray, matrix: np.ndarray, title: str, ylabel: str,
             colorbar: str) -> None:
    steps, matrix, size = binned_columns(*on_step_grid(steps, matrix))
    extent = (steps[0] - 0.5 * size, steps[-1] + 0.5 * size, matrix.shape[1] - 0.5, -0.5)
    image = ax.imshow(matrix.T, aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=extent)
    fig.colorbar(image, ax=ax, label=colorbar)
    _integer_ticks(ax.yaxis)
    ax.set_title(title + (f" (bins of {size} steps)" if size > 1 else ""))
    ax.set_ylabel(ylabel)


def plot_rank_load(rows: list[dict], path: Path, accounting: str | None = None) -> Plot:
    plot = Plot("Per-rank load", None)
    measured = vector_series(rows, "rank_compute_s")
    predicted = vector_series(rows, "rank_predicted_cost")
    lines = {key: scalar_series(rows, key) for key in ("imbalance_measured",
                                                       "imbalance_predicted")}
    for key, series in (("rank_compute_s", measured), ("rank_predicted_cost", predicted)):
        if not len(series[0]):
            plot.notes.append(f"`{key}` not recorded")
    for key, (s, v) in lines.items():
        source = measured if key.endswith("measured") else predicted
        if not len(s) and len(source[0]):  # older rows: derive max/mean from the lists
            with quiet_nan():
                ratio = np.nanmax(source[1], axis=1) / np.nanmean(source[1], axis=1)
            lines[key] = (source[0], ratio)
    heatmaps = [(label, series) for label, series in
                (("compute seconds", measured), ("predicted cost", predicted)) if len(series[0])]
    has_lines = any(len(s) for s, _ in lines.values())
    if not heatmaps and not has_lines:
        plot.notes.insert(0, "skipped: no per-rank load fields recorded")
        return plot
    fig, axes = _figure(len(heatmaps) + has_lines, height=2.8)
    for ax, (label, (steps, matrix)) in zip(axes, heatmaps):
        _heatmap(fig, ax, steps, per_step_mean_ratio(matrix),
                 f"per-rank {label} ÷ the step's mean", "rank", "÷ step mean")
    if has_lines:
        ax = axes[-1]
        for i, (key, (s, v)) in enumerate(lines.items()):
            if len(s):
                ax.plot(s, v, "-" if key.endswith("measured") else "--", color=f"C{i}",
                        lw=1.0, label=key.replace("_", " ") + " (max / mean)")
        ax.axhline(1.0, color="0.6", lw=0.6)
        if heatmaps:
            ax.set_xlim(axes[0].get_xlim())  # the same steps under each other
        ax.set_title("imbalance: slowest rank over the mean")
        ax.set_ylabel("max / mean")
        _legend(ax, 2)
    axes[-1].set_xlabel("step")
    _save(fig, path)
    plot.file = path.name
    return plot


def plot_expert_load(rows: list[dict], path: Path, accounting: str | None = None) -> Plot:
    plot = Plot("Expert load", None)
    load_rows = [r for r in rows if isinstance(r.get("expert_load"), list) and r["expert_load"]]
    ratio_steps, ratios = vector_series(rows, "expert_load_max_over_mean")
    total = _summed_expert_load(load_rows)
    if not len(ratio_steps) and total is not None:  # older rows: derive it from the counts
        ratio_steps = np.asarray([r["step"] for r in load_rows], dtype=float)
        ratios = padded([list(_max_over_mean(_layer_matrix(r["expert_load"])))
                         for r in load_rows])
    if not len(ratio_steps) and total is None:
        plot.notes.append("skipped: rows have no `expert_load` or `expert_load_max_over_mean` "
                          "(dense model, or an older run)")
        return plot
    panels = (len(ratio_steps) > 0) + (total is not None)
    fig, axes = _figure(panels, height=3.0)
    if len(ratio_steps):
        ax = axes[0]
        for layer in range(ratios.shape[1]):
            ax.plot(ratio_steps, ratios[:, layer], lw=0.9, color=f"C{layer % 10}",
                    label=f"MoE layer {layer}")
        ax.axhline(1.0, color="0.6", lw=0.6)
        ax.set_title("busiest expert's tokens over the layer's mean, per step")
        ax.set_ylabel("max / mean")
        ax.set_xlabel("step")
        _legend(ax, ratios.shape[1])
    else:
        plot.notes.append("`expert_load_max_over_mean` not recorded")
    if total is not None:
        ax = axes[-1]
        relative = per_step_mean_ratio(total)
        image = ax.imshow(relative, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(image, ax=ax, label="÷ layer mean")
        _integer_ticks(ax.xaxis)
        _integer_ticks(ax.yaxis)
        ax.set_title(f"tokens per expert summed over {len(load_rows)} steps, ÷ the layer's mean")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
    else:
        plot.notes.append("`expert_load` (token counts per expert) not recorded")
    _save(fig, path)
    plot.file = path.name
    return plot


def _layer_matrix(layers: list) -> np.ndarray:
    """A row's ``expert_load`` (list per layer of counts) as layers × experts, NaN-padded."""
    return padded([layer if isinstance(layer, list) else [] for layer in layers])


def _max_over_mean(matrix: np.ndarray) -> np.ndarray:
    with quiet_nan():
        return np.nanmax(per_step_mean_ratio(matrix), axis=1) if matrix.size else np.empty(0)


def _summed_expert_load(load_rows: list[dict]) -> np.ndarray | None:
    """Counts summed over the rows, layers × experts; None when there are none to sum."""
    matrices = [_layer_matrix(r["expert_load"]) for r in load_rows]
    matrices = [m for m in matrices if m.size]
    if not matrices:
        return None
    shape = tuple(max(m.shape[k] for m in matrices) for k in (0, 1))
    total = np.zeros(shape)
    for m in matrices:
        total[:m.shape[0], :m.shape[1]] += np.nan_to_num(m)
    return total


# Order of the report's sections, and each figure's file name.
def plot_eval(rows: list[dict], path: Path, accounting: str | None = None) -> Plot:
    """The held-out figures the trainer logged during training (``eval.every``: a row's
    ``eval``, ``source/metric``): accuracy per source (omni, lm) or velocity loss (video_gen)."""
    plot = Plot("Held-out evaluation during training", None)
    for metric, label in (("accuracy", "teacher-forced token accuracy"),
                          ("loss", "velocity loss")):
        series: dict[str, list[tuple[int, float]]] = {}
        for row in rows:
            for key, value in (row.get("eval") or {}).items():
                source, _, name = key.rpartition("/")
                if name == metric and is_number(value) and is_number(row.get("step")):
                    series.setdefault(source, []).append((int(row["step"]) + 1, float(value)))
        if series:
            break
    if not series:
        plot.notes.append("skipped: no row records `eval` (set eval.every to evaluate during "
                          "training)")
        return plot
    fig, (ax,) = _figure(1)
    for i, (source, points) in enumerate(sorted(series.items())):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o", color=f"C{i % 10}", label=source)
    ax.set_title(f"held-out {label} after N steps")
    ax.set_ylabel(metric)
    ax.set_xlabel("steps trained")
    _integer_ticks(ax.xaxis)
    _legend(ax, len(series))
    _save(fig, path)
    plot.file = path.name
    return plot


PLOTS = (("loss.png", plot_loss), ("throughput.png", plot_throughput),
         ("mixture.png", plot_mixture), ("rank_load.png", plot_rank_load),
         ("expert_load.png", plot_expert_load), ("eval.png", plot_eval))
