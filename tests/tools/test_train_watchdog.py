"""Hangs (``tools.train.watchdog``) with real processes: rank 1 of 2 made to hang inside step 1
(``debug.hang``). Its watchdog fires within its bound, the stack dump names the hang site, and
the run ends with one line naming the rank and where it waits; the rank waiting for it in a
collective does not take the blame."""

from __future__ import annotations

import re

import pytest

from omniscale.errors import UserError
from omniscale.tools.train.launch import train
from tests.tools.train_runs import demo_sets

BOUND_S = 4.0


@pytest.mark.timeout(180)
def test_a_hung_rank_is_named_with_its_stack_and_the_run_stops(demo, tmp_path):
    run = tmp_path / "run"
    sets = demo_sets(demo, run, **{"data.global_batch_tokens": 4096,
                                   "data.micro_batch_tokens": 2048, "steps": 3,
                                   "watchdog.step_timeout_s": BOUND_S,
                                   "debug.hang": "{step: 1, rank: 1}"})
    with pytest.raises(UserError) as stopped:
        train("configs/demo_omni.yaml", nproc=2, progress=False, sets=sets)
    line = str(stopped.value)
    assert "\n" not in line
    found = re.match(r"watchdog: rank 1 finished no step for (\d+) s \(step 1; bound "
                     r"watchdog.step_timeout_s=4\), waiting in \S+faults.py:\d+ before_step; "
                     r"every thread's stack in (\S+)$", line)
    assert found, line
    assert BOUND_S <= int(found[1]) <= BOUND_S + 2  # checked every second
    dump = (run / "hang-rank1.txt").read_text()
    assert found[2] == str(run / "hang-rank1.txt")
    assert "before_step" in dump and "trainer.py" in dump  # the main thread's stack
    assert "Thread 0x" in dump and dump.count("File ") > 5  # every thread's


def test_a_paused_watchdog_gives_no_verdict_and_a_full_bound_after(tmp_path):
    """An evaluation runs paused (its length is the eval set's, not a step's)."""
    import time

    from omniscale.tools.train.watchdog import StepWatchdog

    dog = StepWatchdog(100.0, tmp_path, 0, first_step=0)
    try:
        now = time.monotonic()
        assert dog.overdue(now + 150) is None and dog.overdue(now + 250) is not None  # 1st: 2x
        with dog.paused(0):
            assert dog.overdue(time.monotonic() + 10_000) is None
        now = time.monotonic()
        assert dog.overdue(now + 50) is None and dog.overdue(now + 150) is not None
    finally:
        dog.close()
    assert not (tmp_path / "hang-rank0.txt").exists()  # no hang: no file
