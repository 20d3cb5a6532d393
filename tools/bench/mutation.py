"""Mutation testing of the modules that guard data and training (issue #46): do their tests
notice when the code is wrong?

    .venv/bin/python tools/bench/mutation.py --module tools/train/guard.py \
        --module dataplane/journal.py --out /tmp/mutation.json
    .venv/bin/python tools/bench/mutation.py --list   # the mapping and mutant counts, no run

The mutants are Cosmic Ray's (its operators: comparison, binary and unary operator swaps,
number changes, ``and``/``or``, ``not`` added, loops run zero times, ...); this driver picks
them, applies one at a time and runs pytest itself, because Cosmic Ray runs one test command
for every mutant and cannot sample. Each module is tested only with the tests that cover it
(:data:`MODULE_TESTS`, written by hand: the whole suite takes over 20 minutes); a module with
more than ``--max-mutants`` mutants gets a reproducible sample (``--seed``), spread over its
code sites before any site gets a second mutant.

Everything runs in a copy of the repository's files (``--work``), never in the checkout: the
copy is put first on PYTHONPATH, so ``omniscale`` is imported from it, and each module's run
starts with a canary (the module raising on import) that its tests must fail, which proves
the tests exercise the copy. A mutated file is restored after its test run whatever happens
(Ctrl-C, SIGTERM) and checked against the original's SHA-256.

The suite's demo dataset (``demo_root``, about 12 s to build) is built once, from the
unmutated code, and handed to each test run by this module as a pytest plugin, unless the
mutated module is one that building the demo imports.

The JSON has per module the mutants generated, sampled, killed, survived, timed out, and each
survivor (line, operator, diff) with a ``reason`` to fill in by hand: empty means nobody has
looked; ``needs a test: ...`` a gap in the tests; anything else one line on why the mutant is
equivalent or acceptable. Reasons already written in ``--out`` are kept for the same mutation
of the same line text.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "omniscale.tools.bench.mutation"  # this module, loaded into each test run
DEMO_ENV = "OMNISCALE_MUTATION_DEMO"  # the prebuilt demo's directory, for the plugin
CANARY = "\nraise RuntimeError('mutation canary: this module must not import')\n"


@dataclasses.dataclass(frozen=True)
class ModuleTests:
    """The tests run against each mutant of a module (pytest node ids: files or
    ``file::test``), and slower ones run only on the mutants those leave alive
    (``--recheck-slow``). A slow node id inside a fast file is deselected from the fast run."""

    fast: tuple[str, ...]
    slow: tuple[str, ...] = ()


_DURABILITY = "tests/dataplane/test_plane_durability.py"
_RANDOM_KILLS = (f"{_DURABILITY}::"
                 "test_random_kills_truncations_and_flips_never_lose_a_committed_step")

# Each module of issue #46 -> the tests that exercise it directly (the files that import it, or
# the plane's for its internals), fastest first since a failure stops the run (-x). "slow":
# multi-process training runs and long property tests.
MODULE_TESTS: dict[str, ModuleTests] = {
    "dataplane/journal.py": ModuleTests(
        ("tests/dataplane/test_group_commit.py", "tests/dataplane/test_corrupt.py",
         "tests/dataplane/test_restore_edges.py", _DURABILITY,
         "tests/dataplane/test_commit_many.py"),
        (_RANDOM_KILLS, "tests/dataplane/test_plane_faults.py")),
    "dataplane/restore.py": ModuleTests(
        ("tests/dataplane/test_restore_edges.py", _DURABILITY),
        (_RANDOM_KILLS, "tests/tools/test_train_optim_groups.py")),
    "dataplane/plane_state.py": ModuleTests(
        ("tests/dataplane/test_plane.py", _DURABILITY, "tests/dataplane/test_plane_speeds.py",
         "tests/dataplane/test_group_commit.py"),
        (_RANDOM_KILLS,)),
    "dataplane/mixer.py": ModuleTests(
        ("tests/dataplane/test_mixer.py", "tests/dataplane/test_bulk_draw.py",
         "tests/dataplane/test_plane_golden.py")),
    "dataplane/catalog.py": ModuleTests(
        ("tests/dataplane/test_catalog.py", "tests/dataplane/test_mixer.py",
         "tests/dataplane/test_bulk_draw.py", "tests/dataplane/test_plane_golden.py"),
        ("tests/dataplane/test_spec_remote.py",)),
    "dataplane/windows.py": ModuleTests(
        ("tests/dataplane/test_bulk_draw.py", "tests/balancer/test_static_layout.py",
         "tests/dataplane/test_plane_speeds.py")),
    "tools/train/guard.py": ModuleTests(
        ("tests/tools/test_guard_units.py",),
        ("tests/tools/test_train_guard.py", "tests/tools/test_guard_router_bias.py")),
    "tools/train/checkpoint.py": ModuleTests(
        ("tests/tools/test_checkpoint_prune.py", "tests/tools/test_checkpoint_rank_verdicts.py",
         "tests/tools/test_checkpoint_manifest.py"),
        ("tests/tools/test_checkpoint_crash.py", "tests/tools/test_train_init_run.py")),
    "tools/train/optim_groups.py": ModuleTests(
        ("tests/tools/test_optim_groups_partial.py",),
        ("tests/tools/test_train_optim_groups.py",)),
    "tools/train/held_out.py": ModuleTests(
        ("tests/tools/test_held_out_scoring.py",),
        ("tests/tools/test_train_eval.py",)),
    "tools/train/records.py": ModuleTests(
        ("tests/tools/test_guard_units.py", "tests/tools/test_step_audit.py"),
        ("tests/tools/test_train.py", "tests/tools/test_rank_speeds.py")),
    "loaders/chat.py": ModuleTests(
        ("tests/loaders/test_chat.py", "tests/loaders/test_conversation_templates.py")),
    "loaders/conversation.py": ModuleTests(
        ("tests/loaders/test_conversation.py", "tests/loaders/test_importers.py")),
    "loaders/sequence.py": ModuleTests(
        ("tests/loaders/test_sequence.py", "tests/loaders/test_chunks.py"),
        ("tests/parallel/test_sp.py",)),
    "loaders/remote_cache.py": ModuleTests(
        ("tests/loaders/test_cache_edges.py", "tests/loaders/test_remote_cache.py")),
    "loaders/ranged_file.py": ModuleTests(
        ("tests/loaders/test_ranged_read_ahead.py", "tests/loaders/test_index_remote.py")),
    "loaders/assemble.py": ModuleTests(
        ("tests/loaders/test_decode_work.py", "tests/loaders/test_chunks.py")),
    "balancer/split.py": ModuleTests(
        ("tests/balancer/test_split.py", "tests/balancer/test_baselines.py",
         "tests/balancer/test_cost.py")),
    "balancer/pack.py": ModuleTests(
        ("tests/balancer/test_pack.py", "tests/balancer/test_planner.py")),
    "balancer/assign.py": ModuleTests(
        ("tests/balancer/test_assign.py", "tests/balancer/test_ranktree.py",
         "tests/balancer/test_speeds_planner.py")),
    "parallel/reshard.py": ModuleTests(
        ("tests/parallel/test_reshard.py", "tests/test_plan.py")),
}


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One Cosmic Ray mutation: ``occurrence`` counts the operator's positions in the file."""

    file: str  # relative to the repository
    operator: str
    occurrence: int
    line: int
    column: int


