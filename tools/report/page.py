"""``index.html`` of a report: a summary table, the evaluation if there is one, the profiler's
traces if any, then each figure with its notes (or why it was skipped). Self-contained: no
scripts, no external styles, so it opens from a file system or any static file server."""

from __future__ import annotations

import html
import math
from pathlib import Path
from urllib.parse import quote

from omniscale.tools.report.balance_plot import predicted_gain
from omniscale.tools.report.inputs import is_number
from omniscale.tools.report.plots import Plot

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 960px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.7em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #666; font-size: 0.9em; margin: 0.2em 0; }
.skipped { color: #a60; }
"""


def format_value(value) -> str:
    """Numbers for people: thousands separators, four significant digits for fractions."""
    if isinstance(value, bool) or not is_number(value):
        return "-" if value is None else str(value)
    if not math.isfinite(value):
        return str(value)
    if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
        return f"{int(value):,}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def summary_rows(rows: list[dict]) -> list[tuple[str, str]]:
    """(label, value) pairs for the run's summary; a quantity no row records is left out."""
    def numbers(key: str) -> list[float]:
        return [r[key] for r in rows if is_number(r.get(key)) and math.isfinite(r[key])]

    first, last = rows[0]["step"], rows[-1]["step"]
    out = [("steps recorded",
            f"{len(rows):,} (steps {format_value(first)}–{format_value(last)})")]
    losses = [r for r in rows if is_number(r.get("loss"))]
    if losses:
        out.append(("final loss", f"{format_value(losses[-1]['loss'])} "
                                  f"(step {format_value(losses[-1]['step'])})"))
    if tokens_per_s := numbers("tokens_per_s"):
        out.append(("mean tokens/s", format_value(sum(tokens_per_s) / len(tokens_per_s))))
    if tokens := numbers("tokens"):
        out.append(("tokens trained", format_value(int(sum(tokens)))))
    if step_s := numbers("step_s"):
        out.append(("time in steps", f"{sum(step_s):,.1f} s"))
    if imbalance := numbers("imbalance_measured"):
        clocks = {r.get("compute_clock") for r in rows} - {None}
        how = " of compute time" if clocks == {"cpu"} else ""
        out.append((f"mean measured imbalance{how} (max/mean)",
                    format_value(sum(imbalance) / len(imbalance))))
    if (gain := predicted_gain(rows)) is not None:
        out.append(("predicted gain over the best baseline (Σ step cost)", f"{gain:.3f}×"))
    if policies := list(dict.fromkeys(r["balance"] for r in rows if r.get("balance"))):
        out.append(("placement policy (data.balance)", ", ".join(policies)))
    return out


def _table(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n"
                   for row in body)
    return f"<table><tr>{head}</tr>\n{rows}</table>"


def eval_table(results: dict) -> str:
    """One row per evaluated source, one column per reported quantity (whatever the evaluator
    wrote, in its order), so a new metric shows without a change here."""
    columns: list[str] = []
    for value in results.values():
        if isinstance(value, dict):
            columns += [k for k in value if k not in columns]
    body = []
    for source, value in results.items():
        if isinstance(value, dict):
            body.append([str(source)] + [format_value(value.get(c)) for c in columns])
        else:
            body.append([str(source), format_value(value)] + ["-"] * max(0, len(columns) - 1))
    return _table(["source"] + (columns or ["value"]), body)


def traces_section(traces: list[str]) -> list[str]:
    """Links to the profiler's traces (``traces``: paths relative to the page)."""
    items = "".join(f"<li><a href='{html.escape(quote(t))}'>{html.escape(t)}</a></li>"
                    for t in traces)
    return ["<h2>Profiler traces</h2>",
            "<p class='note'>torch.profiler over <code>profile.steps</code>, one Chrome trace "
            "per rank: open one in <a href='https://ui.perfetto.dev'>ui.perfetto.dev</a> "
            "(Open trace file) or chrome://tracing (Load).</p>",
            f"<ul>{items}</ul>"]


def render(run_dir: Path, rows: list[dict], plots: list[Plot], eval_results: dict | None,
           eval_note: str, traces: list[str] | None = None) -> str:
    title = f"OmniScale run report: {run_dir.name or run_dir}"
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}"
             f"</title><style>{STYLE}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p class='note'>{html.escape(str(run_dir.resolve()))}</p>",
             "<h2>Summary</h2>",
             _table(["quantity", "value"], [list(r) for r in summary_rows(rows)]),
             "<h2>Held-out evaluation</h2>"]
    if eval_results:
        parts += [f"<p class='note'>from {html.escape(eval_note)}</p>", eval_table(eval_results)]
    else:
        parts.append(f"<p class='note skipped'>Not shown: {html.escape(eval_note)}.</p>")
    if traces:
        parts += traces_section(traces)
    for plot in plots:
        parts.append(f"<h2>{html.escape(plot.title)}</h2>")
        if plot.file:
            parts.append(f"<img src='{html.escape(plot.file)}' alt='{html.escape(plot.title)}'>")
        for note in plot.notes:
            cls = "note" if plot.file else "note skipped"
            parts.append(f"<p class='{cls}'>{html.escape(note)}</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
