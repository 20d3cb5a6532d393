"""The ranks' measured speeds sent to the plane (``set_speeds``): they apply from the first step
no rank has fetched, each later step trains the samples it would have trained, a slow rank's
share of the work falls, and the change is logged, so a restart and the audit replay the same
plans."""

from __future__ import annotations

import pytest

from omniscale.dataplane.actions import RequestError
from omniscale.dataplane.audit import audit_state_dir
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.plan import fingerprint, plan_metadata
from tests.dataplane.plane_steps import commit_step

CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=24576,
                     sp_max=1, snapshot_every=4)


def _train(plane, start, stop):
    plans = {}
    for step in range(start, stop):
        plans[step] = [plane.get_plan(step, r) for r in range(2)]
        commit_step(plane, step)
    return plans


def _samples(tables) -> list:
    return sorted((t["source"], t["key"], t["epoch"]) for table in tables
                  for t in table.to_pylist() if t["role"] == "llm")


def _cost(table) -> float:
    return plan_metadata(table)["predicted_cost"]


def test_speeds_apply_from_the_first_unserved_step_and_replay(demo, tmp_path):
    reference = _train(DataPlane(demo / "mix.yaml", tmp_path / "base", CONFIG), 0, 16)
    plane = DataPlane(demo / "mix.yaml", tmp_path / "speeds", CONFIG)
    assert _train(plane, 0, 5) == {s: reference[s] for s in range(5)}
    plane.get_plan(5, 0)  # fetched ahead by rank 0: step 5's plans must not change
    reply = plane.set_speeds(4, [2.0, 0.8])
    assert reply == {"applies_at_step": 6, "speeds": [1.0, 0.4]}  # relative to the fastest
    after = _train(plane, 5, 12)
    assert after[5] == reference[5]
    for step in range(6, 12):
        # the same global batch (mid-window steps keep their samples; later windows are drawn
        # from the same mixer state), with rank 1 -- at 0.4 of rank 0's speed -- given about
        # 0.4 / 1.4 of the work instead of half
        assert _samples(after[step]) == _samples(reference[step])
        share = _cost(after[step][1]) / (_cost(after[step][0]) + _cost(after[step][1]))
        assert share < 0.36, (step, share)
        assert plan_metadata(after[step][0])["imbalance"] < 1.1  # in time
    status = plane.status()
    assert status["rank_speeds"] == {"step": 6, "speeds": [1.0, 0.4]}

    ahead = [plane.get_plan(12, r) for r in range(2)]
    again = DataPlane(demo / "mix.yaml", tmp_path / "speeds", CONFIG)  # as after a crash
    assert [again.get_plan(12, r) for r in range(2)] == ahead
    _train(again, 12, 13)
    assert again.set_speeds(12, [])["applies_at_step"] == 13  # equal again
    back = _train(again, 13, 16)
    assert all(back[s] == reference[s] for s in (14, 15))  # a window with equal ranks again
    report = audit_state_dir(tmp_path / "speeds")
    assert (report["duplicated"], report["missing"], report["fingerprint_mismatches"]) == \
        (0, 0, [])


@pytest.mark.parametrize("speeds, message", [
    ([1.0], "speeds: 1 speeds for step 1, which is planned for 2 data ranks"),
    ([1.0, 0.0], "speeds: step >= 0 and one finite speed > 0"),
    ([1.0, float("inf")], "speeds: step >= 0 and one finite speed > 0"),
    ([1.0, 0.001], "speeds: step >= 0 and one finite speed > 0"),  # 1000x: broken, not slow
])
def test_bad_speeds_are_refused_in_one_line(demo, tmp_path, speeds, message):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    before = plane.get_plan(0, 1)
    with pytest.raises(RequestError, match="^" + message):
        plane.set_speeds(0, speeds)
    assert plane.get_plan(1, 1).num_rows > 0 and plane.get_plan(0, 1) == before
    assert plane.status()["rank_speeds"] is None


def test_speeds_re_plan_the_drawn_window_and_redraw_the_ones_after_it(demo, tmp_path):
    """Windows drawn further ahead than the speeds' first step: the window holding that step
    re-plans its tail, the later drawn one is drawn again, each with the new speeds."""
    reference = _train(DataPlane(demo / "mix.yaml", tmp_path / "base", CONFIG), 0, 16)
    plane = DataPlane(demo / "mix.yaml", tmp_path / "speeds", CONFIG)
    _train(plane, 0, 5)
    plane.get_plan(9, 0)  # rank 0 fetched ahead into window 2
    plane.state.plan_through(15)  # window 3 drawn too
    assert plane.set_speeds(4, [2.0, 0.8])["applies_at_step"] == 10
    after = _train(plane, 5, 16)
    assert all(after[s] == reference[s] for s in range(5, 10))
    for step in range(10, 16):  # window 2's tail and window 3
        assert _samples(after[step]) == _samples(reference[step])
        share = _cost(after[step][1]) / (_cost(after[step][0]) + _cost(after[step][1]))
        assert share < 0.36, (step, share)



