"""``omniscale data inspect SPEC``: what a mixing spec will draw, before a run spends GPUs on it.

Reads only the sources' indexes (never a payload) and prints, per source, the sample and token
counts and the shape of the length distribution (its tail drives packing and balance), then
the schedule's weights at a few points together with the share they imply in the other unit:
a 50/50 *sample* mix of captions and long documents is mostly documents in *tokens*.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.table import Table

from omniscale.dataplane.schedule import Schedule
from omniscale.dataplane.spec import MixSpec, load_spec
from omniscale.index_schema import read_index

COLUMNS = ["text_tokens", "image_patches", "video_patches", "audio_frames", "llm_tokens",
           "error"]
PERCENTILES = (50, 90, 99)


def inspect_spec(spec_path: Path, plot: Path | None = None, steps: list[float] | None = None,
                 console: Console | None = None) -> dict:
    """Print the spec's per-source statistics and schedule; return the printed numbers.

    Raises the loader's UserError when the spec is invalid or a source has no index yet.
    """
    # Piped output (CI logs, files) would be cut at 80 columns; give it room.
    console = console or Console(width=None if sys.stdout.isatty() else 132)
    spec = load_spec(spec_path)
    indexes = {s.name: read_index(s.index, columns=COLUMNS) for s in spec.sources}
    stats = {name: source_stats(index) for name, index in indexes.items()}
    for src in spec.sources:
        stats[src.name].update(format=src.format, template=src.template)
    xs = [float(x) for x in steps] if steps else default_points(spec.schedule)
    weights = spec.schedule.weights_over(np.array(xs))
    means = np.array([stats[n]["mean_llm_tokens"] for n in spec.source_names])
    token_share, sample_share = implied_shares(weights, means, spec.accounting)

    for table in _sources_tables(spec, stats):
        console.print(table)
    console.print(_weights_table(spec, xs, weights, token_share, sample_share))
    result = {
        "spec": str(spec_path), "accounting": spec.accounting, "unit": spec.schedule.unit,
        "sources": stats, "points": xs,
        "weights": [_named(spec, row) for row in weights],
        "token_share": [_named(spec, row) for row in token_share],
        "sample_share": [_named(spec, row) for row in sample_share],
        "plot": None,
    }
    if plot is not None:
        lengths = {name: _good_lengths(index) for name, index in indexes.items()}
        write_plot(Path(plot), spec, lengths, xs)
        console.print(f"wrote {plot}")
        result["plot"] = str(plot)
    return result


def source_stats(index: pa.Table) -> dict:
    """Counts and llm_tokens percentiles of one source's index, corrupt rows excluded.

    Percentiles are actual sample lengths (inverted CDF), so ``p99`` is a length some sample
    really has.
    """
    good = index.filter(pc.is_null(index["error"]))
    lengths = _good_lengths(good)
    stats = {
        "samples": good.num_rows,
        "corrupt": index.num_rows - good.num_rows,
        "llm_tokens": int(lengths.sum()),
        "text_tokens": int(pc.sum(good["text_tokens"]).as_py() or 0),
        "images": _items(good["image_patches"]),
        "videos": _items(good["video_patches"]),
        "audios": _items(good["audio_frames"]),
        "mean_llm_tokens": float(lengths.mean()) if len(lengths) else 0.0,
        "max": int(lengths.max()) if len(lengths) else 0,
    }
    qs = (np.percentile(lengths, PERCENTILES, method="inverted_cdf") if len(lengths)
          else [0] * len(PERCENTILES))
    stats.update({f"p{p}": int(q) for p, q in zip(PERCENTILES, qs)})
    return stats


def default_points(schedule: Schedule) -> list[float]:
    """Where to show the weights: every segment's start, midpoint and step, and past the end."""
    points: set[float] = set()
    for seg in schedule.segments:
        points.add(float(seg.start))
        if seg.end is not None:
            points.add((seg.start + seg.end) / 2)
        if seg.at is not None:
            points.add(float(seg.at))
    points.add(horizon(schedule))
    return sorted(points)


def horizon(schedule: Schedule) -> float:
    """A point past every change in the schedule: its end, or a bit beyond the last change."""
    if schedule.end is not None:
        return float(schedule.end)
    last = schedule.segments[-1]
    change = max(last.start, last.at if last.at is not None else 0.0)
    return float(max(change * 1.25, change + 1.0))


def implied_shares(weights_XN: np.ndarray, mean_tokens_N: np.ndarray,
                   accounting: str) -> tuple[np.ndarray, np.ndarray]:
    """(token share, sample share) per point and source, given weights in ``accounting``.

    A source with no good samples can be drawn in neither unit, so it gets share 0.
    """
    drawable_N = mean_tokens_N > 0
    if accounting == "samples":
        sample_XN = weights_XN
        token_XN = weights_XN * mean_tokens_N
    else:
        token_XN = weights_XN
        sample_XN = np.where(drawable_N, weights_XN / np.where(drawable_N, mean_tokens_N, 1), 0)
    return _rows_normalised(token_XN * drawable_N), _rows_normalised(sample_XN * drawable_N)


