"""Mutation testing of the modules that guard data and training (issue #46): do their tests
notice when the code is wrong?

    .venv/bin/python tools/bench/mutation.py --module tools/train/guard.py \
        --module dataplane/journal.py --out /tmp/mutation.json
    .venv/bin/python tools/bench/mutation.py --list   # the mapping and mutant counts, no run
    .venv/bin/python tools/bench/mutation.py --check  # each module's tests unmutated and with
                                                      # the canary, no mutant; the time of a run

The mutants are Cosmic Ray's (its operators: comparison, binary and unary operator swaps,
number changes, ``and``/``or``, ``not`` added, loops run zero times, ...); this driver picks
them, applies one at a time and runs pytest itself, because Cosmic Ray runs one test command
for every mutant and cannot sample. Each module is tested only with the tests that cover it
(:data:`MODULE_TESTS`, written by hand: the whole suite takes over 20 minutes); a module with
more than ``--max-mutants`` mutants gets a reproducible sample (``--seed``), spread over its
code sites before any site gets a second mutant.

Each module's fast tests run once under coverage, and each mutant then runs only those that
execute its statement (``--select covering``, :mod:`mutation_coverage`; every one for a
statement run at import, in numba-compiled code, in a shared fixture or in a subprocess);
``--select all`` runs every fast test for every mutant. The tests of a mutant run in a child
forked from a process that imported torch, pyarrow, Hypothesis and the rest of what they import
from outside the project once per module (:mod:`mutation_runners`, 0.2 s of start-up instead
of 5-9 s); ``--runner subprocess`` starts a new ``python -m pytest`` for each instead.
``--jobs N`` runs the modules in N drivers side by side (:mod:`mutation_jobs`).

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
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from omniscale.tools.bench.mutation_coverage import LineTests, data_files_of_subprocesses
from omniscale.tools.bench.mutation_mutants import (
    Mutant,
    enumerate_mutants,
    line_diff,
    mutate,
    sample,
)
from omniscale.tools.bench.mutation_numba import LOCATOR_ENV
from omniscale.tools.bench.mutation_plugin import DEMO_ENV, TEST_SECONDS_ENV
from omniscale.tools.bench.mutation_report import (
    _previous_for_update,
    _summarize,
    load_reasons,
    reason_key,
)
from omniscale.tools.bench.mutation_runners import Coverage, ForkRunner, Outcome, runner_in
from omniscale.tools.bench.mutation_table import explained

REPO = Path(__file__).resolve().parents[2]
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
_MIXER_PROPERTIES = (  # Hypothesis over schedules: 24 s and 6 s
    "tests/dataplane/test_mixer.py::test_realized_mixture_tracks_the_target_within_one_sample",
    "tests/dataplane/test_mixer.py::test_restoring_a_state_mid_run_continues_identically")

# Each module of issue #46 -> the tests that exercise it directly (the files that import it, or
# the plane's for its internals), fastest first since a failure stops the run (-x). "slow":
# multi-process training runs and long property tests, over 5 s each in `--check`'s runs (a
# test that builds the demo takes 8 s more when the mutated module is one the demo is built
# with). records.py's flush is then left to its slow tests: only training runs call it.
MODULE_TESTS: dict[str, ModuleTests] = {
    "dataplane/journal.py": ModuleTests(
        ("tests/dataplane/test_group_commit.py", "tests/dataplane/test_corrupt.py",
         "tests/dataplane/test_restore_edges.py", "tests/dataplane/test_journal_edges.py",
         _DURABILITY, "tests/dataplane/test_commit_many.py"),
        (_RANDOM_KILLS, "tests/dataplane/test_plane_faults.py",
         "tests/tools/test_train_corrupt.py")),
    "dataplane/restore.py": ModuleTests(
        ("tests/dataplane/test_restore_edges.py", _DURABILITY, "tests/dataplane/test_plane.py"),
        (_RANDOM_KILLS, "tests/dataplane/test_plane_faults.py",
         "tests/tools/test_train_resume.py", "tests/tools/test_train_optim_groups.py")),
    "dataplane/plane_state.py": ModuleTests(
        ("tests/dataplane/test_plane.py", _DURABILITY, "tests/dataplane/test_plane_speeds.py",
         "tests/dataplane/test_group_commit.py", "tests/dataplane/test_plane_commit_retry.py",
         "tests/dataplane/test_plane_state_edges.py"),
        (_RANDOM_KILLS,)),
    "dataplane/mixer.py": ModuleTests(
        ("tests/dataplane/test_mixer.py", "tests/dataplane/test_mixer_edges.py",
         "tests/dataplane/test_bulk_draw.py", "tests/dataplane/test_plane_golden.py",
         "tests/dataplane/test_draw_kernel.py"),
        _MIXER_PROPERTIES),
    "dataplane/catalog.py": ModuleTests(
        ("tests/dataplane/test_catalog.py", "tests/dataplane/test_catalog_edges.py",
         "tests/dataplane/test_mixer.py", "tests/dataplane/test_mixer_edges.py",
         "tests/dataplane/test_bulk_draw.py", "tests/dataplane/test_plane_golden.py",
         "tests/dataplane/test_draw_kernel.py"),
        ("tests/dataplane/test_spec_remote.py", *_MIXER_PROPERTIES)),
    "dataplane/windows.py": ModuleTests(
        ("tests/dataplane/test_bulk_draw.py", "tests/balancer/test_static_layout.py",
         "tests/dataplane/test_plane_speeds.py", "tests/dataplane/test_windows_units.py")),
    "tools/train/guard.py": ModuleTests(
        ("tests/tools/test_guard_units.py",),
        ("tests/tools/test_train_guard.py", "tests/tools/test_guard_router_bias.py")),
    "tools/train/checkpoint.py": ModuleTests(
        ("tests/tools/test_checkpoint_prune.py", "tests/tools/test_checkpoint_rank_verdicts.py",
         "tests/tools/test_checkpoint_edges.py", "tests/tools/test_checkpoint_manifest.py"),
        ("tests/tools/test_checkpoint_manifest.py::"
         "test_resume_of_a_changed_checkpoint_is_one_line_and_leaves_the_run",  # 18 s
         "tests/tools/test_checkpoint_crash.py", "tests/tools/test_train_init_run.py")),
    "tools/train/optim_groups.py": ModuleTests(
        ("tests/tools/test_optim_groups_units.py", "tests/tools/test_optim_groups_partial.py"),
        ("tests/tools/test_train_optim_groups.py",)),
    "tools/train/held_out.py": ModuleTests(
        ("tests/tools/test_held_out_scoring.py", "tests/tools/test_held_out_units.py"),
        ("tests/tools/test_train_eval.py",)),
    "tools/train/records.py": ModuleTests(  # the step audit's training runs: 11-15 s each
        ("tests/tools/test_guard_units.py", "tests/tools/test_records_units.py"),
        ("tests/tools/test_step_audit.py", "tests/tools/test_train.py",
         "tests/tools/test_rank_speeds.py")),
    "loaders/chat.py": ModuleTests(
        ("tests/loaders/test_chat.py", "tests/loaders/test_chat_edges.py",
         "tests/loaders/test_conversation_templates.py"),
        ("tests/loaders/test_chat.py::"  # the one test of the two files that builds the demo
         "test_target_tokens_of_other_sources_count_the_decoded_labels",)),
    "loaders/conversation.py": ModuleTests(
        ("tests/loaders/test_conversation_units.py", "tests/loaders/test_conversation.py",
         "tests/loaders/test_importers.py")),
    "loaders/sequence.py": ModuleTests(
        ("tests/loaders/test_sequence.py", "tests/loaders/test_sequence_edges.py",
         "tests/loaders/test_chunks.py"),
        ("tests/parallel/test_sp.py",)),
    "loaders/remote_cache.py": ModuleTests(
        ("tests/loaders/test_cache_edges.py", "tests/loaders/test_remote_cache.py",
         "tests/loaders/test_remote_cache_units.py")),
    "loaders/ranged_file.py": ModuleTests(
        ("tests/loaders/test_ranged_read_ahead.py", "tests/loaders/test_index_remote.py",
         "tests/loaders/test_ranged_file_units.py")),
    "loaders/assemble.py": ModuleTests(
        ("tests/loaders/test_assemble_units.py", "tests/loaders/test_assemble_edges.py",
         "tests/loaders/test_decode_work.py",
         "tests/loaders/test_chunks.py")),
    "balancer/split.py": ModuleTests(
        ("tests/balancer/test_split_units.py", "tests/balancer/test_split.py",
         "tests/balancer/test_baselines.py", "tests/balancer/test_cost.py")),
    "balancer/pack.py": ModuleTests(
        ("tests/balancer/test_pack.py", "tests/balancer/test_pack_align_oracle.py",
         "tests/balancer/test_planner.py")),
    "balancer/assign.py": ModuleTests(
        ("tests/balancer/test_assign.py", "tests/balancer/test_ranktree.py",
         "tests/balancer/test_speeds_planner.py")),
    "parallel/reshard.py": ModuleTests(
        ("tests/parallel/test_reshard.py", "tests/parallel/test_reshard_units.py",
         "tests/test_plan.py")),
}


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


def _tests_for(module: str, slow: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(node ids to run, node ids to deselect) for the fast or the slow run of a module."""
    entry = MODULE_TESTS[module]
    if slow:
        return entry.slow, ()
    fast_files = {t.split("::")[0] for t in entry.fast}
    return entry.fast, tuple(t for t in entry.slow if "::" in t and t.split("::")[0] in fast_files)


