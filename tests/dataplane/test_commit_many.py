"""commit_many: one rank's commits of several steps in one request and one fsync -- each
exactly the commit it stands for (the oracle: the same commits sent one by one), durable
before the reply, the first refusal raised with the steps before it standing."""

from __future__ import annotations

import pytest

from omniscale.dataplane import journal as journal_module
from omniscale.dataplane.actions import Reason, RequestError
from omniscale.dataplane.client import PlaneClient, PlaneError
from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.plan import fingerprint

CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=2, snapshot_every=4)


def _prints(plane, steps, rank):
    return [fingerprint(plane.get_plan(s, rank)) for s in steps]


def _run(spec, state, batched: bool, syncs: list) -> dict:
    """Rank 1 commits steps 0..5 one by one; rank 0 the same steps, in one request or one by
    one. Returns the state a restarted plane reads back, and the fsyncs rank 0's commits
    took."""
    plane = DataPlane(spec, state, CONFIG)
    steps = list(range(6))
    ones, zeros = _prints(plane, steps, 1), _prints(plane, steps, 0)
    for s, fp in zip(steps, ones):
        plane.commit(s, 1, fp)
    syncs.clear()
    if batched:
        reply = plane.commit_many(0, steps, zeros)
        assert reply == {"next_step": 6, "committed": [True] * 6}
    else:
        for s, fp in zip(steps, zeros):
            assert plane.commit(s, 0, fp)["committed"]
    fsyncs = len(syncs)
    again = DataPlane(spec, state, CONFIG)  # what the log made durable
    return {"next_step": again.next_step, "committed_fps": dict(again.committed_fps),
            "plan_7": again.get_plan(7, 0).to_pylist()}, fsyncs


def test_many_commits_in_one_request_equal_them_one_by_one(demo, tmp_path, monkeypatch):
    syncs = []
    real = journal_module.os.fsync
    monkeypatch.setattr(journal_module.os, "fsync", lambda fd: (syncs.append(fd), real(fd)))
    one_by_one, fsyncs_one = _run(demo / "mix.yaml", tmp_path / "a", False, syncs)
    batched, fsyncs_many = _run(demo / "mix.yaml", tmp_path / "b", True, syncs)
    assert batched == one_by_one
    assert batched["next_step"] == 6
    assert fsyncs_many < fsyncs_one, (fsyncs_many, fsyncs_one)


def test_the_first_refusal_is_raised_and_the_steps_before_it_stand(demo, tmp_path):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    for s in range(3):
        plane.commit(s, 1, fingerprint(plane.get_plan(s, 1)))
    zeros = _prints(plane, range(3), 0)
    with pytest.raises(RequestError, match="step 2 was re-planned") as refused:
        plane.commit_many(0, [0, 1, 2], [zeros[0], zeros[1], "not-its-plan"])
    assert refused.value.reason == Reason.REPLANNED
    assert DataPlane(demo / "mix.yaml", tmp_path, CONFIG).next_step == 2  # durable, not 3
    # sent again (a client that lost the reply): the standing steps repeat harmlessly
    assert plane.commit_many(0, [0, 1, 2], zeros) == {"next_step": 3,
                                                      "committed": [True] * 3}
    with pytest.raises(RequestError, match="3 steps and 2 plan_fps"):
        plane.commit_many(0, [3, 4, 5], zeros[:2])


def test_commit_many_over_the_wire(demo, tmp_path):
    with start_embedded(demo / "mix.yaml", tmp_path, CONFIG) as plane, \
            PlaneClient(plane.url) as client:
        zeros = [fingerprint(client.get_plan(s, 0)) for s in range(4)]
        assert client.commit_many(0, [0, 1, 2], zeros[:3]) == {
            "next_step": 0, "committed": [False] * 3}  # rank 1's shares are still out
        ones = [fingerprint(client.get_plan(s, 1)) for s in range(3)]
        assert client.commit_many(1, [0, 1, 2], ones)["next_step"] == 3
        with pytest.raises(PlaneError, match="already committed") as refused:
            client.commit_many(0, [2, 3], ["not-its-plan", zeros[3]])
        assert refused.value.reason == Reason.COMMITTED
        with pytest.raises(PlaneError, match="'steps' must be a list of ints"):
            client._action("commit_many", {"rank": 0, "steps": ["3"], "plan_fps": ["x"]})
        assert client.status()["next_step"] == 3