def enumerate_mutants(source: str, file: str) -> list[Mutant]:
    """Every mutation Cosmic Ray's argument-free operators make in ``source``, but those inside
    annotations of a module with ``from __future__ import annotations``: Python never
    evaluates them there (``-> str | None`` made ``-> str & None`` is equivalent)."""
    from cosmic_ray import plugins
    from cosmic_ray.ast import ast_nodes, get_ast

    tree = get_ast(source)
    skipped = _annotation_spans(tree) if _postponed_annotations(source) else []
    mutants = []
    for name in plugins.operator_names():
        operator_class = plugins.get_operator(name)
        if operator_class.arguments():  # VariableReplacer/Inserter: need per-run arguments
            continue
        operator = operator_class()
        positions = (start for node in ast_nodes(tree)
                     for start, _ in operator.mutation_positions(node))
        mutants += [Mutant(file, name, i, line, column)
                    for i, (line, column) in enumerate(positions)
                    if not any(start <= (line, column) < end for start, end in skipped)]
    return mutants


def _postponed_annotations(source: str) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
               and any(alias.name == "annotations" for alias in node.names)
               for node in ast.parse(source).body)


def _annotation_spans(tree) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of every annotation in a parso tree: parameters', returns', variables'."""
    from cosmic_ray.ast import ast_nodes

    spans = []
    for node in ast_nodes(tree):
        if node.type in ("funcdef", "param"):
            annotation = node.annotation
        elif node.type == "annassign":  # `: T` or `: T = value`
            annotation = node.children[1]
        else:
            continue
        if annotation is not None:
            spans.append((annotation.start_pos, annotation.end_pos))
    return spans


