"""Rank speeds (tools/train/rank_speeds.py): measured per rank from the plans' costs and the
compute clock, smoothed, told to the plane when they change -- and, in a real run where a
process outside the trainer takes half of one rank's core, that rank's share of the work
falls."""

from __future__ import annotations

import os

import pytest

from omniscale.dataplane.client import PlaneError
from omniscale.dataplane.journal import Journal
from omniscale.tools.train.launch import train
from omniscale.tools.train.rank_speeds import SpeedTracker
from tests.procs import Spinners
from tests.tools.train_runs import read_metrics


class _Plane:
    def __init__(self, fail: bool = False):
        self.told, self.fail = [], fail

    def set_speeds(self, step, speeds, from_step=None):
        if self.fail:
            raise PlaneError("speeds: unknown action\nmore")
        self.told.append((step, speeds))
        return {"applies_at_step": step + 2, "speeds": speeds}


def test_one_odd_step_moves_nothing_two_do():
    tracker, plane = SpeedTracker(), _Plane()
    for step in range(3):  # equal ranks: cost 10 in 1 s each
        assert tracker.observe(step, [10.0, 10.0], [1.0, 1.0]) == {"rank_speed": [1.0, 1.0]}
        assert tracker.tell(plane, writer=True, deterministic=False) is None
    tracker.observe(3, [10.0, 10.0], [1.0, 2.0])  # one slow step: the median holds
    assert tracker.tell(plane, writer=True, deterministic=False) is None
    fields = tracker.observe(4, [10.0, 5.0], [1.0, 1.0])  # two: rank 1 at half speed
    assert fields == {"rank_speed": [1.0, 0.5]}
    assert tracker.tell(plane, writer=True, deterministic=False) == \
        {"applies_at_step": 6, "speeds": [1.0, 0.5]}
    tracker.observe(5, [10.0, 5.2], [1.0, 1.0])  # within 10% of what the plane has
    assert tracker.tell(plane, writer=True, deterministic=False) is None
    for step in (6, 7):  # recovered: equal again, said once
        tracker.observe(step, [10.0, 9.8], [1.0, 1.0])
    tracker.tell(plane, writer=True, deterministic=False)
    assert plane.told == [(4, [1.0, 0.5]), (7, [])]


def test_planning_by_the_measured_speeds_evens_the_times_where_part_of_a_step_is_fixed():
    """A step costs every rank a fixed part whatever its share (placeholder micro-batches, the
    optimizer): rank r takes (20 + cost) / speed seconds, speeds 1 and 0.5, 100 cost units a
    step. A speed is cost over seconds at the share the rank had, so it is re-measured as the
    share moves; planning by it must settle where the times are even -- by hand, rank 1's cost
    c solves (20 + 100 - c) / 1 = (20 + c) / 0.5, c = 80 / 3 -- to within the tracker's 10%,
    not at the split the true speeds alone would give (100 / 3), where rank 1 is 14% slower."""
    tracker, told, true = SpeedTracker(), [], [1.0, 0.5]
    for step in range(12):
        speeds = told or [1.0, 1.0]  # a planner that splits the cost in proportion
        costs = [100 * s / sum(speeds) for s in speeds]
        secs = [(20 + c) / s for c, s in zip(costs, true)]
        tracker.observe(step, costs, secs)
        reply = tracker.tell(_Plane(), writer=True, deterministic=False)
        told = reply["speeds"] if reply else told
    assert 80 / 3 <= costs[1] <= 1.1 * 80 / 3, costs
    even = (20 + 80 / 3) / 0.5
    assert max(secs) <= 1.05 * even, (secs, even)


def test_only_rank_0_tells_and_not_in_deterministic_mode():
    for writer, deterministic in ((False, False), (True, True)):
        tracker, plane = SpeedTracker(window=1), _Plane()
        tracker.observe(0, [10.0, 10.0], [1.0, 3.0])
        assert tracker.tell(plane, writer, deterministic) is None and plane.told == []


