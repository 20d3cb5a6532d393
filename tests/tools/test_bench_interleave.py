"""The interleaved e2e schedule (``tools/bench/e2e_interleave.py``): a round's runs give every
policy every measured window exactly once, and a round whose policies trained different data
is refused."""

from __future__ import annotations

import itertools

import pytest

from omniscale.dataplane.plane_config import policy_of_window
from omniscale.tools.bench import e2e_interleave as ei

POLICIES = ["omniscale", "token_lpt", "kk_cost"]


@pytest.mark.parametrize("n_policies, cycles, warmup", [(2, 1, 4), (3, 2, 4), (3, 1, 0)])
def test_a_round_plans_every_measured_window_once_by_each_policy(n_policies, cycles, warmup):
    policies, window = POLICIES[:n_policies], 4
    steps = ei.steps_per_run(warmup, window, n_policies, cycles)
    assert steps == warmup + 4 * n_policies * cycles
    for r in range(3):  # any round: its runs are the n rotations, from r on
        seen = []
        for j in range(n_policies):
            order = ei.rotation(policies, r + j)
            assert sorted(order) == sorted(policies)
            # as the plane and the trainer read data.balance_interleave
            seen += [(step // window, policy_of_window("omniscale", order, step // window))
                     for step in range(warmup, steps)]
        for k, p in itertools.product(range(warmup // window, steps // window), policies):
            assert seen.count((k, p)) == window, (r, k, p)


def test_rows_are_grouped_by_the_policy_they_name_and_a_stranger_is_refused():
    rows = [{"step": s, "balance": ["token_lpt", "omniscale"][s // 2 % 2]} for s in range(8)]
    got = ei.rows_by_policy(rows, 2, ["omniscale", "token_lpt"])
    assert [r["step"] for r in got["omniscale"]] == [2, 3, 6, 7]
    assert [r["step"] for r in got["token_lpt"]] == [4, 5]
    with pytest.raises(SystemExit, match=r"step 1: planned by 'strided', none of"):
        ei.rows_by_policy([{"step": 1, "balance": "strided"}], 0, ["omniscale", "token_lpt"])


def test_a_round_on_different_data_is_refused():
    ei.check_same_data({"omniscale": {"tokens": 10}, "token_lpt": {"tokens": 10}})
    with pytest.raises(SystemExit, match="trained different tokens"):
        ei.check_same_data({"omniscale": {"tokens": 10}, "token_lpt": {"tokens": 11}})
    assert ei.interleave_setting(["omniscale", "token_lpt"]) == "[omniscale,token_lpt]"