def sample(mutants: list[Mutant], limit: int, seed: int) -> list[Mutant]:
    """At most ``limit`` mutants, the same ones for the same seed: code sites (line, column)
    in a seeded order, one mutant from each before any gets a second, so a sample spreads
    over the module instead of following where operators pile up (a ``/`` has 12 swaps)."""
    if len(mutants) <= limit:
        return sorted(mutants, key=_order)
    rng = random.Random(f"{seed}:{mutants[0].file}")  # a str seed: the same in every process
    sites: dict[tuple[int, int], list[Mutant]] = {}
    for m in sorted(mutants, key=_order):
        sites.setdefault((m.line, m.column), []).append(m)
    queues = list(sites.values())
    rng.shuffle(queues)
    for queue in queues:
        rng.shuffle(queue)
    picked: list[Mutant] = []
    while len(picked) < limit:
        for queue in queues:
            if queue and len(picked) < limit:
                picked.append(queue.pop())
    return sorted(picked, key=_order)


def _order(m: Mutant) -> tuple:
    return m.line, m.column, m.operator, m.occurrence


def mutate(source: str, mutant: Mutant) -> str:
    from cosmic_ray import plugins
    from cosmic_ray.mutating import mutate_code

    mutated = mutate_code(source, plugins.get_operator(mutant.operator)(), mutant.occurrence)
    if mutated is None:
        raise ValueError(f"{mutant} is not a mutation of this source")
    return mutated


def line_diff(original: str, mutated: str) -> str:
    """The changed lines only (``-`` old, ``+`` new), as survivors are read."""
    return "\n".join(line for line in difflib.unified_diff(
        original.splitlines(), mutated.splitlines(), lineterm="", n=0)
        if line[:1] in "-+" and not line.startswith(("---", "+++")))


class RestoreError(RuntimeError):
    """A mutated file could not be put back as it was: stop everything."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def applied(path: Path, text: str) -> Iterator[None]:
    """``path`` holds ``text`` inside the block; its original bytes after it, however the block
    ends (an exception, Ctrl-C), checked by hash."""
    original = path.read_bytes()
    digest = hashlib.sha256(original).hexdigest()
    try:
        path.write_text(text, encoding="utf-8")
        yield
    finally:
        path.write_bytes(original)
        if sha256(path) != digest:
            raise RestoreError(f"{path} differs from its original after a mutant; stopping")


def make_work_copy(repo: Path, work: Path) -> Path:
    """A fresh copy of the repository's files (git's tracked and untracked-not-ignored ones,
    as they are in the working tree) at ``work``, which must lie outside ``repo``."""
    repo, work = repo.resolve(), work.resolve()
    if work == repo or work.is_relative_to(repo) or repo.is_relative_to(work):
        raise ValueError(f"--work {work} must lie outside the repository {repo}")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=repo, capture_output=True, check=True)
    if work.exists():
        shutil.rmtree(work)
    for name in listed.stdout.decode().split("\0"):
        source = repo / name
        if name and source.is_file():  # a tracked file deleted in the working tree: skip
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, work / name)
    return work


@dataclasses.dataclass
class Outcome:
    status: str  # "killed", "survived", "timed_out" or "error" (pytest could not run them)
    seconds: float
    tail: str = ""  # the end of pytest's output


# pytest's exit codes: 0 all passed, 1 a test failed, 2 interrupted (a collection error: the
# mutated module does not import); 3-5 mean the run itself is broken (internal error, usage,
# no tests), which says nothing about the mutant.
_KILLED_CODES = (1, 2)


def runner_in(work: Path, env: dict[str, str]) -> Callable[..., Outcome]:
    """Runs node ids with pytest in ``work``, stopping at the first failure, niced (the
    machine is shared); a timeout kills the whole process group."""

    def run(tests: tuple[str, ...], deselect: tuple[str, ...], timeout: float) -> Outcome:
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                   "-p", PLUGIN, *tests, *(f"--deselect={d}" for d in deselect)]
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: os.nice(10))
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return Outcome("timed_out", time.perf_counter() - start)
        finally:  # also on Ctrl-C: no test run outlives the driver
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        seconds = time.perf_counter() - start
        status = ("survived" if proc.returncode == 0 else
                  "killed" if proc.returncode in _KILLED_CODES else "error")
        return Outcome(status, seconds, out.decode(errors="replace")[-2000:])
    return run


def _tests_for(module: str, slow: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(node ids to run, node ids to deselect) for the fast or the slow run of a module."""
    entry = MODULE_TESTS[module]
    if slow:
        return entry.slow, ()
    fast_files = {t.split("::")[0] for t in entry.fast}
    return entry.fast, tuple(t for t in entry.slow if "::" in t and t.split("::")[0] in fast_files)


