"""The suite's own scheduling: `make test` runs on two xdist workers with ``--dist loadgroup``,
and the Ray tests keep to one worker (their ``xdist_group``) so that no two Ray clusters start
at once on two cores. On pytest 9.2 that grouping silently stopped (pytest-dev/pytest-xdist
#1386): the tests were dealt out one by one, the Ray clusters started side by side and each
worker built the Ray modules' fixtures again. Run here on two tiny files of one group."""

from __future__ import annotations

import re
import subprocess
import sys

GROUPED = """
import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("i", range(4))
def test_member(i):
    pass
"""


def test_a_group_runs_on_one_worker(tmp_path):
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(GROUPED)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", "-v", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    workers = re.findall(r"^\[(gw\d)\] .*PASSED", done.stdout, flags=re.M)
    assert len(workers) == 8 and len(set(workers)) == 1, done.stdout[-2000:]
