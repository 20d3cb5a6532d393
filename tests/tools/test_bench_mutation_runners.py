"""The mutation driver's test runners (``tools/bench/mutation_runners.py``) and coverage
selection (``mutation_coverage.py``) on tiny test files: the fork runner answers with pytest's
exit codes, imports the project in each child and never in the server, kills a hang with its
process group and tells a crash from an error; a measured run names the tests that execute
each line, and covering selection finds what running every test finds."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import select
import shutil
import signal
import time
from pathlib import Path

import pytest

from omniscale.tools.bench import mutation
from omniscale.tools.bench.mutation_coverage import LineTests, statement_site
from omniscale.tools.bench.mutation_runners import Coverage, ForkRunner, runner_in

REPO = Path(__file__).resolve().parents[2]


# The fork runner, on a stand-in of the work copy: the `omniscale` package (its __init__ stamped
# with the pid of the process that imports it) and this driver, which every run loads as a
# pytest plugin, and tiny test files.
FORK_TESTS = {
    "test_passes.py": "def test_sum():\n    assert 1 + 1 == 2\n",
    "test_fails.py": "def test_sum():\n    assert 1 + 1 == 3\n",
    "test_none.py": "X = 1\n",
    "test_fresh_import.py": (
        "import os\n\nimport omniscale\n\n\n"
        "def test_omniscale_is_the_copys_imported_in_this_process():\n"
        "    assert omniscale.__file__ == os.path.join(os.getcwd(), 'omniscale', '__init__.py')\n"
        "    assert omniscale.IMPORTED_BY_PID == os.getpid()\n"),
    # a conftest that does not import (as the loaders' do with a module the demo imports broken)
    "broken/conftest.py": "raise RuntimeError('mutation canary')\n",
    "broken/test_in_broken.py": "def test_sum():\n    assert 1 + 1 == 2\n",
    # a test file that does not import (as one does with a module it imports broken)
    "test_unimportable.py": ("raise RuntimeError('mutation canary')\n\n\n"
                             "def test_sum():\n    assert 1 + 1 == 2\n"),
    # a module whose lines are run by one test, by a fixture several tests share, at import
    # and by no test; its tests
    "tinypkg/__init__.py": "",
    "tinypkg/calc.py": (
        "LIMIT = 3\n\n\n"
        "def clamp(x):\n    return x if x < LIMIT else LIMIT\n\n\n"
        "def double(x):\n    if x > 100:\n        raise ValueError(x)\n    return x * 2\n\n\n"
        "def table():\n    return [double(i) for i in range(3)]\n"),
    "test_calc.py": (
        "import pytest\n\nfrom tinypkg import calc\n\n\n"
        "@pytest.fixture(scope='module')\ndef shared_table():\n    return calc.table()\n\n\n"
        "def test_clamp():\n    assert calc.clamp(5) == 3 and calc.clamp(1) == 1\n\n\n"
        "def test_double():\n    assert calc.double(2) == 4\n\n\n"
        "def test_table(shared_table):\n    assert shared_table == [0, 2, 4]\n"),
    # runs calc in Python subprocesses only, as a multi-rank test runs a module in its ranks
    "test_calc_spawned.py": (
        "import subprocess, sys\n\n\n"
        "def test_clamp_and_double_in_subprocesses():\n"
        "    subprocess.run([sys.executable, '-c', 'from tinypkg import calc; "
        "assert calc.clamp(7) == 3'], check=True)\n"
        "    subprocess.run([sys.executable, '-c', 'from tinypkg import calc\\n"
        "try:\\n    calc.double(200)\\nexcept ValueError:\\n    pass'], check=True)\n"),
    # ends on a fatal signal, as numba code indexing out of bounds may
    # (pytest's faulthandler plugin reports it)
    "test_segfaults.py": ("import os, signal\n\n\n"
                          "def test_segfaults():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"),
    # starts a process (same group), writes both pids down, then never returns
    "test_hangs.py": (
        "import os, subprocess, sys, threading\n\n\n"
        "def test_hangs():\n"
        "    helper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "    with open('pids.tmp', 'w') as f:\n"
        "        f.write(f'{os.getpid()} {helper.pid}')\n"
        "    os.replace('pids.tmp', 'pids')\n"
        "    threading.Event().wait()\n"),
}


@pytest.fixture(scope="module")
def fork_work(tmp_path_factory):
    work = tmp_path_factory.mktemp("fork_work")
    shutil.copytree(REPO / "omniscale", work / "omniscale",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(work / "omniscale" / "__init__.py", "a") as init:
        init.write("\nIMPORTED_BY_PID = __import__('os').getpid()\n")
    (work / "tools" / "bench").mkdir(parents=True)
    (work / "tools" / "__init__.py").write_text("")
    for name in ("mutation_runners.py", "mutation_plugin.py"):  # the server's, each run's
        shutil.copy(REPO / "tools" / "bench" / name, work / "tools" / "bench")
    # what omniscale/__init__ needs to see a checkout (and map `omniscale.tools` to tools/)
    (work / "pyproject.toml").write_text("")
    (work / "dataplane").mkdir()
    (work / "dataplane" / "__init__.py").write_text("")
    for name, text in FORK_TESTS.items():
        (work / name).parent.mkdir(exist_ok=True)
        (work / name).write_text(text)
    return work


@pytest.fixture(scope="module")
def fork_runner(fork_work):
    env = {**os.environ, "PYTHONPATH": str(fork_work), "PYTHONDONTWRITEBYTECODE": "1"}
    with ForkRunner(fork_work, env) as runner:  # the real preload: torch and the rest
        yield runner


def test_the_fork_runner_answers_with_pytests_exit_code(fork_runner):
    passed = fork_runner(("test_passes.py",), (), 120)
    assert (passed.status, passed.code) == ("survived", pytest.ExitCode.OK)
    failed = fork_runner(("test_fails.py",), (), 120)
    assert (failed.status, failed.code) == ("killed", pytest.ExitCode.TESTS_FAILED)
    assert "assert (1 + 1) == 3" in failed.tail  # pytest's own report of the failure
    none = fork_runner(("test_none.py",), (), 120)
    assert (none.status, none.code) == ("error", pytest.ExitCode.NO_TESTS_COLLECTED)
    # a deselected failure is not run
    both = fork_runner(("test_passes.py", "test_fails.py"), ("test_fails.py::test_sum",), 120)
    assert (both.status, both.code) == ("survived", pytest.ExitCode.OK)


def test_tests_that_do_not_import_kill_but_another_usage_error_does_not(fork_runner):
    conftest = fork_runner(("broken/test_in_broken.py",), (), 120)
    assert (conftest.status, conftest.code) == ("killed", pytest.ExitCode.USAGE_ERROR)
    assert "RuntimeError: mutation canary" in conftest.tail
    by_file = fork_runner(("test_unimportable.py",), (), 120)
    assert (by_file.status, by_file.code) == ("killed", pytest.ExitCode.INTERRUPTED)
    # the same file named by node id: pytest calls it a usage error
    by_node = fork_runner(("test_unimportable.py::test_sum",), (), 120)
    assert (by_node.status, by_node.code) == ("killed", pytest.ExitCode.USAGE_ERROR)
    usage = fork_runner(("test_absent.py",), (), 120)  # pytest: file or directory not found
    assert (usage.status, usage.code) == ("error", pytest.ExitCode.USAGE_ERROR)


def test_each_child_imports_omniscale_itself_from_the_copy(fork_runner):
    outcome = fork_runner(("test_fresh_import.py",), (), 120)
    assert outcome.status == "survived", outcome.tail


def test_a_server_that_imported_the_project_refuses_to_run(fork_work, capfd):
    env = {**os.environ, "PYTHONPATH": str(fork_work), "PYTHONDONTWRITEBYTECODE": "1"}
    with pytest.raises(RuntimeError, match="server exited"):
        ForkRunner(fork_work, env, preload=("omniscale",))
    assert "the server imported the project's modules: ['omniscale']" in capfd.readouterr().err


def _ended(pid: int, within: float) -> bool:
    """Whether process ``pid`` has ended (or ends within ``within`` seconds: a SIGKILL is
    delivered, not instant)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], within)[0])
    finally:
        os.close(fd)