def reason_key(survivor: dict) -> tuple:
    """What identifies a survivor across runs and small edits elsewhere in the file."""
    return survivor["file"], survivor["operator"], survivor["diff"]


def run_module(module: str, work: Path, runner: Callable[..., Outcome], *, max_mutants: int,
               seed: int, recheck_slow: bool = False, reasons: dict | None = None,
               log: Callable[[str], None] = print) -> dict:
    """Mutation results of one module (``module``: a path relative to the repository), run in
    ``work`` with ``runner(tests, deselect, timeout) -> Outcome``."""
    started = time.perf_counter()
    path = work / module
    source = path.read_text(encoding="utf-8")
    tests, deselect = _tests_for(module, slow=False)
    result: dict = {"tests": list(tests), "deselected": list(deselect),
                    "slow_tests": list(MODULE_TESTS[module].slow)}
    baseline = runner(tests, deselect, 1800)
    result["baseline_seconds"] = round(baseline.seconds, 1)
    if baseline.status != "survived":
        return {**result, "error": f"the tests fail unmutated: {baseline.tail[-500:]}"}
    timeout = max(3 * baseline.seconds, baseline.seconds + 30)
    with applied(path, source + CANARY):
        canary = runner(tests, deselect, timeout)
    if canary.status != "killed":
        return {**result, "error": "a module that cannot be imported passed its tests: they do "
                                   "not run against the work copy, or never import it"}
    generated = enumerate_mutants(source, module)
    picked = sample(generated, max_mutants, seed)
    counts = dict.fromkeys(("killed", "survived", "timed_out", "errors"), 0)
    survivors, errors = [], []
    for i, mutant in enumerate(picked, 1):
        mutated = mutate(source, mutant)
        with applied(path, mutated):
            outcome = runner(tests, deselect, timeout)
        counts[{"error": "errors"}.get(outcome.status, outcome.status)] += 1
        entry = {"file": module, "line": mutant.line, "column": mutant.column,
                 "operator": mutant.operator, "occurrence": mutant.occurrence,
                 "diff": line_diff(source, mutated)}
        if outcome.status == "survived":
            survivors.append({**entry, "reason": ""})
        elif outcome.status == "error":
            errors.append({**entry, "output": outcome.tail[-500:]})
        log(f"  {module} {i}/{len(picked)} line {mutant.line} {mutant.operator}: "
            f"{outcome.status} ({outcome.seconds:.1f} s)")
    if recheck_slow and MODULE_TESTS[module].slow:
        slow_tests, _ = _tests_for(module, slow=True)
        for s in survivors:
            mutant = Mutant(module, s["operator"], s["occurrence"], s["line"], s["column"])
            with applied(path, mutate(source, mutant)):
                s["slow_tests"] = runner(slow_tests, (), 10 * timeout).status
    for s in survivors:
        s["reason"] = (reasons or {}).get(reason_key(s), "")
    return {**result, "timeout_seconds": round(timeout, 1), "generated": len(generated),
            "sampled": len(picked), **counts, "seconds": round(time.perf_counter() - started, 1),
            "survivors": survivors, "error_mutants": errors}


