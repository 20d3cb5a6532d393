"""Hypothesis in CI (the environment variable CI set, as CI services do): derandomized, so a
run examines the same cases as the run before it and a red build is the code's doing, not the
draw's; no deadline (a shared runner's timing is no property of the code). Local runs keep
Hypothesis' random search, which finds new cases. A test's own `@settings` still override."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None,
                          print_blob=True)
if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
    settings.load_profile("ci")


def pytest_configure(config):
    """The controller of an xdist run, before its workers start: numba's kernels compiled into
    their cache once (``tools/warm_kernels.py``), not by both workers and their ranks' planes
    at once on a fresh clone (about 40 s of CPU each); a cached kernel costs only its load."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        from omniscale.tools.warm_kernels import warm

        warm(progress=lambda line: None)


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory, worker_id):
    """The tiny demo, indexed, shared by the whole run -- by every xdist worker too
    (``tests.run_once``): read it, never write into it (copy it with
    ``tests.demo_data.copy_demo`` first)."""
    from tests.demo_data import build
    from tests.run_once import once_per_run

    return once_per_run(tmp_path_factory, worker_id, "demo", lambda d: build(d / "demo"))
