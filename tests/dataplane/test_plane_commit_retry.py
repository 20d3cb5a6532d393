"""A commit whose reply was lost (the plane was killed after logging it, before answering) is
retried by the client after the restart: the retry of the same rank's commit of the same plan
succeeds; a commit of another plan, or without a fingerprint, is still refused."""

from __future__ import annotations

import pytest

from omniscale.dataplane.actions import RequestError
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.plan import fingerprint

CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=1, snapshot_every=3)


@pytest.mark.parametrize("steps", [2, 3], ids=["replayed-from-log", "in-the-snapshot"])
def test_a_retried_commit_succeeds_after_a_restart(demo, tmp_path, steps):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    prints = {}
    for step in range(steps):
        for rank in range(2):
            prints[step, rank] = fingerprint(plane.get_plan(step, rank))
            plane.commit(step, rank, prints[step, rank])
    half = fingerprint(plane.get_plan(steps, 0))
    plane.commit(steps, 0, half)  # rank 0's share of the next step, logged

    again = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)  # killed, restarted
    last = steps - 1
    reply = again.commit(last, 1, prints[last, 1])  # the lost reply's retry
    assert reply["repeated"] and reply["committed"] and reply["next_step"] == steps
    reply = again.commit(steps, 0, half)
    assert reply["repeated"] and not reply["committed"]
    with pytest.raises(RequestError, match="already committed"):
        again.commit(last, 1)  # no fingerprint: not recognisable as a retry
    with pytest.raises(RequestError):
        again.commit(last, 1, prints[last, 0])  # another rank's plan
    with pytest.raises(RequestError, match="already committed"):
        again.commit(steps, 0)
    assert again.commit(steps, 1, fingerprint(again.get_plan(steps, 1)))["committed"]


def test_a_retried_whole_step_commit_succeeds_and_another_plan_is_refused(demo, tmp_path):
    from tests.dataplane.plane_steps import step_fp

    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    whole = step_fp(plane, 0)
    plane.commit(0, plan_fp=whole)
    again = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)  # killed, restarted
    reply = again.commit(0, plan_fp=whole)
    assert reply == {"step": 0, "committed": True, "next_step": 1, "repeated": True}
    with pytest.raises(RequestError):
        again.commit(0, plan_fp="0" * len(whole))  # not the plans it committed


def test_a_retry_from_a_rank_the_step_did_not_have_is_refused(demo, tmp_path):
    from tests.dataplane.plane_steps import step_fp

    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    plane.commit(0, plan_fp=step_fp(plane, 0))
    with pytest.raises(RequestError):
        plane.commit(0, 3, "0" * 16)  # dp is 2
