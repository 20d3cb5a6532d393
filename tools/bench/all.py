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
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(REPO))
BENCH_DIR = REPO / "tools" / "bench"
DOCS_BENCH = REPO / "docs" / "bench"  # the committed JSONs the docs' tables are built from


@dataclass(frozen=True)
class Goal:
    """A numeric target, checked on a row's ratio (or its value when it has no ratio)."""

    op: str  # ">=" or "<="
    bound: float

    def met(self, x: float) -> bool:
        return x >= self.bound if self.op == ">=" else x <= self.bound

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


# A ratio the bench does not write itself: baseline ÷ value (for times, where lower wins).
SPEEDUP = "baseline/value"


@dataclass(frozen=True)
class Metric:
    """One headline row (or one per item of the list at ``each``). ``value``, ``baseline``,
    ``ratio``, ``met`` and a string ``target`` are dotted paths into the bench's JSON (into the
    item with ``each``); a row whose value is absent is left out (CPU runs have no Triton)."""

    name: str  # str.format'ted with the item's fields when ``each`` is set
    value: str
    baseline: str | None = None
    ratio: str | None = None
    target: Goal | str | None = None
    met: str | None = None  # the bench's own verdict, when it writes one
    each: str | None = None
    where: tuple[str, object] | None = None  # only items whose field equals this


@dataclass(frozen=True)
class Bench:
    script: str
    metrics: tuple[Metric, ...]
    quick_args: tuple[str, ...] = ()
    quick_is_own_flag: bool = False  # False: quick_args shrink sizes, so targets are not judged
    missed_exit_code: int | None = None  # the exit status meaning "ran, some target missed"
    needs_cuda: bool = False
    json_in_out_dir: str | None = None  # a shell script writing this file under $OUT, no --out
    # the committed JSON under docs/bench (default NAME.json) and the arguments its figures are
    # measured with (`bench all --write-docs` runs them and writes it)
    docs_json: str | None = None
    full_args: tuple[str, ...] = ()


KERNEL_ROWS = (
    Metric("{op} fwd+bwd ms: eager (hand-written backward) vs reference", each="rows",
           value="ms.eager", baseline="ms.reference", ratio=SPEEDUP),
    Metric("{op} fwd+bwd ms: torch.compile vs reference", each="rows", value="ms.compiled",
           baseline="ms.reference", ratio=SPEEDUP),
    Metric("{op} fwd+bwd ms: Triton vs reference", each="rows", value="ms.triton",
           baseline="ms.reference", ratio=SPEEDUP),
    Metric("{op}: Triton fraction of peak {metric}", each="rows", value="peak_fraction.triton"),
)