def test_an_idle_rank_says_nothing_and_a_refusing_plane_costs_one_line(capsys):
    tracker = SpeedTracker(window=1)
    assert tracker.observe(0, [10.0, 0.0], [1.0, 0.1]) == {}  # rank 1 had no work
    tracker.observe(1, [10.0, 10.0], [1.0, 2.0])
    assert tracker.tell(_Plane(fail=True), writer=True, deterministic=False) is None
    assert capsys.readouterr().out == \
        "rank speeds: the plane was not told (speeds: unknown action)\n"


# Five neighbours, not one or two: the kernel moves every unpinned process (the suite's other
# tests) off the crowded core onto rank 0's, and with two neighbours a loaded CI run measured
# the ranks within 8% of each other (rank 0 shared its core with about two of them). Up to three
# such processes leave rank 0 a quarter of its core against rank 1's sixth (measured with three
# busy loops beside the test: four neighbours gave 0.75-0.87, too near the 0.9 that is news).
# The other test that pins spinners to a core (test_compute_clock) runs on the same xdist
# worker, never beside it.
_NEIGHBOURS = 5


@pytest.mark.xdist_group("pinned_cpus")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin ranks to")
def test_a_rank_sharing_its_core_with_noisy_neighbours_gets_less_work(demo, tmp_path,
                                                                        monkeypatch):
    """Ranks pinned to a CPU each (``OMNISCALE_CPU_BIND``), and five processes spinning on rank
    1's CPU from the start: rank 1 gets about a sixth of its core. The slower rank's speed is
    measured (the runnable clock sees the neighbours; CPU time would not), the plane is told,
    and the steps planned with those speeds give that rank the smaller share of the work,
    about in proportion."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setenv("OMNISCALE_CPU_BIND", ",".join(map(str, cpus)))
    run = tmp_path / "run"
    sets = {"data.spec": demo / "mix.yaml", "data.workers": 0, "eval.enabled": False,
            "data.global_batch_tokens": 8192, "data.micro_batch_tokens": 2048,
            "optim.warmup_steps": 1, "output_dir": run, "steps": 6, "checkpoint_every": 6,
            "deterministic": False}
    with Spinners(cpus[1], _NEIGHBOURS):
        train("configs/demo_omni.yaml", nproc=2, progress=False,
              sets=[f"{k}={v}" for k, v in sets.items()])
    rows = read_metrics(run / "metrics.jsonl")
    sent = [r["rank_speeds_sent"] for r in rows if "rank_speeds_sent" in r]
    told = next((s for s in sent if s["speeds"]), None)
    # Usually rank 1 is the slow one. But the kernel moves every unpinned process (the suite's
    # other tests) off the crowded core onto rank 0's, and under a loaded suite rank 0 has
    # measured slower (0.78 against 1.0): what must hold is that the slower rank, measured on
    # the runnable clock, is told and planned for.
    assert told is not None and min(told["speeds"]) < 0.9 and 1.0 in told["speeds"], \
        [r.get("rank_speed") for r in rows]
    slow = told["speeds"].index(min(told["speeds"]))
    # applied from the step after the one that showed it: every rank's loader drops the
    # plans it read ahead (trainer.Trainer.tell_speeds)
    applies = told["applies_at_step"]
    assert applies <= 3, sent
    until = next((s["applies_at_step"] for s in sent if s["applies_at_step"] > applies), 6)
    planned = [r["rank_predicted_cost"] for r in rows if applies <= r["step"] < until]
    ratio = sum(c[slow] for c in planned) / sum(c[1 - slow] for c in planned)
    assert ratio < min(0.95, told["speeds"][slow] + 0.1), (ratio, told, planned)
    logged = [r for _, r in Journal(run / "plane", readonly=True).records() if r["t"] == "speeds"]
    assert [(r["step"], r["speeds"]) for r in logged] == \
        [(s["applies_at_step"], s["speeds"]) for s in sent]
    assert all(r["step"] == r["as_of"] + 1 for r in logged), logged
