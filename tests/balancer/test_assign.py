import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniscale.balancer.assign import assign_ranks, local_search, lpt


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1e6), min_size=1, max_size=60), st.integers(1, 9))
def test_local_search_never_worse_than_lpt(costs, dp):
    cost_N = np.array(costs)
    order = np.lexsort((np.arange(len(cost_N)), -cost_N))
    load_R = np.zeros(dp)
    rank_N = lpt(cost_N, order, load_R)
    lpt_max = load_R.max()
    local_search(cost_N, rank_N, np.ones(len(cost_N), np.bool_), load_R, 100, 4)
    assert load_R.max() <= lpt_max
    np.testing.assert_allclose(np.bincount(rank_N, cost_N, minlength=dp), load_R, rtol=1e-9,
                               atol=1e-6)
    # Greedy list scheduling's guarantee survives the search: mean + largest·(1 - 1/R).
    assert load_R.max() <= cost_N.sum() / dp + cost_N.max() * (1 - 1 / dp) + 1e-6


def test_local_search_fixes_a_bad_start():
    cost_N = np.array([5.0, 4.0, 3.0, 3.0, 3.0])
    rank_N = np.array([0, 0, 0, 0, 1])
    load_R = np.bincount(rank_N, cost_N, minlength=2).astype(float)
    local_search(cost_N, rank_N, np.ones(5, np.bool_), load_R, 50, 4)
    assert load_R.max() == 9.0  # optimum: {5, 4} vs {3, 3, 3}


def test_sp_groups_land_on_aligned_groups_first():
    unit = np.array([10.0, 1.0, 10.0, 2.0, 7.0])
    k = np.array([4, 1, 2, 1, 2])
    first, load = assign_ranks(unit, k, 8)
    assert first[0] % 4 == 0 and first[2] % 2 == 0 and first[4] % 2 == 0
    # The two pairs avoid the group of four.
    assert not (first[0] <= first[2] < first[0] + 4)
    assert not (first[0] <= first[4] < first[0] + 4)
    assert load.sum() == 4 * 10 + 1 + 2 * 10 + 2 + 2 * 7


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1e6), st.integers(1, 500)), min_size=1, max_size=60),
       st.integers(1, 9))
def test_a_token_cap_with_room_is_never_exceeded(samples, dp):
    cost_N = np.array([c for c, _ in samples])
    tokens_N = np.array([t for _, t in samples], np.int64)
    # room for every sample: the least-filled rank holds at most the mean, plus the largest
    cap = int(np.ceil(tokens_N.sum() / dp)) + int(tokens_N.max())
    first, load_R = assign_ranks(cost_N, np.ones(len(cost_N), np.int64), dp,
                                 slice_tokens_N=tokens_N, token_cap=cap)
    assert np.bincount(first, tokens_N, minlength=dp).max() <= cap
    np.testing.assert_allclose(np.bincount(first, cost_N, minlength=dp), load_R, rtol=1e-9,
                               atol=1e-6)


def test_a_tight_cap_trades_cost_balance_for_tokens():
    # costs 6, 3, 3 over two ranks: the cost balance is {6} vs {3, 3}; with tokens 1, 4, 4
    # that puts 8 tokens on one rank. A cap of 5 allows only {6, 3} (5 tokens) vs {3} (4).
    first, load_R = assign_ranks(np.array([6.0, 3.0, 3.0]), np.ones(3, np.int64), 2)
    assert sorted(load_R) == [6.0, 6.0]
    first, load_R = assign_ranks(np.array([6.0, 3.0, 3.0]), np.ones(3, np.int64), 2,
                                 slice_tokens_N=np.array([1, 4, 4]), token_cap=5)
    assert sorted(load_R) == [3.0, 9.0]
    assert sorted(np.bincount(first, np.array([1, 4, 4]), minlength=2)) == [4, 5]
