"""The mutation driver's own logic (``tools/bench/mutation.py``), without a real mutation run:
the module -> tests mapping, the reproducible sample, the JSON of a run and ``--check``'s
estimate (on a hand-checked module with a stand-in test runner), the restore-by-hash safety and
the work copy (the test runners and coverage selection: test_bench_mutation_runners.py)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from omniscale.tools.bench import mutation, mutation_plugin, mutation_report
from omniscale.tools.bench.mutation import Mutant
from omniscale.tools.bench.mutation_jobs import share
from omniscale.tools.bench.mutation_runners import Outcome

REPO = Path(__file__).resolve().parents[2]

# Issue #46's list, written here apart from the driver's mapping (balancer: its split, pack and
# assign modules).
ISSUE_MODULES = {
    "dataplane/journal.py", "dataplane/restore.py", "dataplane/plane_state.py",
    "dataplane/mixer.py", "dataplane/catalog.py", "dataplane/windows.py",
    "tools/train/guard.py", "tools/train/checkpoint.py", "tools/train/optim_groups.py",
    "tools/train/held_out.py", "tools/train/records.py",
    "loaders/chat.py", "loaders/conversation.py", "loaders/sequence.py",
    "loaders/remote_cache.py", "loaders/ranged_file.py", "loaders/assemble.py",
    "balancer/split.py", "balancer/pack.py", "balancer/assign.py",
    "parallel/reshard.py",
}


def test_every_module_of_the_issue_is_mapped_to_tests_that_exist():
    assert set(mutation.MODULE_TESTS) == ISSUE_MODULES
    for module, tests in mutation.MODULE_TESTS.items():
        assert (REPO / module).is_file(), module
        assert tests.fast, f"{module}: no tests to run against its mutants"
        for node in tests.fast + tests.slow:
            file, _, name = node.partition("::")
            assert file.startswith("tests/") and (REPO / file).is_file(), (module, node)
            if name:  # a single test: it must exist under that name
                test_module = importlib.import_module(file[:-3].replace("/", "."))
                assert callable(getattr(test_module, name, None)), (module, node)


# Test files that import a mapped module (its name) but do not run against its mutants, and why.
NOT_RUN_AGAINST = {
    ("loaders/sequence.py", "tests/loaders/test_collate.py"):
        "builds MediaItems as collate's input; sequence.py's own tests run against it",
    ("dataplane/journal.py", "tests/tools/test_rank_speeds.py"):
        "2-rank training runs that only read the plane's log for rank speeds",
    ("dataplane/journal.py", "tests/tools/test_train_optim_groups.py"):
        "training runs; the journal's use there is the plane's, run by its own tests",
    ("dataplane/journal.py", "tests/tools/test_train_resume.py"):
        "training runs reading the log's records to compare steps",
    ("dataplane/journal.py", "tests/tools/test_train_sp.py"):
        "SP training runs replaying the plane's log to read the plans they trained",
    ("dataplane/plane_state.py", "tests/tools/test_train_sp.py"):
        "SP training runs replaying the plane's log to read the plans they trained",
    ("dataplane/restore.py", "tests/tools/test_train_sp.py"):
        "SP training runs replaying the plane's log to read the plans they trained",
    ("tools/train/checkpoint.py", "tests/tools/test_model_hf.py"):
        "Hugging Face export from a checkpoint: loading is tested by the checkpoint files",
    ("tools/train/optim_groups.py", "tests/tools/test_example_configs.py"):
        "builds the example configs' models on meta; no step taken",
    ("loaders/conversation.py", "tests/loaders/import_fixtures.py"): "a fixture module",
    ("loaders/conversation.py", "tests/tools/test_demo.py"): "make demo end to end, minutes",
    ("loaders/sequence.py", "tests/backbone/omni_batches.py"): "a fixture module",
}


def _imported_modules(path: Path) -> set[str]:
    """The dotted names a Python file imports, and the names it imports from a package."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_every_test_file_that_imports_a_mapped_module_runs_against_it_or_says_why():
    imports = {str(p.relative_to(REPO)): _imported_modules(p)
               for p in (REPO / "tests").rglob("*.py")}
    unmapped = set()
    for module, tests in mutation.MODULE_TESTS.items():
        dotted = "omniscale." + module[:-3].replace("/", ".")
        mapped = {t.split("::")[0] for t in tests.fast + tests.slow}
        unmapped |= {(module, file) for file, names in imports.items()
                     if dotted in names and file not in mapped}
    assert unmapped == set(NOT_RUN_AGAINST)