def test_speeds_from_the_first_step_no_rank_started_re_plan_fetched_steps(demo, tmp_path):
    """``from_step``: the trainer vouches no rank started that step (its loaders fetch again),
    so steps already served are re-planned from there; the first served plans of them are
    refused at commit, the new ones trained; a restart replays the same plans."""
    reference = _train(DataPlane(demo / "mix.yaml", tmp_path / "base", CONFIG), 0, 12)
    plane = DataPlane(demo / "mix.yaml", tmp_path / "speeds", CONFIG)
    _train(plane, 0, 3)
    old = [plane.get_plan(s, 1) for s in (3, 4, 5, 6)]  # fetched ahead, into window 1
    plane.commit(3, 0, plan_fp=fingerprint(plane.get_plan(3, 0)))  # rank 0 trained step 3
    with pytest.raises(RequestError, match="^speeds: from_step 3 is committed by a rank"):
        plane.set_speeds(2, [2.0, 0.8], from_step=3)
    assert plane.set_speeds(3, [2.0, 0.8], from_step=4) == \
        {"applies_at_step": 4, "speeds": [1.0, 0.4]}
    assert plane.get_plan(3, 1) == old[0]  # started: kept
    with pytest.raises(RequestError, match="step 5 was re-planned for 2 ranks since rank 1"):
        plane.commit(5, 1, plan_fp=fingerprint(old[2]))
    plane.commit(3, 1, plan_fp=fingerprint(old[0]))
    after = _train(plane, 4, 10)
    for step in range(4, 10):
        assert _samples(after[step]) == _samples(reference[step])
        share = _cost(after[step][1]) / (_cost(after[step][0]) + _cost(after[step][1]))
        assert share < 0.36, (step, share)
    again = DataPlane(demo / "mix.yaml", tmp_path / "speeds", CONFIG)  # as after a crash
    assert [again.get_plan(10, r) for r in range(2)] == [plane.get_plan(10, r) for r in range(2)]
    report = audit_state_dir(tmp_path / "speeds")
    assert (report["duplicated"], report["missing"], report["fingerprint_mismatches"]) == \
        (0, 0, [])


def test_speeds_keep_to_unserved_steps_once_the_mixture_end_is_known(demo, tmp_path):
    """A loader told the mixture ends could not fetch again: once the plane knows where the
    data ends, ``from_step`` is not taken and the speeds apply after the served steps."""
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    _train(plane, 0, 2)
    plane.get_plan(4, 0)
    plane.state.exhausted_at = 40  # as a plane that drew its last window finds
    assert plane.set_speeds(1, [1.0, 0.5], from_step=2)["applies_at_step"] == 5


def test_speeds_known_ahead_plan_from_step_0_and_survive_a_restart(demo, tmp_path):
    """``PlaneConfig.rank_speed`` (``data.rank_speeds``, ``plane serve --rank-speeds``): the
    same global batches as equal ranks, rank 1 at 0.4 of rank 0's speed given about 0.4/1.4 of
    the work from the first step; a restart plans the same."""
    reference = _train(DataPlane(demo / "mix.yaml", tmp_path / "base", CONFIG), 0, 6)
    known = PlaneConfig(**{**CONFIG.__dict__, "rank_speed": (2.0, 0.8)})
    assert known.rank_speed == (1.0, 0.4)  # relative to the fastest
    plane = DataPlane(demo / "mix.yaml", tmp_path / "known", known)
    plans = _train(plane, 0, 5)
    for step, tables in plans.items():
        assert _samples(tables) == _samples(reference[step])
        share = _cost(tables[1]) / (_cost(tables[0]) + _cost(tables[1]))
        assert share < 0.36, (step, share)
    ahead = [plane.get_plan(5, r) for r in range(2)]
    again = DataPlane(demo / "mix.yaml", tmp_path / "known", known)
    assert [again.get_plan(5, r) for r in range(2)] == ahead


@pytest.mark.parametrize("speeds", [(1.0,), (1.0, 0.0), (1.0, float("inf"))])
def test_speeds_known_ahead_not_one_per_rank_are_one_line(speeds):
    from omniscale.errors import UserError

    with pytest.raises(UserError, match=r"^--rank-speeds: one finite speed > 0 per data rank "
                                        r"\(2\), got "):
        PlaneConfig(**{**CONFIG.__dict__, "rank_speed": speeds})