def check_module(module: str, work: Path, runner: Callable[..., Outcome]) -> dict:
    """The runs before a module's mutants (``--check`` runs only these): the tests must pass
    unmutated (``baseline_seconds`` sets the mutants' timeout) and fail with the module unable
    to import (the canary); ``error`` says which did not."""
    path = work / module
    tests, deselect = _tests_for(module, slow=False)
    result: dict = {"tests": list(tests), "deselected": list(deselect),
                    "slow_tests": list(MODULE_TESTS[module].slow)}
    baseline = runner(tests, deselect, 1800)
    result["baseline_seconds"] = round(baseline.seconds, 1)
    if baseline.status != "survived":
        return {**result, "error": f"the tests fail unmutated: {baseline.tail[-500:]}"}
    timeout = max(3 * baseline.seconds, baseline.seconds + 30)
    with applied(path, path.read_text(encoding="utf-8") + CANARY):
        canary = runner(tests, deselect, timeout)
    result["canary_seconds"] = round(canary.seconds, 1)
    if canary.status == "survived":
        return {**result, "error": "a module that cannot be imported passed its tests: they do "
                                   "not run against the work copy, or never import it"}
    if canary.status != "killed":
        return {**result, "error": f"the canary's run was no test failure ({canary.status}, "
                                   f"pytest's exit code {canary.code}): {canary.tail[-500:]}"}
    return {**result, "timeout_seconds": timeout}