def test_a_hung_child_is_killed_at_the_timeout_with_what_it_started(fork_runner, fork_work):
    started = time.monotonic()
    outcome = fork_runner(("test_hangs.py",), (), 3)
    assert outcome.status == "timed_out" and outcome.code is None
    assert 3 <= time.monotonic() - started < 30
    child, helper = map(int, (fork_work / "pids").read_text().split())
    try:
        assert _ended(child, 10) and _ended(helper, 10)
    finally:
        if not _ended(helper, 0):
            os.kill(helper, signal.SIGKILL)
    after = fork_runner(("test_passes.py",), (), 120)  # the server goes on
    assert after.status == "survived"


@pytest.mark.parametrize("kind", ["fork", "subprocess"])
def test_a_measured_run_names_the_tests_that_execute_each_line(kind, fork_runner, fork_work,
                                                                tmp_path):
    runner = fork_runner if kind == "fork" else runner_in(fork_work, {
        **os.environ, "PYTHONPATH": str(fork_work), "PYTHONDONTWRITEBYTECODE": "1"})
    source = fork_work / "tinypkg" / "calc.py"
    data = tmp_path / "coverage"
    outcome = runner(("test_calc.py",), (), 300, Coverage(str(data), str(source)))
    assert outcome.status == "survived", outcome.tail
    measured = LineTests.read(data, source)
    lines = source.read_text().splitlines()
    tree = ast.parse(source.read_text())

    def tests_for(text):
        return measured.tests_for(tree, 1 + lines.index(text))

    assert measured.order == ("test_calc.py::test_clamp", "test_calc.py::test_double",
                              "test_calc.py::test_table")
    assert set(measured.seconds) == set(measured.order)
    assert all(0 <= took < 60 for took in measured.seconds.values())
    # a hang of a 1 s test is cut at 31 s, never past the whole set's timeout
    timed = dataclasses.replace(measured, seconds={"a": 1.0, "b": 20.0})
    assert timed.timeout_for(("a",), 300) == 31 and timed.timeout_for(("a", "b"), 300) == 63
    assert timed.timeout_for(("a", "b"), 50) == 50 and timed.timeout_for(("c",), 50) == 50
    assert tests_for("    return x if x < LIMIT else LIMIT") == (("test_calc.py::test_clamp",),
                                                                  "covering")
    # test_double calls it, and so does the fixture test_table's module shares
    assert tests_for("    return x * 2") == (None, "run outside a single test")
    assert tests_for("        raise ValueError(x)") == (None, "no test ran it")
    assert tests_for("LIMIT = 3") == (None, "runs at import")


