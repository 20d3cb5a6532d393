"""The plane's state machine through its replay API (``PlaneState.apply``, ``plan_through``,
``snapshot_body``) on a small hand-made source: refits, speeds and resizes replayed before or
after their windows are drawn plan the same steps, snapshots restore them, and a mixture that
runs out ends at the step counted by hand."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import yaml

from omniscale.dataplane.actions import RequestError
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.dataplane.plane_state import PlaneState
from omniscale.plan import plan_metadata, step_fingerprint
from omniscale.tools.bench.plane_data import write_spec
from tests.dataplane.plane_index import rows, write_index

W = 4
CONFIG = PlaneConfig(dp=2, micro_batch_tokens=4096, window=W, global_batch_samples=4,
                     sp_max=1)
SAMPLES = 22  # two shards of 11 samples


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    """``mix.yaml`` (the source rolls over into new epochs) and ``stop.yaml`` (it stops when
    spent: 22 samples, 4 a step)."""
    root = tmp_path_factory.mktemp("plane_state")
    rng = np.random.default_rng(5)
    write_index(root / "text", {f"text-{s}.tar": rows(f"text-{s}.tar",
                                                       rng.integers(50, 2000, 11).tolist())
                                for s in range(2)})
    (root / "tokenizer.json").touch()
    mix = write_spec(root / "mix.yaml", ["text"])
    stop = yaml.safe_load(mix.read_text())
    stop["on_exhausted"] = "stop"
    (root / "stop.yaml").write_text(yaml.safe_dump(stop, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def started(specs):
    """A plane's ``start`` record and journal: what a restart or an audit replays from."""
    plane = DataPlane(specs / "mix.yaml", specs / "state", CONFIG)
    return plane.journal.first_record()[1], plane.journal


def fresh(started) -> PlaneState:
    start, journal = started
    return PlaneState.fresh(start, journal, CONFIG)


def prints(state: PlaneState, steps) -> list[list[str]]:
    return [state.step_fingerprints(s) for s in steps]


def llm_cost(table, linear: float, quadratic: float) -> float:
    """A rank's predicted cost recomputed from its plan: linear·L + quadratic·L² per sample."""
    return sum(linear * r["llm_tokens"] + quadratic * r["llm_tokens"] ** 2
               for r in table.to_pylist() if r["role"] == "llm")


def commit(state: PlaneState, step: int, fps: list[str]) -> None:
    state.apply({"t": "commit", "step": step, "fp": fps})


@pytest.mark.parametrize("kind", ["checkpoint", "abort", "zap"])
def test_a_record_of_an_unknown_kind_is_refused_by_name(started, kind):
    # "checkpoint" and "abort" sort before "commit", "zap" after every known kind
    state = fresh(started)
    with pytest.raises(ValueError, match=f"unknown record kind '{kind}'"):
        state.apply({"t": kind, "step": 0, "fp": ["x"]})
    assert state.next_step == 0 and not state.committed


def test_a_refit_read_from_the_log_prices_its_window_on_and_not_before(started):
    state = fresh(started)
    # as a restart reads it: a record parsed from a JSON line of the log
    state.apply(json.loads(json.dumps({"t": "costs", "window": 1, "linear": 1000.0,
                                       "quadratic": 3.0})))
    state.plan_through(3 * W - 1)
    assert state.costs_of(0) == CONFIG.cost_model(CONFIG.cost_linear, CONFIG.cost_quadratic)
    assert state.costs_of(1) == state.costs_of(2) == CONFIG.cost_model(1000.0, 3.0)
    for step, (linear, quadratic) in ((0, (CONFIG.cost_linear, CONFIG.cost_quadratic)),
                                      (W, (1000.0, 3.0)), (2 * W + 1, (1000.0, 3.0))):
        for rank in range(2):
            table = state.table(step, rank)
            assert plan_metadata(table)["predicted_cost"] == pytest.approx(
                llm_cost(table, linear, quadratic))


def test_a_resize_re_plans_a_window_with_the_costs_it_was_drawn_with(started):
    """Window 1 is refitted to costs dominated by the quadratic term; resizing window 0 after
    window 1 was drawn must still price window 0's steps with the costs it was drawn with."""
    state = fresh(started)
    state.apply({"t": "costs", "window": 1, "linear": 1.0, "quadratic": 1000.0})
    state.plan_through(2 * W - 1)
    state.apply({"t": "dp", "step": 1, "dp": 3})
    for step in range(1, W):
        assert len(state.step_fingerprints(step)) == 3
        for rank in range(3):
            table = state.table(step, rank)
            assert plan_metadata(table)["predicted_cost"] == pytest.approx(
                llm_cost(table, CONFIG.cost_linear, CONFIG.cost_quadratic))


def test_a_retried_commit_is_recognised_for_four_windows_and_no_longer(started):
    state = fresh(started)
    fps = {s: [f"a{s}", f"b{s}"] for s in range(21)}
    for step, f in fps.items():
        commit(state, step, f)
    assert state.next_step == 21
    # step 20 committed last: the fingerprints of steps 20 - 4W = 4 .. 20 are kept
    for step in range(4, 21):
        reply = state.repeated_commit(step, None, step_fingerprint(fps[step]))
        assert reply == {"step": step, "committed": True, "next_step": 21, "repeated": True}
        assert state.repeated_commit(step, 1, f"b{step}")["repeated"]
    for step in range(4):
        assert state.repeated_commit(step, None, step_fingerprint(fps[step])) is None
    assert sorted(state.committed_fps) == list(range(4, 21))  # bounded: four windows