def coverage_data(work: Path, module: str) -> Path:
    """The coverage data file of ``module``'s measured run, beside the copy ``work``; its
    tests' order and times are in ``.tests`` and ``.seconds`` files beside it."""
    return work.parent / f"coverage-{module.replace('/', '-')}"


def measure_line_tests(module: str, work: Path, runner: Callable[..., Outcome],
                       timeout: float) -> LineTests | None:
    """Which fast test of ``module`` executes which of its lines: one run under coverage
    (:mod:`mutation_coverage`); None if that run did not pass."""
    data_file = coverage_data(work, module)
    measured = runner(*_tests_for(module, slow=False), timeout,
                      Coverage(str(data_file), str((work / module).resolve())))
    if measured.status != "survived":
        return None
    return LineTests.read(data_file, work / module)


def run_module(module: str, work: Path, runner: Callable[..., Outcome], *, max_mutants: int,
               seed: int, recheck_slow: bool = False, reasons: dict | None = None,
               select: str = "covering", log: Callable[[str], None] = print) -> dict:
    """Mutation results of one module (``module``: a path relative to the repository), run in
    ``work`` with ``runner(tests, deselect, timeout) -> Outcome``: each mutant against the
    fast tests that execute its statement (``select="covering"``) or all of them
    (``"all"``)."""
    started = time.perf_counter()
    path = work / module
    source = path.read_text(encoding="utf-8")
    data_file = coverage_data(work, module)  # an earlier run's: no test's timeout comes from it
    for stale in (data_file, Path(f"{data_file}.tests"), Path(f"{data_file}.seconds"),
                  *data_files_of_subprocesses(data_file)):
        stale.unlink(missing_ok=True)
    result = check_module(module, work, runner)
    if "error" in result:
        return result
    tests, deselect = _tests_for(module, slow=False)
    timeout = result.pop("timeout_seconds")
    line_tests = None
    if select == "covering":
        measure_started = time.perf_counter()
        line_tests = measure_line_tests(module, work, runner, 3 * timeout)
        result["coverage_seconds"] = round(time.perf_counter() - measure_started, 1)
        if line_tests is None:
            log(f"  {module}: the tests failed under coverage; every mutant runs them all")
    tree = ast.parse(source)
    generated = enumerate_mutants(source, module)
    picked = sample(generated, max_mutants, seed)
    counts = dict.fromkeys(("killed", "survived", "timed_out", "crashed", "errors"), 0)
    survivors, errors, crashes = [], [], []
    selections: dict[str, int] = {}
    for i, mutant in enumerate(picked, 1):
        mutated = mutate(source, mutant)
        chosen, why = (None, "all") if line_tests is None else \
            line_tests.tests_for(tree, mutant.line)
        selections[why] = selections.get(why, 0) + 1
        with applied(path, mutated):
            # a hang of a few selected tests is cut at their own time's measure, not the whole
            # set's
            outcome = runner(tests, deselect, timeout) if chosen is None else \
                runner(chosen, (), line_tests.timeout_for(chosen, timeout))
        counts[{"error": "errors"}.get(outcome.status, outcome.status)] += 1
        entry = {"file": module, "line": mutant.line, "column": mutant.column,
                 "operator": mutant.operator, "occurrence": mutant.occurrence,
                 "diff": line_diff(source, mutated),
                 "tests_run": "all" if chosen is None else len(chosen)}
        if outcome.status == "survived":
            survivors.append({**entry, "reason": ""})
        elif outcome.status in ("error", "crashed"):
            (errors if outcome.status == "error" else crashes).append(
                {**entry, "output": outcome.tail[-500:]})
        log(f"  {module} {i}/{len(picked)} line {mutant.line} {mutant.operator}: "
            f"{outcome.status} ({outcome.seconds:.1f} s)")
    for s in survivors:
        s["reason"] = (reasons or {}).get(reason_key(s), "")
    if recheck_slow and MODULE_TESTS[module].slow:
        slow_tests, _ = _tests_for(module, slow=True)
        for s in survivors:
            if explained(s):  # shown equivalent before: no test can kill it, slow or fast
                s["slow_tests"] = "not run: equivalent"
                continue
            mutant = Mutant(module, s["operator"], s["occurrence"], s["line"], s["column"])
            with applied(path, mutate(source, mutant)):
                s["slow_tests"] = runner(slow_tests, (), 10 * timeout).status
    return {**result, "timeout_seconds": round(timeout, 1), "generated": len(generated),
            "sampled": len(picked), **counts, "select": select, "selections": selections,
            "seconds": round(time.perf_counter() - started, 1),
            "survivors": survivors, "error_mutants": errors, "crashed_mutants": crashes}


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


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: every mutated file is restored


