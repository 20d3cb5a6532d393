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


# -- in turns (policy_over_turns) ----------------------------------------------------------------
def _turn_rows(order: list[str], slow: bool) -> list[dict]:
    """A run of 8 steps, window 2, its windows planned by ``order`` in turn; rank 1 at half speed
    from step 2 to the end, the plane told after step 2 (speeds apply from step 4). Ours, once
    it plans by the speeds, gives rank 1 a third of the work: 4/3 s a step; before (and a
    baseline always) half: 2 s."""
    rows = []
    for step in range(8):
        policy = order[step // 2 % len(order)]
        knows = policy == "omniscale" and step >= 4
        costs = [4 / 3, 2 / 3] if knows else [1.0, 1.0]
        secs = [costs[0], costs[1] * (2 if slow and step >= 2 else 1)]
        row = _row(step, costs, secs, max(secs))
        row.update(balance=policy, imbalance_predicted=1.0)
        if step == 2:
            row["rank_speeds_sent"] = {"applies_at_step": 4, "speeds": [1.0, 0.5]}
        rows.append(row)
    return rows


def test_each_policy_over_its_slowed_turns_pooled_over_the_round_s_runs():
    from omniscale.tools.bench.e2e_uneven import policy_over_turns

    runs = [_turn_rows(["omniscale", "token_lpt"], True), _turn_rows(["token_lpt", "omniscale"],
                                                                     True)]
    # settled: steps 4-7; run 0: ours 4-5, token LPT 6-7; run 1 the other way round
    ours = policy_over_turns(runs, "omniscale", slow_from=2, slow_until=None, settle=2,
                             warmup=0, plans_by_speed=True)
    lpt = policy_over_turns(runs, "token_lpt", slow_from=2, slow_until=None, settle=2,
                            warmup=0, plans_by_speed=False)
    assert [(s["run"], s["step"]) for s in ours["steps"] if s["step"] >= 4] == \
        [(0, 4), (0, 5), (1, 6), (1, 7)]
    assert ours["tokens_per_s"] == pytest.approx(400 / (4 * 4 / 3))
    assert lpt["tokens_per_s"] == pytest.approx(400 / (4 * 2.0))
    assert ours["ideal_fraction"] == pytest.approx(1.0)  # 2 units at speeds 1 + 0.5: 4/3 s
    assert lpt["ideal_fraction"] == pytest.approx((4 / 3) / 2)
    assert lpt["imbalance_measured"] == pytest.approx(2 / 1.5)
    assert ours["rank1_speed_measured"] == lpt["rank1_speed_measured"] == pytest.approx(0.5)
    assert ours["step_s_before"] == lpt["step_s_before"] == 1.0  # step 0-1, unslowed
    # the plane applies the speeds from step 4 in both runs; ours planned step 4 in run 0 but
    # its first turn after step 4 in run 1 is step 6
    assert ours["speeds_applied_after_slowdown_steps"] == 2
    assert ours["planned_for_slowdown_after_steps"] == 3  # median of 2 and 4
    assert lpt["planned_for_slowdown_after_steps"] is None
    assert lpt["speeds_applied_after_slowdown_steps"] == 2
    assert "planned_for_release_after_steps" not in ours  # the neighbour never left


def test_a_policy_with_no_settled_turn_is_refused_in_one_line():
    from omniscale.tools.bench.e2e_uneven import policy_over_turns

    runs = [_turn_rows(["omniscale", "token_lpt"], True)]
    with pytest.raises(SystemExit, match="kk_cost planned no settled step between 4 and 8"):
        policy_over_turns(runs, "kk_cost", 2, None, 2, 0, False)


def test_a_round_in_turns_runs_each_rotation_with_the_neighbour_and_pairs_the_same_steps(
        monkeypatch, tmp_path):
    """``turns_round`` with a stand-in trainer: one run per rotation, each told its turn order,
    the uneven settings and the neighbour; a trainer whose rows do not follow the turns (each
    policy on other steps) is refused in one line."""
    import argparse
    from pathlib import Path

    from omniscale.tools.bench import e2e_interleave, e2e_uneven

    monkeypatch.setattr(e2e_interleave, "wait_quiet", lambda *a: {"waited_s": 0.0})
    monkeypatch.setattr(e2e_uneven, "environment", lambda: {"OMNISCALE_CPU_BIND": "0,1"})
    args = argparse.Namespace(rotations=None, rounds=1, slow_from=2, settle=2, warmup=0,
                              max_foreign=1.0, wait_quiet_s=0.0)
    calls = []

    def train(policy, spec, out, args, sets, env, during):
        order = sets["data.balance_interleave"].strip("[]").split(",")
        calls.append((policy, order, sets["deterministic"], env, during(out / "m").slow_from))
        return _turn_rows(order, True)

    got = e2e_uneven.turns_round(1, ["omniscale", "token_lpt"], Path("spec"), tmp_path, args,
                                 None, train, "omniscale")
    assert [c[1] for c in calls] == [["token_lpt", "omniscale"], ["omniscale", "token_lpt"]]
    assert all(c[0] == "omniscale" and c[2] == "false" and c[3]["OMNISCALE_CPU_BIND"] == "0,1"
               and c[4] == 2 for c in calls)  # ours' settings, deterministic off, the neighbour
    assert got["order"] == [c[1] for c in calls]
    # the same pooled figures as policy_over_turns on the two runs (the test above)
    assert got["runs"]["omniscale"]["tokens_per_s"] == pytest.approx(400 / (4 * 4 / 3))
    assert got["runs"]["token_lpt"]["planned_for_slowdown_after_steps"] is None
    assert got["runs_each"][0]["speeds_sent"] == [
        {"after_step": 2, "applies_at_step": 4, "speeds": [1.0, 0.5]}]

    def one_order(policy, spec, out, args, sets, env, during):
        return _turn_rows(["omniscale", "token_lpt"], True)  # whatever it was told

    with pytest.raises(SystemExit, match="round 1: the policies' turns covered different"):
        e2e_uneven.turns_round(0, ["omniscale", "token_lpt"], Path("spec"), tmp_path, args,
                               None, one_order, "omniscale")
