import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniscale.balancer.pack import pack


def test_sp_slices_share_a_slot_and_budget_holds():
    first = np.array([0, 0, 1, 2, 2, 3, 0])
    k = np.array([4, 1, 1, 2, 1, 1, 2])
    tokens = np.array([50, 60, 30, 40, 45, 80, 20])
    unit = tokens.astype(float) ** 2
    slot, tok_RB, cost_RB, nb = pack(first, k, tokens, unit, 4, 100)
    assert tok_RB.shape == cost_RB.shape == (4, nb)
    assert tok_RB.max() <= 100
    # Rebuild the grid from the slots: every slice of a group counts on each of its ranks.
    rebuilt = np.zeros_like(tok_RB)
    for i in range(len(first)):
        for r in range(first[i], first[i] + k[i]):
            rebuilt[r, slot[i]] += tokens[i]
    np.testing.assert_array_equal(rebuilt, tok_RB)
    np.testing.assert_allclose(cost_RB.sum(1), [unit[0] + unit[1] + unit[6], unit[0] + unit[2]
                                                + unit[6], unit[0] + unit[3] + unit[4],
                                                unit[0] + unit[3] + unit[5]])


def test_heavy_micro_batches_are_aligned():
    # Two ranks with the same samples in opposite orders end up slot-aligned.
    first = np.array([0, 0, 0, 1, 1, 1])
    k = np.ones(6, np.int64)
    tokens = np.array([10, 90, 50, 90, 50, 10])
    unit = tokens.astype(float) ** 2
    slot, tok_RB, cost_RB, nb = pack(first, k, tokens, unit, 2, 100)
    np.testing.assert_array_equal(cost_RB[0], cost_RB[1])
    assert cost_RB.max(axis=0).sum() == cost_RB.sum(axis=1).max()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 4, 8]), st.integers(1, 80))
def test_budget_rank_totals_and_equal_slot_counts(seed, dp, n):
    # Random ranks and groups: the budget holds, every rank keeps its total, the grid is
    # rebuilt exactly from the slots, and no slot is empty on every rank.
    rng = np.random.default_rng(seed)
    k = np.minimum(2 ** rng.integers(0, 3, n), dp)
    first = rng.integers(0, dp, n) // k * k
    tokens = rng.integers(1, 101, n)
    unit = tokens.astype(float) ** 2 / k + rng.random(n)
    slot, tok_RB, cost_RB, nb = pack(first, k, tokens, unit, dp, 100)
    assert tok_RB.shape == (dp, nb) and tok_RB.max() <= 100
    rebuilt = np.zeros_like(tok_RB)
    total = np.zeros(dp)
    for i in range(n):
        rebuilt[first[i]:first[i] + k[i], slot[i]] += tokens[i]
        total[first[i]:first[i] + k[i]] += unit[i]
    np.testing.assert_array_equal(rebuilt, tok_RB)
    np.testing.assert_allclose(cost_RB.sum(axis=1), total, rtol=1e-9)
    assert np.all(tok_RB.max(axis=0) > 0)


def test_slots_follow_the_heights_other_ranks_set():
    # Rank 0 has one heavy sample and two light ones; rank 1 two medium and two light ones.
    # The mediums fill the gap under the heavy sample's height, the light ones the other slot:
    # Σ heights is the per-rank total, the FSDP step time of a perfect alignment.
    first = np.array([0, 0, 0, 1, 1, 1, 1])
    k = np.ones(7, np.int64)
    tokens = np.array([60, 20, 20, 30, 30, 20, 20])
    unit = np.array([6.0, 2.0, 2.0, 3.0, 3.0, 2.0, 2.0])
    slot, tok_RB, cost_RB, nb = pack(first, k, tokens, unit, 2, 60)
    assert cost_RB.max(axis=0).sum() == 10.0
