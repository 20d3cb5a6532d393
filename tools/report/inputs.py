"""Reading a run directory for the report.

``metrics.jsonl`` is required and read strictly: a report drawn from half a file would look
plausible and be wrong, so a corrupt line is an error naming the file and the line (the
trainer's own ``read_metrics`` has no line numbers to give). Every *field* of a row is
optional, though: older runs and other tasks record fewer, and the plots skip what is absent.

The held-out evaluation is optional and read leniently: ``eval.json`` (results per source) if
present, else the ``eval`` entry of the ``result.json`` that ``omniscale train`` writes.

The profiler's traces (``RUN_DIR/profile``) are only listed, with links: a browser's trace
viewer opens them, the report does not read them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from omniscale.errors import UserError

METRICS_FILE = "metrics.jsonl"


def is_number(value) -> bool:
    """A JSON number (bool is an int in Python but never a metric)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics_rows(run_dir: Path) -> list[dict]:
    """Rows of ``RUN_DIR/metrics.jsonl`` in step order; raises UserError on bad input."""
    if not run_dir.exists():
        raise UserError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a directory (expected a run directory)")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{path}: not found (rank 0 of `omniscale train` writes it, "
                        "one row per step)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{number}: not valid JSON ({e.msg}, column {e.colno})") \
                from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{number}: expected a JSON object per line, "
                            f"got {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: empty (no steps recorded yet)")
    # A row without a usable step still counts: it takes the position after the previous one.
    previous = -1.0
    for row in rows:
        step = row.get("step")
        if not is_number(step) or not math.isfinite(step):
            row["step"] = previous + 1
        previous = row["step"]
    rows.sort(key=lambda r: r["step"])  # stable: a file appended out of order still plots
    return rows


def read_eval_results(run_dir: Path) -> tuple[dict | None, str]:
    """(results per source, or None; where they came from, or why there are none)."""
    for name, key in (("eval.json", None), ("result.json", "eval")):
        path = run_dir / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return None, f"{path.name} is not valid JSON ({e}); no evaluation shown"
        if isinstance(data, dict) and key is None and isinstance(data.get("eval"), dict):
            key = "eval"  # eval.json may wrap its results the way result.json does
        results = data.get(key) if key and isinstance(data, dict) else data
        if isinstance(results, dict) and results:
            return results, path.name
        return None, f"{path.name} holds no evaluation results (evaluation off, or no eval spec)"
    return None, "no eval.json or result.json in the run directory"


def read_accounting(run_dir: Path) -> str | None:
    """``samples`` or ``tokens``: what the run's mixing spec counts its weights in (its config
    names the spec), so realized shares are compared in the same unit; None when unknown."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        spec = yaml.safe_load(Path(config["data"]["spec"]).read_text(encoding="utf-8"))
    except (OSError, KeyError, TypeError, UnicodeDecodeError, yaml.YAMLError):
        return None
    accounting = spec.get("accounting", "tokens") if isinstance(spec, dict) else None
    return accounting if accounting in ("samples", "tokens") else None


def read_traces(run_dir: Path) -> list[Path]:
    """The profiler's Chrome traces (``profile.steps``: ``RUN_DIR/profile``), by name."""
    folder = run_dir / "profile"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and p.name.endswith((".json", ".json.gz")))
