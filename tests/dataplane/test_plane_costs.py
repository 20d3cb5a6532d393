"""A refitted cost model sent to the plane (``set_costs``): it applies from the first window no
rank has seen, the change is logged, so a restart and the audit replay the same plans."""

from __future__ import annotations

import pytest

from omniscale.dataplane.actions import RequestError
from omniscale.dataplane.audit import audit_state_dir
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from tests.dataplane.plane_steps import commit_step

CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=1, snapshot_every=4)


def _train(plane, start, stop):
    plans = {}
    for step in range(start, stop):
        plans[step] = [plane.get_plan(step, r) for r in range(2)]
        commit_step(plane, step)
    return plans


def test_new_costs_apply_to_unseen_windows_and_replay(demo, tmp_path):
    base = DataPlane(demo / "mix.yaml", tmp_path / "base", CONFIG)
    reference = _train(base, 0, 16)

    plane = DataPlane(demo / "mix.yaml", tmp_path / "refit", CONFIG)
    before = _train(plane, 0, 5)
    assert before == {s: reference[s] for s in range(5)}
    # A purely quadratic cost (very long sequences dominate): other rank assignments.
    reply = plane.set_costs(0.0, 1.0)
    assert reply["applies_at_step"] == 8  # step 5 was served: its window (4..7) is kept
    after = _train(plane, 5, 12)
    assert all(after[s] == reference[s] for s in (5, 6, 7))
    assert any(after[s] != reference[s] for s in range(8, 12))
    # the window draws the same samples; only their steps and ranks follow the new costs
    def window_keys(plans):
        return sorted((t["source"], t["key"], t["epoch"]) for s in range(8, 12)
                      for table in plans[s] for t in table.to_pylist() if t["role"] == "llm")

    assert window_keys(after) == window_keys(reference)

    ahead = [plane.get_plan(12, r) for r in range(2)]
    again = DataPlane(demo / "mix.yaml", tmp_path / "refit", CONFIG)  # as after a crash
    assert [again.get_plan(12, r) for r in range(2)] == ahead
    _train(again, 12, 16)
    report = audit_state_dir(tmp_path / "refit")
    assert (report["duplicated"], report["missing"], report["fingerprint_mismatches"]) == \
        (0, 0, [])


@pytest.mark.parametrize("linear, quadratic", [(-1.0, 1.0), (0.0, 0.0), (float("nan"), 1.0)])
def test_bad_costs_are_refused(demo, tmp_path, linear, quadratic):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    with pytest.raises(RequestError, match="costs: linear and quadratic"):
        plane.set_costs(linear, quadratic)
    assert plane.get_plan(0, 0).num_rows > 0  # still serving


def test_costs_over_the_wire(demo, tmp_path):
    from omniscale.dataplane.client import PlaneClient, PlaneError
    from omniscale.dataplane.embedded import start_embedded

    with start_embedded(demo / "mix.yaml", tmp_path, CONFIG) as plane:
        with PlaneClient(plane.url) as client:
            client.get_plan(0, 0)
            assert client.set_costs(1000.0, 1.0) == {"applies_at_step": 4}
            with pytest.raises(PlaneError, match="costs: linear and quadratic"):
                client.set_costs(-1.0, 1.0)
