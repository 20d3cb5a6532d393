import numpy as np
import pytest

from omniscale.balancer.split import choose_sp_size, largest_sp_size, unit_cost
from omniscale.balancer.types import slice_tokens


def test_largest_sp_size_is_capped_by_dp():
    assert largest_sp_size(8, 64) == 8
    assert largest_sp_size(32, 12) == 8
    assert largest_sp_size(8, 1) == 1


def test_smallest_k_that_fits_the_share():
    cost = np.array([10.0, 40.0, 100.0, 1000.0])
    tokens = np.array([10, 10, 10, 10])
    k = choose_sp_size(cost, tokens, 30.0, sp_max=8, dp=8, micro_batch_tokens=100)
    np.testing.assert_array_equal(k, [1, 2, 4, 8])  # 1000/8 > 30: none fits, the largest


def test_comm_cost_can_raise_k():
    cost = np.array([100.0])
    tokens = np.array([64])
    # A rank sends (k-1)/k of its slice. k=4: 25 + 0.25·16·3/4 = 28 ≤ 30; k=2 would be
    # 50 + 0.25·32·1/2 = 54.
    assert choose_sp_size(cost, tokens, 30.0, sp_max=8, dp=8, micro_batch_tokens=100,
                          sp_comm_per_token=0.25)[0] == 4
    assert unit_cost(cost, tokens, np.array([4]), 0.25)[0] == pytest.approx(28.0)
    assert unit_cost(cost, tokens, np.array([2]), 0.25)[0] == pytest.approx(54.0)
    # with 1.0 per token, k=4 costs 25 + 12 = 37 > 30, k=8 costs 12.5 + 7 = 19.5
    assert choose_sp_size(cost, tokens, 30.0, sp_max=8, dp=8, micro_batch_tokens=100,
                          sp_comm_per_token=1.0)[0] == 8
    assert unit_cost(cost, tokens, np.array([1]), 0.25)[0] == 100.0  # whole: no comm


def test_budget_forces_a_split_of_a_cheap_long_sample():
    tokens = np.array([250, 90])
    k = choose_sp_size(np.array([1.0, 1.0]), tokens, 1e9, sp_max=8, dp=8,
                       micro_batch_tokens=100)
    np.testing.assert_array_equal(k, [4, 1])
    assert np.all(slice_tokens(tokens, k) <= 100)


def test_sample_too_long_for_any_group_is_named():
    tokens = np.array([10] * 17 + [300000])
    with pytest.raises(ValueError, match=r"sample 17 has 300000 tokens: more than "
                                         r"micro_batch_tokens × sp_max = 16384 × 8 = 131072"):
        choose_sp_size(np.ones(18), tokens, 1.0, sp_max=8, dp=64, micro_batch_tokens=16384)
    with pytest.raises(ValueError, match="capped to 4 by dp 6"):
        choose_sp_size(np.ones(1), np.array([500]), 1.0, sp_max=8, dp=6, micro_batch_tokens=100)


def test_slot_share_is_the_rank_share_over_the_slots_its_tokens_need():
    from omniscale.balancer.split import slot_share

    cost = np.full(16, 10.0)
    tokens = np.full(16, 250)
    # 2 steps × 2 ranks: 40 cost and 1,000 tokens per rank and step; 4 slots of 256 tokens.
    assert slot_share(cost, tokens, 2, 2, 256) == 10.0
    assert slot_share(cost, tokens, 2, 2, 4096) == 40.0  # at least one slot