# Every benchmark, in the order they run (cheapest first), and the headline numbers of each.
BENCHES: dict[str, Bench] = {
    "balance": Bench(
        "balance.py", quick_args=("--quick",), quick_is_own_flag=True,
        metrics=(Metric("{target}", each="targets", value="measured", target="goal", met="met"),)),
    "linear_ce_memory": Bench(
        "linear_ce_memory.py", quick_args=("--tokens", "2048", "--vocab", "32768",
                                           "--d-model", "256"),
        metrics=(
            Metric("peak RSS bytes: fused vs unfused linear CE", value="variants.fused.peak_bytes",
                   baseline="variants.unfused.peak_bytes", ratio="peak_ratio",
                   target=Goal("<=", 0.25)),
            Metric("RSS above inputs: fused vs unfused", value="variants.fused.loss_peak_bytes",
                   baseline="variants.unfused.loss_peak_bytes", ratio="loss_peak_ratio"),
            Metric("fused and unfused losses agree", value="losses_agree"))),
    "hf_load_memory": Bench(
        "hf_load_memory.py", quick_args=("--quick",), quick_is_own_flag=True,
        metrics=(
            Metric("peak RSS growth per rank loading a HF Qwen3-MoE: sharded vs from_hf then "
                   "fully_shard", value="median_peak_growth_bytes.sharded",
                   baseline="median_peak_growth_bytes.whole_then_shard",
                   ratio="sharded_over.whole_then_shard"),
            Metric("peak RSS growth per rank: sharded vs transformers from_pretrained",
                   value="median_peak_growth_bytes.sharded",
                   baseline="median_peak_growth_bytes.transformers",
                   ratio="sharded_over.transformers"),
            Metric("sharded load: peak bytes beyond the rank's shards",
                   value="sharded_beyond_shards_bytes"))),
    "kernels": Bench(
        "kernel_ops.py", quick_args=("--ops", "rms_norm", "--warmup", "1", "--reps", "2"),
        docs_json="kernels_cpu.json", full_args=("--device", "cpu"),
        metrics=KERNEL_ROWS),
    "model": Bench(
        "model.py", quick_args=("--presets", "tiny", "--tokens", "512", "--warmup", "1",
                                "--iters", "2"), full_args=("--warmup", "3", "--iters", "15"),
        metrics=(
            Metric("{preset} {batch}: tokens/s ours vs HF Qwen3-MoE", each="results",
                   value="ours_tokens_per_s", baseline="hf_tokens_per_s", ratio="ratio",
                   target=Goal(">=", 1.2), where=("batch", "equal")),
            # the headline: HF's fastest way to run the batch (either experts implementation;
            # on mixed lengths padded or bucketed too, whichever HF runs fastest)
            Metric("{preset} {batch}: ratio vs HF's fastest ({hf_best})", each="results",
                   value="ratio_vs_hf_best_default", target=Goal(">=", 1.2)),
            Metric("{preset} {batch}: tokens/s ours vs HF packed (block-causal)",
                   each="results", value="ours_tokens_per_s", baseline="hf_tokens_per_s",
                   ratio="ratio", where=("batch", "mixed")),
            Metric("{preset} {batch}: ratio vs HF padded (information)", each="results",
                   value="ratio_padded"),
            Metric("{preset} {batch}: ratio vs HF bucketed (information)", each="results",
                   value="ratio_bucketed"),
            Metric("{preset}: parameters, total", each="results", value="params_total",
                   where=("batch", "equal")),
            Metric("{preset}: parameters, active per token", each="results",
                   value="params_active", where=("batch", "equal")))),
    "attention": Bench(
        "attention.py", quick_args=("--reps", "3", "--cases", "tiny 4x512,small 4x512"),
        docs_json="attention_cpu.json",
        metrics=(Metric("{case} fwd+bwd ms: blocked vs SDPA", each="rows", value="ms.blocked",
                        baseline="ms.sdpa", ratio="speedup"),)),
    "commit": Bench(
        "commit.py", quick_args=("--ranks", "64", "--steps", "2"),
        metrics=(Metric("a step's rank commits, fsync +{fsync_extra_ms} ms: group commit vs "
                        "an fsync per record (s)", each="rows", value="group_commit_s",
                        baseline="fsync_each_s", ratio="speedup"),)),
    "loader": Bench(
        "loader.py", quick_args=("--steps", "2", "--rounds", "1", "--workers", "1", "--sources",
                                 "10", "--workloads", "mixed"),
        metrics=(
            Metric("{workload} samples/s: RankLoader vs the faster of webdataset and "
                   "Megatron-Energon (median of paired rounds)", each="workloads",
                   value="ours.samples_per_s", baseline="baseline.samples_per_s",
                   ratio="ratio.samples_per_s", target="target", met="met"),
            Metric("{workload} tokens/s: RankLoader vs the faster baseline (median of paired "
                   "rounds)", each="workloads", value="ours.tokens_per_s",
                   baseline="baseline.tokens_per_s", ratio="ratio.tokens_per_s"),
            Metric("{workload} samples/s: RankLoader vs DataLoader + webdataset",
                   each="workloads", value="ours.samples_per_s",
                   baseline="webdataset.samples_per_s",
                   ratio="ratio_vs.webdataset.samples_per_s"),
            Metric("{workload} samples/s: RankLoader vs Megatron-Energon", each="workloads",
                   value="ours.samples_per_s", baseline="energon.samples_per_s",
                   ratio="ratio_vs.energon.samples_per_s"),
            Metric("RSS growth MiB per worker, {kind}, {sources} sources",
                   each="memory_per_worker", value="rss_growth_mib"))),
    "ray_loader": Bench(
        "ray_loader.py", quick_args=("--steps", "2", "--rounds", "1", "--workers", "1"),
        metrics=(
            Metric("samples/s: Ray decoding pools vs DataLoader workers (median of rounds)",
                   value="median.ray.samples_per_s",
                   baseline="median.workers.samples_per_s", ratio="ratio.median"),
            Metric("loader start to the first step, s: Ray pools vs DataLoader workers",
                   value="median.ray.start_s", baseline="median.workers.start_s"))),
    "remote": Bench(
        "remote.py", quick_args=("--steps", "2", "--rounds", "1", "--workers", "1",
                                 "--latency-ms", "20", "--scale", "tiny"),
        metrics=(
            Metric("samples/s from a local S3 server at 20 ms/request, cold cache + plan "
                   "prefetch vs local disk (median of rounds)", each="latencies",
                   where=("latency_ms", 20.0), value="cold.samples_per_s",
                   baseline="local.samples_per_s", ratio="cold.ratio.median",
                   target=Goal(">=", 0.9)),
            Metric("samples/s from a local S3 server at {latency_ms:g} ms/request, no cache vs "
                   "local disk", each="latencies", value="direct.samples_per_s",
                   baseline="local.samples_per_s", ratio="direct.ratio.median"),
            Metric("samples/s from a local S3 server at {latency_ms:g} ms/request, warm cache "
                   "vs local disk", each="latencies", value="warm.samples_per_s",
                   baseline="local.samples_per_s", ratio="warm.ratio.median"))),
    "plane": Bench(
        # its own --quick, and shorter still: memory at 1 and 2 processes a side, serving 0.5 s
        # of 32 clients in 2 processes for the two transports PlaneClient has, planning 1,024
        # ranks only
        "plane.py", quick_args=("--quick", "--memory-procs", "1,2", "--seconds", "0.5",
                                "--warmup", "0.2", "--clients", "32", "--procs", "2",
                                "--modes", "action,lane", "--plan-ranks", "1024"),
        missed_exit_code=1,
        metrics=(Metric("{what}", each="rows", value="value", baseline="baseline",
                        target="target", met="met"),)),
    "e2e": Bench(
        "e2e.py", quick_args=("--rounds", "1", "--steps", "1", "--warmup", "0", "--scale",
                              "tiny", "--policies", "omniscale,token_lpt", "--costs", "flops",
                              "--global-batch-tokens", "4096", "--micro-batch-tokens", "2048",
                              "--workers", "0"),
        full_args=("--rounds", "3"),
        metrics=(
            Metric("training tokens/s: ours vs the best baseline policy (median of rounds)",
                   value="median.omniscale.tokens_per_s", ratio="ratio_vs_best_baseline.median",
                   target=Goal(">=", 0.98)),  # issue #44: never slower than the best baseline
            Metric("measured imbalance (compute clock) of our plans",
                   value="median.omniscale.imbalance_measured", target=Goal("<=", 1.10)))),
    "e2e_long_tail": Bench(
        "e2e_long_tail.py", quick_args=("--rounds", "1", "--steps", "4", "--warmup", "0",
                                        "--workers", "0",
                                        "--scale", "tiny", "--costs", "flops", "--policies",
                                        "omniscale,static_sp", "--retries", "0",
                                        "--wait-quiet-s", "0"),
        full_args=("--rounds", "2", "--costs", "calibrate", "--wait-quiet-s", "60"),
        metrics=(
            Metric("long-tailed training tokens/s: ours vs the static SP layout (median of "
                   "rounds)", value="median.omniscale.tokens_per_s_real",
                   baseline="median.static_sp.tokens_per_s_real",
                   ratio="measured.ratio_vs_static.median", target=Goal(">=", 1.2)),
            Metric("long-tailed training tokens/s: ours vs the best per-step baseline given "
                   "our split (median of rounds)", value="median.omniscale.tokens_per_s_real",
                   ratio="measured.ratio_vs_best_per_step.median", target=Goal(">=", 1.0)))),
    "gpu_check": Bench(
        "gpu_check.sh", needs_cuda=True, json_in_out_dir="kernels_h200.json",
        docs_json="kernels_h200.json",
        metrics=KERNEL_ROWS),
}


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
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    record["seconds"] = time.perf_counter() - start
    record["returncode"] = proc.returncode
    result, json_error = None, None
    if json_path.is_file():
        try:
            result = json.loads(json_path.read_text())
        except json.JSONDecodeError as e:
            json_error = f"its JSON is not valid ({e})"
    ran = proc.returncode == 0 or proc.returncode == bench.missed_exit_code
    if ran and isinstance(result, dict):
        if write_docs and bench.json_in_out_dir:  # a script writing under $OUT: copied over
            (DOCS_BENCH / docs_json(name, bench)).write_text(json_path.read_text())
        record["status"] = "ok" if proc.returncode == 0 else "targets missed"
        record["result"] = result
        record["headlines"] = headline_rows(name, result, quick, bench)
    else:
        record["status"] = "failed"
        record["error"] = json_error or last_line(proc.stderr) or last_line(proc.stdout) or (
            f"exit {proc.returncode}" if proc.returncode else "wrote no JSON")
        record["output_tail"] = (proc.stdout + proc.stderr).splitlines()[-20:]
    return record


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
