"""The uneven-ranks workload's figures (tools/bench/e2e_uneven.py analyse), on metrics rows
worked out by hand: rank 1 at half speed from step 4 to step 10, planned for from step 6."""

from __future__ import annotations

import pytest

from omniscale.tools.bench.e2e_uneven import analyse


def _row(step, costs, secs, step_s, sent=None):
    row = {"step": step, "step_s": step_s, "tokens": 100, "rank_predicted_cost": costs,
           "rank_compute_s": secs, "imbalance_measured": max(secs) / (sum(secs) / 2),
           "micro_batches": 2}
    if sent is not None:
        row["rank_speeds_sent"] = sent
    return row


def _rows():
    third = 4 / 3
    rows = [_row(s, [1.0, 1.0], [1.0, 1.0], 1.0) for s in range(4)]
    rows += [_row(4, [1.0, 1.0], [1.0, 2.0], 2.0),
             _row(5, [1.0, 1.0], [1.0, 2.0], 2.0, {"applies_at_step": 6, "speeds": [1.0, 0.5]}),
             _row(6, [1.2, 0.8], [1.2, 1.6], 1.6)]
    rows += [_row(s, [third, 2 / 3], [third, third], third) for s in (7, 8, 9)]
    rows += [_row(10, [third, 2 / 3], [third, 2 / 3], third,
                  {"applies_at_step": 11, "speeds": [1.0, 0.8]}),  # not equal yet: no
             _row(11, [1.0, 1.0], [1.0, 1.0], 1.0, {"applies_at_step": 12, "speeds": []})]
    return rows


def test_figures_of_a_slowed_rank_planned_for_two_steps_after_the_change():
    got = analyse(_rows(), slow_from=4, slow_until=10, settle=2, warmup=1)
    seconds = 1.6 + 3 * 4 / 3  # settled: steps 6-9
    assert got["tokens_per_s"] == pytest.approx(400 / seconds)
    # each settled step's ideal: speeds 1 and 0.5 (cost over seconds), 2 units of work ->
    # 2 / 1.5 s of compute, the rest of the step as measured (none here)
    assert got["ideal_fraction"] == pytest.approx(4 * (4 / 3) / seconds)
    assert got["imbalance_measured"] == pytest.approx((1.6 / 1.4 + 3) / 4)
    assert got["rank1_speed_measured"] == pytest.approx(0.5)
    assert (got["step_s_before"], got["step_s_slowed"]) == (1.0, pytest.approx(4 / 3))
    assert got["recovery_steps"] == 3  # steps 4, 5, 6 over 1.1 x 4/3; step 7 within
    assert got["recovery_after_release_steps"] == 1
    assert got["planned_for_slowdown_after_steps"] == 2  # step 6's plans, from step 4
    assert got["planned_for_release_after_steps"] == 2  # equal again from step 12
    assert [s["rank1_share"] for s in got["steps"][5:8]] == [0.5, 0.4, 0.333]


def test_a_baseline_that_sent_no_speeds_has_no_planned_after():
    rows = [{k: v for k, v in r.items() if k != "rank_speeds_sent"} for r in _rows()]
    got = analyse(rows, slow_from=4, slow_until=10, settle=2, warmup=1)
    assert got["planned_for_slowdown_after_steps"] is None
    assert got["planned_for_release_after_steps"] is None


def test_a_baseline_that_sent_speeds_it_does_not_plan_by_has_no_planned_after():
    """A baseline's trainer sends the speeds as ours does (the same rows), but its plane plans
    without them: its steps are planned for no change."""
    got = analyse(_rows(), slow_from=4, slow_until=10, settle=2, warmup=1, plans_by_speed=False)
    assert got["planned_for_slowdown_after_steps"] is None
    assert got["planned_for_release_after_steps"] is None
    assert got["speeds_sent"]  # still reported, as sent