@pytest.mark.parametrize("kind", ["fork", "subprocess"])
def test_a_line_a_test_runs_only_in_its_subprocesses_selects_that_test(kind, fork_runner,
                                                                      fork_work, tmp_path):
    runner = fork_runner if kind == "fork" else runner_in(fork_work, {
        **os.environ, "PYTHONPATH": str(fork_work), "PYTHONDONTWRITEBYTECODE": "1"})
    source = fork_work / "tinypkg" / "calc.py"
    data = tmp_path / "coverage"
    outcome = runner(("test_calc.py", "test_calc_spawned.py"), (), 300,
                     Coverage(str(data), str(source)))
    assert outcome.status == "survived", outcome.tail
    assert len(mutation.data_files_of_subprocesses(data)) == 2  # one per subprocess
    measured = LineTests.read(data, source)
    lines = source.read_text().splitlines()
    tree = ast.parse(source.read_text())
    spawned = "test_calc_spawned.py::test_clamp_and_double_in_subprocesses"
    # clamp: one test in its own process, the other only in its subprocesses
    assert measured.tests_for(tree, 1 + lines.index("    return x if x < LIMIT else LIMIT")) \
        == (("test_calc.py::test_clamp", spawned), "covering")
    # run by no test in the test run's own process
    assert measured.tests_for(tree, 1 + lines.index("        raise ValueError(x)")) == \
        ((spawned,), "covering")
    assert "COVERAGE_PROCESS_CONFIG" not in os.environ  # nothing left in this process