def test_a_slow_test_inside_a_fast_file_is_deselected_from_the_fast_run():
    tests = mutation.ModuleTests(fast=("tests/a.py", "tests/b.py"),
                                 slow=("tests/a.py::test_long", "tests/c.py"))
    mutation.MODULE_TESTS["x.py"] = tests
    try:
        assert mutation._tests_for("x.py", slow=False) == (tests.fast, ("tests/a.py::test_long",))
        assert mutation._tests_for("x.py", slow=True) == (tests.slow, ())
    finally:
        del mutation.MODULE_TESTS["x.py"]


def _mutants(sites: int = 30) -> list[Mutant]:
    """Site i (line i + 1) has i % 5 + 1 mutants: 90 in all for 30 sites."""
    return [Mutant("m.py", f"op{k}", k, i + 1, 4) for i in range(sites) for k in range(i % 5 + 1)]


def test_the_sample_is_the_same_for_the_same_seed_in_any_process():
    mutants = _mutants()
    first = mutation.sample(mutants, 20, seed=7)
    assert first == mutation.sample(list(reversed(mutants)), 20, seed=7)  # input order: none
    assert first != mutation.sample(mutants, 20, seed=8)
    # another interpreter with another string-hash seed picks the same mutants
    probe = ("import json; from omniscale.tools.bench.mutation import Mutant, sample; "
             "m = [Mutant('m.py', f'op{k}', k, i + 1, 4) for i in range(30) "
             "for k in range(i % 5 + 1)]; "
             "print(json.dumps([[x.line, x.operator] for x in sample(m, 20, seed=7)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == [[x.line, x.operator] for x in first]


def test_the_sample_spreads_over_sites_before_taking_a_second_at_one():
    mutants = _mutants()
    few = mutation.sample(mutants, 20, seed=0)
    assert len(few) == 20 and len({m.line for m in few}) == 20  # 20 of the 30 sites, one each
    more = Counter(m.line for m in mutation.sample(mutants, 45, seed=0))
    # 30 sites: every one has its first before 15 of them get a second
    assert sum(more.values()) == 45 and set(more) == set(range(1, 31))
    assert max(more.values()) == 2
    assert set(mutation.sample(mutants, 500, seed=0)) == set(mutants)  # fewer than the limit


TINY = "def f(a, b):\n    return a < b\n"  # the module the stand-in test below checks


def _stand_in_runner(work: Path, calls: list):
    """Runs the stand-in "test suite" of TINY on the file as it is in ``work`` now: f(1, 2)
    is True and f(2, 1) is False. A mutant using ``is not`` stands for one that hangs."""

    def run(tests, deselect, timeout):
        source = (work / "pkg" / "tiny.py").read_text()
        calls.append(source)
        if " is not " in source:
            return Outcome("timed_out", timeout)
        scope: dict = {}
        try:
            exec(compile(source, "tiny.py", "exec"), scope)
            passed = scope["f"](1, 2) is True and scope["f"](2, 1) is False
        except Exception:
            passed = False
        return Outcome("survived" if passed else "killed", 0.1)
    return run


@pytest.fixture
def tiny_module(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "tiny.py").write_text(TINY)
    monkeypatch.setitem(mutation.MODULE_TESTS, "pkg/tiny.py",
                        mutation.ModuleTests(("tests/test_tiny.py",)))
    return tmp_path


def test_a_run_counts_and_lists_what_the_tests_miss(tiny_module):
    calls: list[str] = []
    before = hashlib.sha256(TINY.encode()).hexdigest()
    result = mutation.run_module("pkg/tiny.py", tiny_module, _stand_in_runner(tiny_module, calls),
                                 max_mutants=100, seed=0, select="all", log=lambda line: None)
    # hand-checked: `<` has 7 replacements; only `<=` passes both checks, `is not` "hangs"
    assert result["generated"] == result["sampled"] == 7
    assert (result["killed"], result["survived"], result["timed_out"], result["errors"]) == \
        (5, 1, 1, 0)
    assert result["survivors"] == [{
        "file": "pkg/tiny.py", "line": 2, "column": 13,
        "operator": "core/ReplaceComparisonOperator_Lt_LtE", "occurrence": 0,
        "diff": "-    return a < b\n+    return a <= b", "tests_run": "all", "reason": ""}]
    assert result["tests"] == ["tests/test_tiny.py"] and result["timeout_seconds"] > 0
    json.dumps(result)  # the report is JSON as it is
    # the baseline ran the module as it is, the canary could not import, then 7 mutants
    assert calls[0] == TINY and mutation.CANARY in calls[1] and len(calls) == 9
    assert len(set(calls[2:])) == 7 and TINY not in calls[2:]
    assert hashlib.sha256((tiny_module / "pkg" / "tiny.py").read_bytes()).hexdigest() == before


def test_a_reason_given_before_is_kept_for_the_same_mutation(tiny_module):
    key = ("pkg/tiny.py", "core/ReplaceComparisonOperator_Lt_LtE",
           "-    return a < b\n+    return a <= b")
    result = mutation.run_module("pkg/tiny.py", tiny_module, _stand_in_runner(tiny_module, []),
                                 max_mutants=100, seed=0, select="all",
                                 reasons={key: "equal on ints here"}, log=lambda line: None)
    assert [s["reason"] for s in result["survivors"]] == ["equal on ints here"]


@pytest.mark.parametrize("reason, slow_runs", [("equal on ints here", 0), ("", 1),
                                               ("needs a test: a < b on equal ints", 1)])
def test_the_slow_tests_recheck_a_survivor_unless_it_was_shown_equivalent(
        tiny_module, monkeypatch, reason, slow_runs):
    monkeypatch.setitem(mutation.MODULE_TESTS, "pkg/tiny.py", mutation.ModuleTests(
        ("tests/test_tiny.py",), ("tests/test_tiny_slow.py",)))
    calls: list[str] = []
    fast = _stand_in_runner(tiny_module, calls)
    slow_sources = []

    def run(tests, deselect, timeout):
        if tests == ("tests/test_tiny_slow.py",):
            slow_sources.append((tiny_module / "pkg" / "tiny.py").read_text())
            return Outcome("killed", 0.1)
        return fast(tests, deselect, timeout)

    key = ("pkg/tiny.py", "core/ReplaceComparisonOperator_Lt_LtE",
           "-    return a < b\n+    return a <= b")
    result = mutation.run_module("pkg/tiny.py", tiny_module, run, max_mutants=100, seed=0,
                                 select="all", recheck_slow=True, reasons={key: reason},
                                 log=lambda line: None)
    [survivor] = result["survivors"]
    assert slow_sources == ["def f(a, b):\n    return a <= b\n"] * slow_runs
    assert survivor["slow_tests"] == ("killed" if slow_runs else "not run: equivalent")
    assert survivor["reason"] == reason


def test_reasons_are_read_back_from_a_previous_report(tiny_module, tmp_path):
    result = mutation.run_module("pkg/tiny.py", tiny_module, _stand_in_runner(tiny_module, []),
                                 max_mutants=100, seed=0, select="all", log=lambda line: None)
    result["survivors"][0]["reason"] = "equal on ints here"
    unexplained = {**result["survivors"][0], "diff": "-a\n+b", "reason": ""}  # not kept
    claimed = {**result["survivors"][0], "diff": "-c\n+d",  # measured again, not carried
               "reason": "killed by tests/test_tiny.py::test_f"}
    result["survivors"] += [unexplained, claimed]
    out = tmp_path / "mutation.json"
    out.write_text(json.dumps({"modules": {"pkg/tiny.py": result}}))
    assert mutation_report.load_reasons(out) == {
        ("pkg/tiny.py", "core/ReplaceComparisonOperator_Lt_LtE",
         "-    return a < b\n+    return a <= b"): "equal on ints here"}
    assert mutation_report.load_reasons(tmp_path / "absent.json") == {}


def test_tests_that_fail_unmutated_or_miss_the_canary_stop_the_module(tiny_module):
    failing = mutation.run_module("pkg/tiny.py", tiny_module,
                                  lambda *a: Outcome("killed", 1.0, "boom"),
                                  max_mutants=100, seed=0, select="all", log=lambda line: None)
    assert "fail unmutated" in failing["error"] and "survivors" not in failing
    blind = mutation.run_module("pkg/tiny.py", tiny_module,
                                lambda *a: Outcome("survived", 1.0),
                                max_mutants=100, seed=0, select="all", log=lambda line: None)
    assert "work copy" in blind["error"] and "survivors" not in blind
    outcomes = iter([Outcome("survived", 1.0), Outcome("error", 1.0, "no such option", 4)])
    broken = mutation.run_module("pkg/tiny.py", tiny_module, lambda *a: next(outcomes),
                                 max_mutants=100, seed=0, select="all", log=lambda line: None)
    assert broken["error"] == ("the canary's run was no test failure (error, pytest's exit "
                               "code 4): no such option") and "survivors" not in broken
    assert (tiny_module / "pkg" / "tiny.py").read_text() == TINY


@pytest.mark.parametrize("ending", [RuntimeError, KeyboardInterrupt])
def test_a_mutated_file_is_restored_byte_for_byte_however_the_run_ends(tmp_path, ending):
    path = tmp_path / "m.py"
    original = b"x = 1\r\ny = '\xc3\xa9'\r\n"  # CRLF and UTF-8: bytes, not text, come back
    path.write_bytes(original)
    with pytest.raises(ending):
        with mutation.applied(path, "x = 2\n"):
            assert path.read_text() == "x = 2\n"
            raise ending()
    assert path.read_bytes() == original


def test_a_restore_that_does_not_reproduce_the_original_stops_the_run(tmp_path, monkeypatch):
    path = tmp_path / "m.py"
    path.write_bytes(b"x = 1\n")
    real = Path.write_bytes
    # a disk that loses the last byte of what is written back
    monkeypatch.setattr(Path, "write_bytes", lambda self, data: real(self, data[:-1]))
    with pytest.raises(mutation.RestoreError):
        with mutation.applied(path, "x = 2\n"):
            pass


def test_cosmic_rays_mutants_of_a_line_apply_as_listed():
    mutants = mutation.enumerate_mutants(TINY, "tiny.py")
    assert {m.operator.rsplit("_", 1)[1] for m in mutants} == {
        "Eq", "NotEq", "LtE", "Gt", "GtE", "Is", "IsNot"}
    lte = next(m for m in mutants if m.operator.endswith("_LtE"))
    assert mutation.mutate(TINY, lte) == "def f(a, b):\n    return a <= b\n"
    assert (lte.line, lte.column) == (2, 13)


def test_annotations_python_never_evaluates_get_no_mutants():
    body = "def f(a: int | None, b=1 | 2) -> str | None:\n    return a\n"
    postponed = mutation.enumerate_mutants("from __future__ import annotations\n" + body, "m.py")
    # only the default value's `|` (line 2 there) is code that runs
    assert {(m.line, m.column) for m in postponed if "BitOr" in m.operator} == {(2, 25)}
    evaluated = mutation.enumerate_mutants(body, "m.py")  # annotations evaluated at def time
    assert {(m.line, m.column) for m in evaluated if "BitOr" in m.operator} == {
        (1, 13), (1, 25), (1, 37)}


def test_the_work_copy_is_the_working_tree_outside_the_repository(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / "run.log").write_text("ignored\n")
    with pytest.raises(ValueError, match="outside"):
        mutation.make_work_copy(repo, repo / "work")
    work = mutation.make_work_copy(repo, tmp_path / "work")
    assert (work / "pkg" / "a.py").read_text() == "A = 1\n" and not (work / "run.log").exists()
    (work / "pkg" / "a.py").write_text("A = 2\n")
    assert (repo / "pkg" / "a.py").read_text() == "A = 1\n"
    (repo / "pkg" / "b.py").write_text("B = 1\n")
    again = mutation.make_work_copy(repo, tmp_path / "work")  # fresh: the old copy wiped
    assert (again / "pkg" / "a.py").read_text() == "A = 1\n" and (again / "pkg" / "b.py").exists()


def test_the_plugin_hands_over_the_prebuilt_demo_only_when_told(monkeypatch, tmp_path):
    fixture = SimpleNamespace(argname="demo_root", cache_key=lambda request: None,
                              cached_result=None)
    monkeypatch.delenv(mutation_plugin.DEMO_ENV, raising=False)
    assert mutation_plugin.pytest_fixture_setup(fixture, None) is None  # the suite builds it
    monkeypatch.setenv(mutation_plugin.DEMO_ENV, str(tmp_path))
    assert mutation_plugin.pytest_fixture_setup(fixture, None) == tmp_path
    assert fixture.cached_result == (tmp_path, None, None)
    other = SimpleNamespace(argname="demo", cache_key=lambda request: None, cached_result=None)
    assert mutation_plugin.pytest_fixture_setup(other, None) is None


def test_each_measured_test_of_a_mutants_run_times_out_at_its_own_measure(tmp_path):
    """The hook marks each test the coverage run timed, its mark before the test's own (the
    closest wins); a real pytest run reads the mark it put there."""
    (tmp_path / "test_timed.py").write_text(
        "def test_quick(request):\n"
        "    assert request.node.get_closest_marker('timeout').args[0] == 30.5\n\n"
        "import pytest\n\n"
        "@pytest.mark.timeout(7)\n"
        "def test_slow(request):\n"
        "    assert request.node.get_closest_marker('timeout').args[0] == 60.0\n\n"
        "@pytest.mark.timeout(7)\n"
        "def test_new(request):  # not measured: keeps its own\n"
        "    assert request.node.get_closest_marker('timeout').args[0] == 7\n")
    seconds = tmp_path / "coverage-m.seconds"
    seconds.write_text("test_timed.py::test_quick\t0.500\ntest_timed.py::test_slow\t20.000\n")
    env = {**os.environ, mutation_plugin.TEST_SECONDS_ENV: str(seconds)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "omniscale.tools.bench.mutation_plugin", "test_timed.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "3 passed" in run.stdout
    assert mutation_plugin.hang_timeout(0.5) == 30.5 and mutation_plugin.hang_timeout(20) == 60


def test_check_reports_the_baseline_the_canary_and_the_time_of_a_run(tiny_module):
    calls: list[str] = []
    stand_in = _stand_in_runner(tiny_module, calls)

    def timed(tests, deselect, timeout):  # the stand-in's outcomes, 30 s, then 20, then 10
        outcome = stand_in(tests, deselect, timeout)
        return dataclasses.replace(outcome, seconds=(30.0, 20.0, 10.0)[len(calls) - 1])

    lines: list[str] = []
    results = mutation.check(["pkg/tiny.py"], tiny_module,
                             lambda module: contextlib.nullcontext(timed),
                             max_mutants=5, log=lines.append)
    result = results["pkg/tiny.py"]
    # no mutant ran: the module as it is, with the canary, as it is again
    assert calls == [TINY, TINY + mutation.CANARY, TINY]
    assert (result["baseline_seconds"], result["canary_seconds"],
            result["baseline_again_seconds"]) == (30.0, 20.0, 10.0)
    assert (result["generated"], result["sampled"]) == (7, 5) and "error" not in result
    assert result["estimate_seconds"] == 5 * 10  # 5 mutants at the faster baseline's 10 s
    assert lines == ["pkg/tiny.py: baseline 30.0 s, again 10.0 s, canary killed (20.0 s), "
                     "7 mutants, 5 to run: about 0.8 min"]
    assert (tiny_module / "pkg" / "tiny.py").read_text() == TINY


def test_modules_are_shared_among_jobs_longest_first():
    assert share({"a": 5, "b": 4, "c": 3, "d": 3}, 2) == [["a", "d"], ["b", "c"]]
    assert share({"a": 1, "b": 1}, 4) == [["a"], ["b"]]  # no empty job


def test_an_update_keeps_the_modules_it_did_not_run_and_refuses_another_sample(tmp_path):
    out = tmp_path / "mutation.json"
    old = {"seed": 0, "max_mutants": 100, "git_commit": "abc", "git_dirty": False, "modules": {
        "parallel/reshard.py": {"killed": 1}, "dataplane/journal.py": {"killed": 2}}}
    out.write_text(json.dumps(old))
    args = SimpleNamespace(update=True, out=out, seed=0, max_mutants=100)
    base = mutation._previous_for_update(args)
    new = {"seed": 0, "max_mutants": 100, "modules": {"dataplane/journal.py": {"killed": 3},
                                                      "balancer/pack.py": {"killed": 4}}}
    mutation._write(out, new, time.perf_counter(), base)
    written = json.loads(out.read_text())
    # the new results win, the others stay, in the mapping's order
    assert written["modules"] == {"dataplane/journal.py": {"killed": 3},
                                  "balancer/pack.py": {"killed": 4},
                                  # measured at the old report's commit
                                  "parallel/reshard.py": {"killed": 1, "git_commit": "abc",
                                                          "git_dirty": False}}
    assert written["updated_modules"] == ["dataplane/journal.py", "balancer/pack.py"]
    with pytest.raises(SystemExit, match="seed 0, this run 1"):
        mutation._previous_for_update(SimpleNamespace(update=True, out=out, seed=1,
                                                      max_mutants=100))
    assert mutation._previous_for_update(SimpleNamespace(update=False, out=out, seed=1,
                                                         max_mutants=100)) is None


def test_crashes_in_an_older_report_are_told_from_errors_by_faulthandlers_last_line():
    crash = {"line": 3, "output": "..., PIL._imagingft, regex._regex (total: 132)\n"}
    error = {"line": 4, "output": "ERROR: usage: no such option"}
    old = {"killed": 5, "errors": 2, "error_mutants": [crash, error]}
    assert mutation_report.reclassify_crashes(old) == {
        "killed": 5, "errors": 1, "crashed": 1, "error_mutants": [error],
        "crashed_mutants": [crash]}
    assert mutation_report.reclassify_crashes({"errors": 1, "error_mutants": [error]}) == {
        "errors": 1, "error_mutants": [error]}
