"""``omniscale bench all``: every benchmark under tools/bench, one subprocess each, collected.

    omniscale bench all [--quick] [--only balance,plane] [--out bench-results.json]

Each bench runs as its own process (as its docstring says to run it), so one that crashes or
leaks memory cannot take the others down, and writes its JSON to a scratch file. This collects
every JSON under ``benches.<name>.result`` of ``--out`` and writes a Markdown table of each
bench's headline numbers beside it (``bench-results.md``). Which numbers are headlines is
written down once, in :data:`BENCHES`: a JSON path per column, so a bench's JSON keys and the
table cannot drift apart unnoticed (tests/tools/test_bench_all.py reads the committed JSON in
docs/bench through it).

``--write-docs`` runs each bench at the sizes its committed JSON is measured at
(``Bench.full_args``) and has it write that JSON under docs/bench (``Bench.docs_json``), from
a clean tree only, so every cited figure comes from one commit.

``--quick`` passes a bench's own quick flag where it has one; benches without one get smaller
sizes here, and then their targets (set for the full sizes) are shown but not judged. A bench
that fails is recorded with the last line of its stderr and the rest still run; the exit status
is 1 if any failed. ``gpu_check.sh`` needs CUDA and is skipped, with a note, without it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(REPO))
BENCH_DIR = REPO / "tools" / "bench"
DOCS_BENCH = REPO / "docs" / "bench"  # the committed JSONs the docs' tables are built from

from omniscale.tools.bench.registry import (  # noqa: E402,F401 (bench all's names, re-exported)
    BENCHES,
    KERNEL_ROWS,
    SPEEDUP,
    Bench,
    Goal,
    Metric,
)


# -- reading a bench's JSON ---------------------------------------------------------------------
def lookup(data, path: str | None):
    """The value at a dotted path, or None where any step is missing."""
    if path is None:
        return None
    for key in path.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def headline_rows(name: str, result: dict, quick: bool = False,
                  bench: Bench | None = None) -> list[dict]:
    """The table rows of one bench's JSON: bench, metric, value, baseline, ratio, target, met."""
    bench = bench or BENCHES[name]
    # Targets are set for the full sizes: judged in a bench's own quick mode, or when --quick
    # changed nothing, but not where this module shrank the sizes itself.
    judge = not quick or bench.quick_is_own_flag or not bench.quick_args
    rows = []
    for metric in bench.metrics:
        if metric.each is None:
            items = [result]
        else:
            items = lookup(result, metric.each)
            items = [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []
        if metric.where:
            items = [i for i in items if i.get(metric.where[0]) == metric.where[1]]
        for item in items:
            row = _row(metric, item, judge)
            if row is not None:
                rows.append({"bench": name, **row})
    return rows


def _row(metric: Metric, item: dict, judge: bool) -> dict | None:
    value = lookup(item, metric.value)
    if value is None:
        return None
    baseline = lookup(item, metric.baseline)
    if metric.ratio == SPEEDUP:
        ratio = baseline / value if _number(baseline) and _number(value) and value else None
    else:
        ratio = lookup(item, metric.ratio)
    target = metric.target if isinstance(metric.target, Goal) else lookup(item, metric.target)
    met = lookup(item, metric.met)
    if met is None and isinstance(target, Goal):
        checked = ratio if ratio is not None else value
        met = target.met(checked) if _number(checked) else None
    if not judge and target is not None:
        met = "n/a (quick sizes)"
    name = metric.name.format_map(_Fields(item)) if metric.each else metric.name
    return {"metric": name, "value": value, "baseline": baseline, "ratio": ratio,
            "target": None if target is None else str(target), "met": met}


class _Fields(dict):
    """Item fields for a metric's name; a missing one reads '?', not KeyError."""

    def __missing__(self, key: str) -> str:
        return "?"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# -- the Markdown table -------------------------------------------------------------------------
def format_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):  # '#': 1.000 stays 1.000, the digits a ratio is judged on
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:#.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(results: dict) -> str:
    """``bench-results.md``: every headline row, then each failed or skipped bench."""
    lines = ["# OmniScale benchmarks" + (" (--quick)" if results.get("quick") else ""), "",
             "| bench | metric | value | baseline | ratio | target | met? |",
             "|---|---|---|---|---|---|---|"]
    for name, bench in results["benches"].items():
        rows = bench.get("headlines") or []
        for row in rows:
            lines.append("| " + " | ".join(format_cell(row[k]) for k in (
                "bench", "metric", "value", "baseline", "ratio", "target", "met")) + " |")
        if bench["status"] in ("failed", "skipped") or not rows:
            what = bench.get("error") or bench.get("note") or "no headline numbers in its JSON"
            lines.append(f"| {name} | ({bench['status']}) {format_cell(what)} "
                         "| - | - | - | - | - |")
    lines += ["", "| bench | status | seconds | command |", "|---|---|---|---|"]
    for name, bench in results["benches"].items():
        seconds = f"{bench['seconds']:.1f}" if bench.get("seconds") is not None else "-"
        lines.append(f"| {name} | {bench['status']} | {seconds} | "
                     f"`{format_cell(bench.get('command') or '-')}` |")
    return "\n".join(lines) + "\n"