def test_covering_selection_finds_what_running_every_test_finds(fork_runner, fork_work,
                                                                 monkeypatch):
    monkeypatch.setitem(mutation.MODULE_TESTS, "tinypkg/calc.py",
                        mutation.ModuleTests(("test_calc.py",)))
    runs = {select: mutation.run_module("tinypkg/calc.py", fork_work, fork_runner,
                                        max_mutants=14, seed=1, select=select,
                                        log=lambda line: None)
            for select in ("all", "covering")}
    assert runs["covering"]["sampled"] == runs["all"]["sampled"] == 14

    def survivors(run):
        return {(s["line"], s["operator"], s["occurrence"]) for s in run["survivors"]}

    assert survivors(runs["covering"]) == survivors(runs["all"]) != set()  # 100 > 101, ...
    assert runs["covering"]["killed"] == runs["all"]["killed"] > 0
    assert set(runs["all"]["selections"]) == {"all"}
    assert runs["covering"]["selections"].get("covering", 0) > 0  # clamp's mutants: one test
    assert (fork_work / "tinypkg" / "calc.py").read_text() == FORK_TESTS["tinypkg/calc.py"]


SITES = """import numba
X = 1


class A:
    Y = 2

    def f(self, a=X + 1):
        if a > 1 and \\
                a < 5:
            return [a,
                    a + 1]
        return None


@numba.njit
def g(a):
    return a + 1
"""


def test_a_statement_site_is_its_header_and_import_or_compiled_code_runs_every_test():
    tree = ast.parse(SITES)
    lines = SITES.splitlines()

    def site(text):
        line = 1 + lines.index(text)
        found, why = statement_site(tree, line)
        return sorted(n - line for n in found), why  # relative to the line asked about

    assert site("X = 1") == ([0], "runs at import")
    assert site("    Y = 2") == ([0], "runs at import")
    assert site("    def f(self, a=X + 1):") == ([0], "runs at import")  # its defaults
    assert site("        if a > 1 and \\") == ([0, 1], "")  # the header, not the body
    assert site("                a < 5:") == ([-1, 0], "")
    assert site("                    a + 1]") == ([-1, 0], "")
    assert site("        return None") == ([0], "")
    assert site("    return a + 1") == ([0], "compiled")


def test_a_run_a_signal_ends_is_a_crash_not_an_error(fork_runner):
    crashed = fork_runner(("test_segfaults.py",), (), 120)
    assert (crashed.status, crashed.code) == ("crashed", -signal.SIGSEGV)
    # faulthandler's report, which pytest turns on, ends with the extension modules loaded
    assert re.search(r"\(total: \d+\)\s*$", crashed.tail), crashed.tail[-300:]


def test_in_a_measured_run_ranks_are_spawned_so_coverage_follows_them(monkeypatch):
    from omniscale.tools.bench import mutation_plugin
    from omniscale.tools.train import fork_server

    assert mutation_plugin.SPAWN_RANKS_ENV == fork_server.SPAWN_ENV  # the plugin imports none
    monkeypatch.delenv(fork_server.SPAWN_ENV, raising=False)
    assert fork_server.start_method() == "forkserver"
    monkeypatch.setenv(fork_server.SPAWN_ENV, "1")
    assert fork_server.start_method() == "spawn"
