import numpy as np

from balancer.pack import pack


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