# -- running ------------------------------------------------------------------------------------
def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def docs_json(name: str, bench: Bench) -> str:
    """The file name of the bench's committed JSON under docs/bench."""
    return bench.docs_json or f"{name}.json"


def bench_command(bench: Bench, quick: bool, scratch: Path,
                  out: Path | None = None) -> tuple[list[str], dict, Path]:
    """(argv, extra environment, where its JSON will be); ``out``: write it there (a path
    relative to the repository, as the JSON's own command line then shows it) rather than in
    the scratch directory."""
    script = BENCH_DIR / bench.script
    extra = list(bench.quick_args) if quick else list(bench.full_args)
    if bench.json_in_out_dir:
        return (["bash", str(script), *extra], {"OUT": str(scratch), "PYTHON": sys.executable},
                scratch / bench.json_in_out_dir)
    if out is None:
        out = scratch / "result.json"
    return [sys.executable, str(script), *extra, "--out", str(out)], {}, REPO / out


def run_bench(name: str, bench: Bench, quick: bool, scratch: Path,
              write_docs: bool = False) -> dict:
    out = None
    if write_docs:  # relative to the repository, as the JSON's own command line then shows it
        out = DOCS_BENCH / docs_json(name, bench)
        out = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    argv, extra_env, json_path = bench_command(bench, quick, scratch, out)
    env = dict(os.environ, **extra_env)
    # Some scripts import the repository's packages without putting the root on sys.path.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    record = {"command": shown_command(argv, extra_env, scratch)}
    env["PYTHONUNBUFFERED"] = "1"  # its lines as it prints them, not at its end
    start = time.perf_counter()
    returncode, output = run_streaming(argv, env)
    record["seconds"] = time.perf_counter() - start
    record["returncode"] = returncode
    result, json_error = None, None
    if json_path.is_file():
        try:
            result = json.loads(json_path.read_text())
        except json.JSONDecodeError as e:
            json_error = f"its JSON is not valid ({e})"
    ran = returncode == 0 or returncode == bench.missed_exit_code
    if ran and isinstance(result, dict):
        if write_docs and bench.json_in_out_dir:  # a script writing under $OUT: copied over
            (DOCS_BENCH / docs_json(name, bench)).write_text(json_path.read_text())
        record["status"] = "ok" if returncode == 0 else "targets missed"
        record["result"] = result
        record["headlines"] = headline_rows(name, result, quick, bench)
    else:
        record["status"] = "failed"
        record["error"] = json_error or last_line("".join(output)) or (
            f"exit {returncode}" if returncode else "wrote no JSON")
        record["output_tail"] = [line.rstrip("\n") for line in output][-20:]
    return record