def build_demo(work: Path, env: dict[str, str], demo: Path) -> set[str]:
    """The suite's demo built once in ``work`` from the unmutated code; the files (relative to
    ``work``) of the project's modules that building it imported."""
    script = ("import json, sys; from pathlib import Path; from tests.demo_data import build; "
              "build(Path(sys.argv[1])); print(json.dumps([getattr(m, '__file__', None) "
              "for n, m in list(sys.modules.items()) if n.startswith('omniscale')]))")
    done = subprocess.run([sys.executable, "-c", script, str(demo)], cwd=work, env=env,
                          capture_output=True, text=True, check=True)
    files = json.loads(done.stdout.strip().splitlines()[-1])
    return {str(Path(f).resolve().relative_to(work)) for f in files
            if f and Path(f).resolve().is_relative_to(work)}


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    """As a pytest plugin (``-p``): the session's ``demo_root`` is the prebuilt demo, when the
    driver says where it is; otherwise the suite's own fixture builds it."""
    demo = os.environ.get(DEMO_ENV)
    if not demo or fixturedef.argname != "demo_root":
        return None
    fixturedef.cached_result = (Path(demo), fixturedef.cache_key(request), None)
    return Path(demo)


def load_reasons(path: Path) -> dict:
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    return {reason_key(s): s["reason"] for m in old.get("modules", {}).values()
            for s in m.get("survivors", ()) if s.get("reason")}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: every mutated file is restored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", action="append", choices=sorted(MODULE_TESTS),
                        help="a module to mutate (repeatable; default: all of them)")
    parser.add_argument("--max-mutants", type=int, default=100,
                        help="mutants per module at most, sampled (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--out", default="docs/bench/mutation.json", type=Path)
    parser.add_argument("--work", default="/tmp/omniscale-mutation", type=Path,
                        help="the repository's copy the mutants are run in (wiped first)")
    parser.add_argument("--recheck-slow", action="store_true",
                        help="run each module's slow tests on the mutants its fast ones miss")
    parser.add_argument("--list", action="store_true",
                        help="print each module's tests and mutant counts; run nothing")
    args = parser.parse_args(argv)
    modules = args.module or list(MODULE_TESTS)
    if args.list:
        for module in modules:
            generated = enumerate_mutants((REPO / module).read_text(), module)
            print(f"{module}: {len(generated)} mutants, "
                  f"{min(len(generated), args.max_mutants)} run; tests "
                  f"{' '.join(MODULE_TESTS[module].fast)}")
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    from importlib.metadata import version

    reasons = load_reasons(args.out)
    work = make_work_copy(REPO, args.work / "repo")
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    demo_imports = build_demo(work, env, args.work / "demo")
    report = {"tool": {"name": "cosmic-ray", "version": version("cosmic-ray")},
              "seed": args.seed, "max_mutants": args.max_mutants, "modules": {}}
    started = time.perf_counter()
    try:
        for module in modules:
            # a module the demo is built with must build it mutated: the suite's fixture then
            module_env = env if module in demo_imports else {**env, DEMO_ENV: str(args.work /
                                                                                 "demo")}
            print(f"{module}: {' '.join(MODULE_TESTS[module].fast)}", flush=True)
            report["modules"][module] = {
                **run_module(module, work, runner_in(work, module_env),
                             max_mutants=args.max_mutants, seed=args.seed,
                             recheck_slow=args.recheck_slow, reasons=reasons,
                             log=lambda line: print(line, flush=True)),
                "demo_prebuilt": module not in demo_imports}
            _write(args.out, report, started)
    except KeyboardInterrupt:
        report["interrupted"] = True
        _write(args.out, report, started)
        return 130
    for module, r in report["modules"].items():
        print(f"{module}: " + (r.get("error") or f"{r['killed']} killed, {r['survived']} "
              f"survived, {r['timed_out']} timed out of {r['sampled']} ({r['seconds']:.0f} s)"))
    return 0


def _write(out: Path, report: dict, started: float) -> None:
    report["seconds"] = round(time.perf_counter() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
