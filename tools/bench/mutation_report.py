"""The report of ``tools/bench/mutation.py``, apart from running mutants: which survivor a
reason belongs to, reasons carried over from an earlier report, crashes told from errors in
reports written before the runners did, the summary printed at the end, and the report an
``--update`` run keeps modules of."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from omniscale.tools.bench.mutation_table import KILLED_LATER


def reason_key(survivor: dict) -> tuple:
    """What identifies a survivor across runs and small edits elsewhere in the file."""
    return survivor["file"], survivor["operator"], survivor["diff"]


def load_reasons(path: Path) -> dict:
    """The reasons written in the report at ``path``, by :func:`reason_key`; not the "killed by
    <test>" ones: a run measures those again (a mutant the test did not kill after all
    survives without a reason, instead of being listed as killed)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    return {reason_key(s): s["reason"] for m in old.get("modules", {}).values()
            for s in m.get("survivors", ())
            if s.get("reason") and not s["reason"].startswith(KILLED_LATER)}


def _summarize(report: dict) -> None:
    for module, r in report["modules"].items():
        print(f"{module}: " + (r.get("error") or f"{r['killed']} killed, {r['survived']} "
              f"survived, {r['timed_out']} timed out of {r['sampled']} ({r['seconds']:.0f} s)"))


def _previous_for_update(args: argparse.Namespace) -> dict | None:
    """``--update``: the report in --out whose other modules are kept; its sample settings
    must be this run's."""
    if not args.update or not args.out.is_file():
        return None
    previous = json.loads(args.out.read_text())
    for key in ("seed", "max_mutants"):
        if previous.get(key) != getattr(args, key):
            raise SystemExit(f"--update: {args.out} has {key} {previous.get(key)}, this run "
                             f"{getattr(args, key)}; a table mixes no two samples")
    for result in previous.get("modules", {}).values():
        # a module kept from a report written before modules recorded their own commit was
        # measured at that report's
        for key in ("git_commit", "git_dirty"):
            result.setdefault(key, previous.get(key))
    return previous


# The last line of faulthandler's report of a fatal signal (pytest enables it): the extension
# modules loaded, "(total: N)"; the only part of it a report's output tail keeps.
_FATAL_SIGNAL = re.compile(r"\(total: \d+\)\s*$")


def reclassify_crashes(result: dict) -> dict:
    """A module's result with the error mutants whose run Python reported ending on a fatal
    signal (faulthandler's report) counted as crashed: for reports written before the runners
    told a crash from an error by the exit code."""
    crashed = [e for e in result.get("error_mutants", []) if _FATAL_SIGNAL.search(e["output"])]
    if not crashed:
        return result
    return {**result, "errors": result["errors"] - len(crashed),
            "crashed": result.get("crashed", 0) + len(crashed),
            "error_mutants": [e for e in result["error_mutants"] if e not in crashed],
            "crashed_mutants": result.get("crashed_mutants", []) + crashed}
