"""The split's arithmetic on cases worked out by hand (balancer/split.py): a slot's share, the
SP size chosen at the share's edge, with communication left at its default and charged, and
the line for a sample no group can hold."""

from __future__ import annotations

import numpy as np
import pytest

from omniscale.balancer.split import choose_sp_size, slot_share


def test_a_slots_share_is_the_per_rank_cost_over_the_slots_its_tokens_need():
    # 7 cost units and 400 tokens over 1 step x 2 ranks: 3.5 and 200 a rank, two 100-token slots
    assert slot_share(np.array([5.0, 2.0]), np.array([300, 100]), 1, 2, 100) == 1.75
    # no tokens at all (a window of fixed costs) still needs one slot
    assert slot_share(np.array([4.0]), np.array([0]), 1, 1, 100) == 4.0


def _sizes(cost, share, **kw):
    kw = {"sp_max": 4, "dp": 4, "micro_batch_tokens": 100, **kw}
    return choose_sp_size(np.array(cost, float), np.array([100] * len(cost)), share, **kw).tolist()


def test_the_smallest_group_whose_cost_fits_the_share_edge_included():
    # c/k <= 5: cost 10 fits at k = 2 exactly, cost 12 first at k = 4, cost 5 whole
    assert _sizes([10, 12, 5], 5.0) == [2, 4, 1]


def test_communication_is_free_unless_charged_and_charged_it_can_rule_a_split_out():
    # charged 1 per token sent: a 2-split sends 50 x 1/2 = 25, a 4-split 25 x 3/4 = 18.75, so
    # neither fits 5 and the largest group is taken
    assert _sizes([10, 12], 5.0, sp_comm_per_token=1.0) == [4, 4]
    assert _sizes([10, 12], 5.0) == _sizes([10, 12], 5.0, sp_comm_per_token=0.0) == [2, 4]


@pytest.mark.parametrize("sp_max, dp, note", [
    (2, 2, ""), (4, 2, " (sp_max 4 capped to 2 by dp 2)")])
def test_a_sample_no_group_can_hold_is_named_with_the_cap_only_when_dp_lowered_it(
        sp_max, dp, note):
    with pytest.raises(ValueError) as error:
        choose_sp_size(np.array([1.0, 9.0]), np.array([10, 201]), 1.0, sp_max=sp_max, dp=dp,
                       micro_batch_tokens=100)
    assert str(error.value) == ("sample 1 has 201 tokens: more than micro_batch_tokens × "
                                f"sp_max = 100 × 2 = 200{note}")