def test_a_snapshot_at_a_window_not_drawn_yet_restores_its_plans(started):
    state = fresh(started)
    for step in range(W):  # replayed commits: nothing is drawn
        commit(state, step, ["x", "y"])
    snap = json.loads(json.dumps(state.snapshot_body(0)))
    assert (snap["step"], snap["window"]) == (W, 1)
    restored = PlaneState.from_snapshot(snap, started[1], CONFIG)
    restored.plan_through(2 * W - 1)
    reference = fresh(started)
    reference.plan_through(2 * W - 1)
    assert prints(restored, range(W, 2 * W)) == prints(reference, range(W, 2 * W))


def test_speeds_replayed_before_their_window_is_drawn_plan_as_when_drawn_live(started):
    replayed = fresh(started)
    replayed.apply({"t": "speeds", "step": 2, "speeds": [1.0, 0.3]})  # window 0 not drawn
    replayed.plan_through(W - 1)
    live = fresh(started)
    live.plan_through(W - 1)
    live.apply({"t": "speeds", "step": 2, "speeds": [1.0, 0.3]})
    equal = fresh(started)
    equal.plan_through(W - 1)
    assert prints(replayed, range(W)) == prints(live, range(W))
    assert prints(replayed, range(2)) == prints(equal, range(2))  # before the change
    for step in (2, 3):  # rank 1, at 0.3 of rank 0's speed, gets well under half the work
        cost = [plan_metadata(replayed.table(step, r))["predicted_cost"] for r in range(2)]
        assert cost[1] / sum(cost) < 0.4, (step, cost)


def test_speeds_from_a_window_s_first_step_plan_as_when_drawn_live(started):
    replayed = fresh(started)
    replayed.apply({"t": "speeds", "step": W, "speeds": [1.0, 0.3]})
    replayed.plan_through(2 * W - 1)
    live = fresh(started)
    live.plan_through(2 * W - 1)
    live.apply({"t": "speeds", "step": W, "speeds": [1.0, 0.3]})
    assert prints(replayed, range(2 * W)) == prints(live, range(2 * W))


def test_two_resizes_inside_a_window_not_drawn_yet_plan_as_when_drawn_live(started):
    replayed = fresh(started)
    for record in ({"t": "dp", "step": W + 1, "dp": 3}, {"t": "dp", "step": W + 2, "dp": 2}):
        replayed.apply(record)
    replayed.plan_through(2 * W - 1)
    # 2 ranks, 3 at step W+1 only, then 2 again
    assert [len(f) for f in prints(replayed, range(W, 2 * W))] == [2, 3, 2, 2]
    live = fresh(started)
    live.plan_through(2 * W - 1)
    for record in ({"t": "dp", "step": W + 1, "dp": 3}, {"t": "dp", "step": W + 2, "dp": 2}):
        live.apply(record)
    assert prints(replayed, range(2 * W)) == prints(live, range(2 * W))


def test_a_speeds_change_draws_the_later_windows_again_and_snapshots_restore_it(started):
    state = fresh(started)
    state.plan_through(3 * W - 1)
    state.apply({"t": "speeds", "step": 1, "speeds": [1.0, 0.3]})
    # the windows after the change's are not held with their old plans: drawn again on demand
    assert sorted(state.windows) == [0]
    state_snap = json.loads(json.dumps(state.snapshot_body(0)))
    state.plan_through(3 * W - 1)
    replayed = fresh(started)
    replayed.apply({"t": "speeds", "step": 1, "speeds": [1.0, 0.3]})
    replayed.plan_through(3 * W - 1)
    assert prints(state, range(3 * W)) == prints(replayed, range(3 * W))
    restored = PlaneState.from_snapshot(state_snap, started[1], CONFIG)
    restored.plan_through(3 * W - 1)
    assert prints(restored, range(3 * W)) == prints(replayed, range(3 * W))


def test_windows_drawn_again_take_a_refit_replayed_after_they_were_first_drawn(started):
    state = fresh(started)
    state.plan_through(3 * W - 1)  # windows 0-2 drawn with the start's costs
    state.apply({"t": "costs", "window": 1, "linear": 1000.0, "quadratic": 3.0})
    state.apply({"t": "speeds", "step": 1, "speeds": [1.0, 0.3]})  # windows 1, 2 drawn again
    for step in range(2 * W):
        commit(state, step, ["x", "y"])
    snap = state.snapshot_body(0)
    assert snap["window"] == 2 and snap["start"]["costs"] == [1000.0, 3.0]


def test_a_spent_mixture_ends_at_the_step_counted_by_hand(specs, tmp_path, caplog):
    # 22 samples, 4 a step: steps 0-4 full, step 5 the last 2, so the mixture ends at step 6
    # -- in window 1, the second window drawn
    with caplog.at_level(logging.INFO, logger="omniscale.dataplane.plane_state"):
        plane = DataPlane(specs / "stop.yaml", tmp_path / "state", CONFIG)
    assert plane.exhausted_at == 6
    assert "the mixture is exhausted: the last step is 5" in caplog.messages
    # the planner may move samples between a window's steps, never out of the window
    served = [[(r["shard"], r["key"]) for rank in range(2)
               for r in plane.get_plan(step, rank).to_pylist() if r["role"] == "llm"]
              for step in range(6)]
    assert [len(sum(served[:W], [])), len(sum(served[W:], []))] == [16, 6]
    assert len(set(sum(served, []))) == SAMPLES
    with pytest.raises(RequestError, match="the last step is 5"):
        plane.get_plan(6, 0)