@contextlib.contextmanager
def runner_of(kind: str, work: Path, env: dict[str, str]) -> Iterator[Callable[..., Outcome]]:
    """A module run's test runner, ``fork`` (:class:`ForkRunner`) or ``subprocess``
    (:func:`runner_in`), stopped after the run."""
    if kind == "subprocess":
        yield runner_in(work, env)
        return
    with ForkRunner(work, env) as runner:
        yield runner


def check(modules: list[str], work: Path,
          runner_for: Callable[[str], contextlib.AbstractContextManager], *, max_mutants: int,
          log: Callable[[str], None] = print) -> dict:
    """``--check``: each module's baseline and canary (:func:`check_module`, with the runner
    ``runner_for(module)`` gives), the baseline once more with the module's file written anew
    as a mutant's is, its mutant count and the time its run of at most ``max_mutants`` would
    take: the runs here and each mutant at the faster baseline (at most: a killed mutant stops
    at its first failure, though a hang takes three times as long). The first run in a copy
    compiles numba's cached kernels into it (journal.py's tests: 41 s, then 6 s); a rewritten
    file's own kernels compile again, for every mutant, and in the second run here."""
    results = {}
    for module in modules:
        started = time.perf_counter()
        with runner_for(module) as run:
            result = check_module(module, work, run)
            if "error" not in result:
                path = work / module
                with applied(path, path.read_text(encoding="utf-8")):  # the same text, anew
                    again = run(*_tests_for(module, slow=False), result["timeout_seconds"])
                result["baseline_again_seconds"] = round(again.seconds, 1)
        generated = len(enumerate_mutants((work / module).read_text(encoding="utf-8"), module))
        sampled = min(generated, max_mutants)
        each = min(result["baseline_seconds"], result.get("baseline_again_seconds", math.inf))
        result.update(generated=generated, sampled=sampled,
                      check_seconds=round(time.perf_counter() - started, 1),
                      estimate_seconds=round(time.perf_counter() - started + sampled * each))
        results[module] = result
        log(f"{module}: baseline {result['baseline_seconds']:.1f} s, "
            + (result["error"] if "error" in result else
               f"again {result['baseline_again_seconds']:.1f} s, canary killed "
               f"({result['canary_seconds']:.1f} s), {generated} mutants, {sampled} to run: "
               f"about {result['estimate_seconds'] / 60:.1f} min"))
    return results


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
    parser.add_argument("--runner", choices=("fork", "subprocess"), default="fork",
                        help="fork (default): a process per module imports torch and the rest "
                             "once and forks each test run from it; subprocess: a new "
                             "`python -m pytest` per test run, 5-9 s slower each")
    parser.add_argument("--select", choices=("covering", "all"), default="covering",
                        help="covering (default): each mutant runs the fast tests that execute "
                             "its statement, found by one coverage-measured run per module; "
                             "all: every fast test for every mutant")
    parser.add_argument("--jobs", type=int, default=1,
                        help="drivers run side by side, each with its share of the modules in "
                             "its own copy of the repository (default 1)")
    parser.add_argument("--update", action="store_true",
                        help="keep the modules of --out this run does not mutate (each module "
                             "records the commit it was measured at)")
    parser.add_argument("--reasons-from", type=Path,
                        help="the report whose survivor reasons are kept (default: --out)")
    parser.add_argument("--recheck-slow", action="store_true",
                        help="run each module's slow tests on the mutants its fast ones miss")
    parser.add_argument("--list", action="store_true",
                        help="print each module's tests and mutant counts; run nothing")
    parser.add_argument("--check", action="store_true",
                        help="run each module's tests unmutated and with the canary only, no "
                             "mutant, and estimate the full run's time; writes no --out")
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

    if args.jobs > 1 and len(modules) > 1 and not args.check:
        return _run_in_jobs(args, argv, modules)
    reasons = load_reasons(args.reasons_from or args.out)
    began = time.perf_counter()
    work = make_work_copy(REPO, args.work / "repo")
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    demo_imports = build_demo(work, env, args.work / "demo")

    def env_of(module: str) -> dict[str, str]:
        # each test's own timeout in a mutant's run, from the times its coverage run measures;
        # numba's cache kept per kernel, so that a mutant recompiles only what it can change
        timed = {**env, **LOCATOR_ENV, TEST_SECONDS_ENV: f"{coverage_data(work, module)}.seconds"}
        # a module the demo is built with must build it mutated: the suite's fixture then
        return timed if module in demo_imports else {**timed, DEMO_ENV: str(args.work / "demo")}

    if args.check:
        print(f"work copy and demo: {time.perf_counter() - began:.0f} s", flush=True)
        try:
            results = check(modules, work,
                            lambda module: runner_of(args.runner, work, env_of(module)),
                            max_mutants=args.max_mutants, log=lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            return 130
        total = time.perf_counter() - began + sum(
            r["estimate_seconds"] - r["check_seconds"] for r in results.values())
        print(f"a full run (--max-mutants {args.max_mutants}, --runner {args.runner}): about "
              f"{total / 60:.0f} min; {sum('error' in r for r in results.values())} of "
              f"{len(results)} modules failed their check")
        return 1 if any("error" in r for r in results.values()) else 0
    from omniscale.tools.bench.provenance import provenance

    # the commit the mutants were made from (a tree with uncommitted changes says so)
    measured_at = provenance()
    report = {"command": " ".join(["tools/bench/mutation.py", *(argv or sys.argv[1:])]),
              **measured_at, "tool": {"name": "cosmic-ray", "version": version("cosmic-ray")},
              "seed": args.seed, "max_mutants": args.max_mutants, "runner": args.runner,
              "select": args.select, "jobs": 1, "modules": {}}
    base = _previous_for_update(args)
    started = time.perf_counter()
    try:
        for module in modules:
            print(f"{module}: {' '.join(MODULE_TESTS[module].fast)}", flush=True)
            with runner_of(args.runner, work, env_of(module)) as runner:
                result = run_module(module, work, runner, max_mutants=args.max_mutants,
                                    seed=args.seed, recheck_slow=args.recheck_slow,
                                    reasons=reasons, select=args.select,
                                    log=lambda line: print(line, flush=True))
            report["modules"][module] = {**result, "demo_prebuilt": module not in demo_imports,
                                         "git_commit": measured_at["git_commit"],
                                         "git_dirty": measured_at["git_dirty"]}
            _write(args.out, report, started, base)
    except KeyboardInterrupt:
        report["interrupted"] = True
        _write(args.out, report, started, base)
        return 130
    _summarize(report)
    return 0


def _run_in_jobs(args: argparse.Namespace, argv: list[str] | None, modules: list[str]) -> int:
    """``--jobs N``: :mod:`mutation_jobs` runs the modules in N drivers; one report."""
    from importlib.metadata import version

    from omniscale.tools.bench.mutation_jobs import run_jobs, share
    from omniscale.tools.bench.provenance import provenance

    previous = json.loads(args.out.read_text()).get("modules", {}) if args.out.is_file() else {}
    weights = {m: previous.get(m, {}).get("seconds") or min(
        len(enumerate_mutants((REPO / m).read_text(), m)), args.max_mutants) for m in modules}
    settings = [f"--max-mutants={args.max_mutants}", f"--seed={args.seed}",
                f"--runner={args.runner}", f"--select={args.select}",
                *(["--recheck-slow"] if args.recheck_slow else [])]
    report = {"command": " ".join(["tools/bench/mutation.py", *(argv or sys.argv[1:])]),
              **provenance(), "tool": {"name": "cosmic-ray", "version": version("cosmic-ray")},
              "seed": args.seed, "max_mutants": args.max_mutants, "runner": args.runner,
              "select": args.select, "jobs": args.jobs, "modules": {}}
    base = _previous_for_update(args)
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    merged, finished = run_jobs(share(weights, args.jobs), settings, args.work,
                                args.reasons_from or args.out)
    report["modules"] = {m: merged[m] for m in modules if m in merged}
    if not finished:
        report["interrupted"] = True
    _write(args.out, report, started, base)
    _summarize(report)
    return 0 if finished else 130


def _write(out: Path, report: dict, started: float, base: dict | None = None) -> None:
    """The report to ``out``; with ``base`` (``--update``), its modules that this run did not
    mutate kept, in the order of :data:`MODULE_TESTS`."""
    report["seconds"] = round(time.perf_counter() - started, 1)
    written = report
    if base is not None:
        modules = {**base.get("modules", {}), **report["modules"]}
        written = {**report, "modules": {m: modules[m] for m in MODULE_TESTS if m in modules},
                   "updated_modules": list(report["modules"])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(written, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
