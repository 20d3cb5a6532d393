"""The pytest plugin ``tools/bench/mutation.py`` loads into each test run of a mutant (``-p``):
it hands over the demo the driver built once, and, in a run measured by coverage, names the
coverage context after the test that runs (its node id), so that the driver learns which tests
execute each line of the mutated module, and writes the tests' order and times beside the data
file. In a mutant's run, each test with a measured time gets a timeout of its own
(:func:`hang_timeout` of that time), so a mutant that makes one quick test hang is cut after
that test's measure, not after the whole run's.

Lines run outside any one test get the empty context: the imports of collection, and fixtures
shared by several tests (session, package, module or class scope), whose results later tests
use without running their lines again.

The Python processes a measured test starts (a plane, a multi-rank run's ranks) measure the
module too, under the test's context: coverage's start-up hook (the ``.pth`` file it installs)
reads the configuration this plugin puts in their environment, and each writes a data file of
its own beside the run's (:data:`SUBPROCESS_DATA`). A line one test runs in its own process
and another only in its ranks then selects both."""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import pytest

DEMO_ENV = "OMNISCALE_MUTATION_DEMO"  # the prebuilt demo's directory
TEST_SECONDS_ENV = "OMNISCALE_MUTATION_TEST_SECONDS"  # the coverage run's per-test times
OUTSIDE_TESTS = ""  # the context of lines no single test owns
SPAWN_RANKS_ENV = "OMNISCALE_SPAWN_RANKS"  # tools.train.fork_server.SPAWN_ENV (no import here)
SUBPROCESS_DATA = "-subprocesses"  # the tests' subprocesses' data files: the run's + this + .*

_test = OUTSIDE_TESTS  # the node id of the test running now
_started = 0.0  # when it started (time.perf_counter)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    """The session's ``demo_root`` is the prebuilt demo, when the driver says where it is;
    otherwise the suite's own fixture builds it."""
    demo = os.environ.get(DEMO_ENV)
    if not demo or fixturedef.argname != "demo_root":
        return None
    fixturedef.cached_result = (Path(demo), fixturedef.cache_key(request), None)
    return Path(demo)


def hang_timeout(took: float) -> float:
    """How long a run whose unmutated time was ``took`` seconds may take before it counts as
    a hang: three times as long, and at least 30 s more (imports, a shared fixture set up by
    whichever test comes first, a busy machine)."""
    return max(3 * took, took + 30)


def pytest_collection_modifyitems(config, items):
    """A mutant's run (not the coverage run that measures the times): each test measured
    there times out at :func:`hang_timeout` of its time (pytest-timeout: the test fails, and
    the next one runs)."""
    path = os.environ.get(TEST_SECONDS_ENV)
    if not path or _measuring() is not None or not os.path.isfile(path):
        return
    with open(path) as times:
        seconds = dict(line.rstrip("\n").rsplit("\t", 1) for line in times if "\t" in line)
    for item in items:
        if item.nodeid in seconds:  # before the test's own mark: the closest one counts
            item.add_marker(pytest.mark.timeout(hang_timeout(float(seconds[item.nodeid]))),
                            append=False)


def _measuring():
    """The coverage measuring this run, or None."""
    coverage = sys.modules.get("coverage")  # imported only by a measured run
    return coverage.Coverage.current() if coverage is not None else None


def _switch(context: str) -> None:
    if (measuring := _measuring()) is not None:
        measuring.switch_context(context)
        _measure_subprocesses(measuring, context)


def _measure_subprocesses(measuring, context: str) -> None:
    """Python processes started from now on measure what this run does, under ``context``,
    each into its own data file (coverage's parallel mode)."""
    config = copy.copy(measuring.config)
    config.context = context
    config.parallel = True
    config.data_file = f"{measuring.config.data_file}{SUBPROCESS_DATA}"
    os.environ["COVERAGE_PROCESS_CONFIG"] = config.serialize()  # coverage.process_startup's
    # ranks spawned, not forked from a server started under an earlier test
    os.environ[SPAWN_RANKS_ENV] = "1"


@pytest.hookimpl(wrapper=True, specname="pytest_fixture_setup")
def pytest_fixture_setup_of_shared(fixturedef, request):  # pytest reads pytest_* only
    if fixturedef.scope == "function":
        return (yield)
    _switch(OUTSIDE_TESTS)
    try:
        return (yield)
    finally:
        _switch(_test)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _test, _started
    _test, _started = item.nodeid, time.perf_counter()
    if (measuring := _measuring()) is not None:
        _switch(_test)
        with open(f"{measuring.config.data_file}.tests", "a") as order:  # the run's order
            order.write(_test + "\n")


def pytest_runtest_logfinish(nodeid, location):
    global _test
    if (measuring := _measuring()) is not None:  # its time, setup and teardown included
        with open(f"{measuring.config.data_file}.seconds", "a") as times:
            times.write(f"{nodeid}\t{time.perf_counter() - _started:.3f}\n")
    _test = OUTSIDE_TESTS
    _switch(_test)