def run_streaming(argv: list[str], env: dict, keep: int = 200) -> tuple[int, list[str]]:
    """Run a bench script, echoing each line it prints (stdout and stderr, in order) as it
    comes, indented under its section -- a long bench shows its progress, and one that hangs
    shows where; returns (exit code, its last ``keep`` lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=keep)
    with subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            print(f"    {line.rstrip()}", flush=True)
            tail.append(line)
        returncode = proc.wait()
    return returncode, list(tail)


def shown_command(argv: list[str], extra_env: dict, scratch: Path) -> str:
    """The command as a person would type it from the repository root (the scratch directory,
    gone by the time anyone reads this, shown as $SCRATCH)."""
    def shown(arg: str) -> str:
        if arg == sys.executable:
            return "python"
        if arg.startswith(str(scratch)):
            return "$SCRATCH" + arg[len(str(scratch)):]
        if arg.startswith(str(REPO) + os.sep):
            return str(Path(arg).relative_to(REPO))
        return arg
    env = [f"{k}={shown(v)}" for k, v in extra_env.items() if k != "PYTHON"]
    return " ".join(env + [shown(a) for a in argv])


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_all(names: list[str], quick: bool, out: Path,
            benches: dict[str, Bench] = BENCHES, write_docs: bool = False) -> int:
    """Run the named benches in turn; returns 1 if any failed, else 0. ``write_docs``: each
    bench writes its committed JSON (docs/bench) at its full sizes, from a clean tree."""
    from omniscale.errors import UserError

    markdown = out.with_suffix(".md")
    if markdown == out:
        raise UserError(f"--out {out}: the Markdown table goes to {markdown}; "
                        "give the JSON another name (e.g. bench-results.json)")
    if write_docs:
        if quick:
            raise UserError("--write-docs --quick: the committed figures are the full sizes'")
        from omniscale.tools.bench.provenance import provenance

        if provenance()["git_dirty"] is not False:
            raise UserError("--write-docs: commit first -- the committed figures must come "
                            "from a clean tree (changes under docs/bench/ aside), and this "
                            "one has uncommitted changes or is no git checkout")
    results = {"quick": quick, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "benches": {}}
    has_cuda = None
    try:
        for i, name in enumerate(names, start=1):
            bench = benches[name]
            prefix = f"[{i}/{len(names)}] {name}"
            if bench.needs_cuda:
                has_cuda = cuda_available() if has_cuda is None else has_cuda
                if not has_cuda:
                    results["benches"][name] = {"status": "skipped",
                                                "note": "needs CUDA; none here"}
                    print(f"{prefix}: skipped (needs CUDA)", flush=True)
                    continue
            if quick and bench.variant_of:
                results["benches"][name] = {"status": "skipped", "note": (
                    f"a variant of {bench.variant_of} (tools/bench/{bench.script} "
                    f"{' '.join(bench.full_args)}): its script's quick run is "
                    f"{bench.variant_of}'s")}
                print(f"{prefix}: skipped (a variant of {bench.variant_of})", flush=True)
                continue
            print(f"{prefix}: running ...", flush=True)
            with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as scratch:
                record = run_bench(name, bench, quick, Path(scratch), write_docs)
            results["benches"][name] = record
            detail = f": {record['error']}" if record["status"] == "failed" else ""
            print(f"{prefix}: {record['status']} in {record['seconds']:.1f} s{detail}",
                  flush=True)
    finally:
        # Interrupted part-way (a full run takes long), the benches already done still count.
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        markdown.write_text(markdown_table(results))
    failed = [n for n, r in results["benches"].items() if r["status"] == "failed"]
    print(f"wrote {out} and {markdown}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def select(only: str | None, benches: dict[str, Bench] = BENCHES) -> list[str]:
    """Bench names to run, in registry order; UserError for an unknown name."""
    if not only:
        return list(benches)
    from omniscale.errors import UserError

    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in benches]
    if unknown or not wanted:
        raise UserError(f"--only: unknown bench {', '.join(map(repr, unknown)) or '(none given)'}"
                        f" (known: {', '.join(benches)})")
    return [n for n in benches if n in wanted]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="each bench's quick mode (or smaller sizes where it has none)")
    parser.add_argument("--only", metavar="NAME,...",
                        help=f"run only these ({', '.join(BENCHES)})")
    parser.add_argument("--write-docs", action="store_true",
                        help="write each bench's committed JSON under docs/bench (full sizes, "
                             "a clean tree; the docs' tables are then regenerated from them)")
    parser.add_argument("--out", default="bench-results.json", metavar="FILE",
                        help="collected JSON (default bench-results.json); the Markdown table "
                             "goes beside it as .md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from omniscale.errors import UserError

    try:
        return run_all(select(args.only), args.quick, Path(args.out),
                       write_docs=args.write_docs)
    except UserError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