def write_plot(path: Path, spec: MixSpec, lengths: dict[str, np.ndarray],
               points: list[float]) -> None:
    """Length histograms (log-x, so long tails show) over the schedule as a stacked area."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry

    names = list(spec.source_names)
    cols = min(len(names), 3)
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(4.2 * cols, 2.6 * rows + 3.2), layout="constrained")
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[1] * rows + [1.3])
    for i, name in enumerate(names):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        _histogram(ax, name, lengths[name], color=f"C{i}")  # the stack's colour for it
    ax = fig.add_subplot(grid[rows, :])
    sched = spec.schedule
    end = max([horizon(sched)] + points)
    xs = np.unique(np.concatenate([np.linspace(0, end, 600), sched.boundaries,
                                   [s.at for s in sched.segments if s.at is not None]]))
    ax.stackplot(xs, sched.weights_over(xs).T, labels=names, alpha=0.85)
    ax.set_xlim(0, end)
    ax.set_ylim(0, 1)
    ax.set_xlabel(sched.unit)
    ax.set_ylabel(f"weight ({spec.accounting})")
    ax.set_title("schedule")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _histogram(ax, name: str, lengths: np.ndarray, color: str) -> None:
    from matplotlib.ticker import NullFormatter

    ax.set_title(name, fontsize="medium")
    ax.set_xlabel("llm_tokens")
    if len(lengths) == 0:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    lo, hi = max(int(lengths.min()), 1), max(int(lengths.max()), 1)
    bins = np.geomspace(lo, hi * 1.05 if hi > lo else lo * 2, 40)
    ax.hist(np.maximum(lengths, 1), bins=bins, color=color)
    ax.set_xscale("log")
    # Narrow ranges get labelled minor ticks that overprint each other; majors suffice.
    ax.xaxis.set_minor_formatter(NullFormatter())


def _sources_tables(spec: MixSpec, stats: dict) -> tuple[Table, Table]:
    """Counts, and the length distribution: two tables so each fits an 80-column terminal."""
    counts = Table(title=f"{spec.path}: sources (corrupt rows excluded from everything else)",
                   caption="img / vid / aud: media items")
    lengths = Table(title="llm_tokens per sample")
    for col in ("source", "format", "template", "samples", "corrupt", "img", "vid", "aud"):
        counts.add_column(col, justify="left" if col in ("source", "format", "template")
                          else "right", no_wrap=True)
    for col in ("source", "llm_tokens", "text_tokens", "mean", "p50", "p90", "p99", "max"):
        lengths.add_column(col, justify="left" if col == "source" else "right")
    for name in spec.source_names:
        s = stats[name]
        counts.add_row(name, s["format"], s["template"], *(f"{s[k]:,}" for k in (
            "samples", "corrupt", "images", "videos", "audios")))
        lengths.add_row(name, f"{s['llm_tokens']:,}", f"{s['text_tokens']:,}",
                        f"{s['mean_llm_tokens']:,.1f}",
                        *(f"{s[k]:,}" for k in ("p50", "p90", "p99", "max")))
    return counts, lengths


def _weights_table(spec: MixSpec, xs: list[float], weights: np.ndarray,
                   token_share: np.ndarray, sample_share: np.ndarray) -> Table:
    other, other_share = (("token", token_share) if spec.accounting == "samples"
                          else ("sample", sample_share))
    table = Table(title=f"schedule: weights ({spec.accounting}) -> implied {other} share")
    table.add_column(spec.schedule.unit, justify="right")
    for name in spec.source_names:
        table.add_column(name, justify="right")
    for x, w_N, o_N in zip(xs, weights, other_share):
        table.add_row(_fmt_x(x), *(f"{w:.3f} -> {o:.3f}" for w, o in zip(w_N, o_N)))
    return table


def _good_lengths(index: pa.Table) -> np.ndarray:
    good = index.filter(pc.is_null(index["error"]))
    # A good row always has a length; fill_null keeps a malformed index from becoming NaN.
    return pc.fill_null(good["llm_tokens"], 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _items(column: pa.ChunkedArray) -> int:
    return int(pc.sum(pc.list_value_length(column)).as_py() or 0)


def _rows_normalised(a_XN: np.ndarray) -> np.ndarray:
    total_X = a_XN.sum(axis=1, keepdims=True)
    return np.divide(a_XN, total_X, out=np.zeros_like(a_XN, dtype=np.float64),
                     where=total_X > 0)


def _named(spec: MixSpec, row: np.ndarray) -> dict[str, float]:
    return {name: float(v) for name, v in zip(spec.source_names, row)}


def _fmt_x(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}"
