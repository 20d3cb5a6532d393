import numpy as np
import pytest
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


def _lpt_capped_by_the_docstring(cost_N, tokens_N, order_N, load_R, tok_R, cap, inv_R):
    """`lpt_capped` as its docstring states it, a scan in plain Python: each sample in order
    onto the rank with room where it finishes first (lowest index on ties), else onto the
    least-filled rank; samples not in the order get rank -1."""
    rank_N = [-1] * len(cost_N)
    for i in order_N:
        room = [r for r in range(len(load_R)) if tok_R[r] + tokens_N[i] <= cap]
        if room:
            best = min(room, key=lambda r: (load_R[r] + cost_N[i] * inv_R[r], r))
        else:
            best = min(range(len(load_R)), key=lambda r: (tok_R[r], r))
        rank_N[i] = best
        load_R[best] += cost_N[i] * inv_R[best]
        tok_R[best] += tokens_N[i]
    return rank_N


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 50)), min_size=1, max_size=40),
       st.lists(st.sampled_from([1.0, 0.5, 2.0, 4.0]), min_size=1, max_size=6),
       st.integers(1, 200), st.booleans(), st.randoms(use_true_random=False))
def test_capped_lpt_on_ranks_of_different_speeds_follows_its_definition(samples, inv_speeds,
                                                                       cap, uniform, rng):
    """Costs are integers (as floats) so that sums are exact and ties are real ties; some
    samples are left out of the order; equal speeds take the tournament-tree path."""
    from omniscale.balancer.assign import lpt_capped

    cost_N = np.array([float(c) for c, _ in samples])
    tokens_N = np.array([t for _, t in samples], np.int64)
    inv_R = np.ones(len(inv_speeds)) if uniform else np.array(inv_speeds)
    order_N = np.array(rng.sample(range(len(samples)), rng.randint(0, len(samples))), np.int64)
    load_R, tok_R = np.zeros(len(inv_R)), np.zeros(len(inv_R), np.int64)
    expected_load, expected_tok = [0.0] * len(inv_R), [0] * len(inv_R)
    expected = _lpt_capped_by_the_docstring(cost_N, tokens_N, order_N, expected_load,
                                            expected_tok, cap, inv_R)
    rank_N = lpt_capped(cost_N, tokens_N, order_N, load_R, tok_R, cap, inv_R, uniform)
    assert rank_N.tolist() == expected
    assert load_R.tolist() == expected_load and tok_R.tolist() == expected_tok


@pytest.mark.parametrize("uniform", [False, True])
def test_capped_lpt_by_hand(uniform):
    from omniscale.balancer.assign import lpt_capped

    def run(cost, tokens, order, cap, inv=(1.0, 1.0)):
        load_R, tok_R = np.zeros(len(inv)), np.zeros(len(inv), np.int64)
        rank_N = lpt_capped(np.array(cost, float), np.array(tokens, np.int64),
                            np.array(order, np.int64), load_R, tok_R, cap, np.array(inv),
                            uniform)
        return rank_N.tolist(), load_R.tolist(), tok_R.tolist()

    # room everywhere: the third sample ties (11 either way) and takes rank 0, not the rank
    # with fewer tokens
    assert run([10, 10, 1], [5, 1, 1], [0, 1, 2], 100) == ([0, 1, 0], [11.0, 10.0], [6, 1])
    # a cap of 4 tokens: the second sample has room only on rank 1, the third nowhere, and
    # goes to the least-filled rank (a tie: rank 0)
    assert run([1, 1, 1], [3, 3, 3], [0, 1, 2], 4) == ([0, 1, 0], [2.0, 1.0], [6, 3])
    # a sample left out of the order has no rank
    assert run([5, 5, 5], [1, 1, 1], [2, 0], 100)[0] == [1, -1, 0]  # sample 2 came first
    if not uniform:  # rank 1 twice as fast: a sample of cost 4 takes it 2
        assert run([4, 4, 4], [1, 1, 1], [0, 1, 2], 100, inv=(1.0, 0.5)) == (
            [1, 0, 1], [4.0, 4.0], [1, 2])


def test_sp_group_sizes_must_be_powers_of_two_within_the_ranks():
    from omniscale.balancer.assign import place_sp_groups

    cost_N = np.array([3.0, 2.0, 1.0])
    # sizes 1, 2 and 4 on 4 ranks are placed (1 is a power of two: a sample alone)
    first_N = place_sp_groups(cost_N, np.array([4, 2, 1]), np.array([0, 1, 2]), np.zeros(4))
    assert first_N.tolist() == [0, 0, 2]  # ties: the lowest group
    for sizes in ([3, 2, 1], [0, 2, 1], [8, 2, 1]):
        with pytest.raises(ValueError, match=r"powers of two <= 4 ranks, got \["):
            place_sp_groups(cost_N, np.array(sizes), np.array([0, 1, 2]), np.zeros(4))


def test_whole_samples_go_costliest_first():
    # without the search: LPT puts the 2 first (rank 0), then the 1s on rank 1: 2 / 2; the
    # cheapest first would give 3 / 1
    first_N, load_R = assign_ranks(np.array([1.0, 1.0, 2.0]), np.ones(3, np.int64), 2,
                                   search_iters=0)
    assert first_N.tolist() == [1, 1, 0] and load_R.tolist() == [2.0, 2.0]


def test_a_split_samples_tokens_count_against_the_cap_on_its_ranks():
    # sample 0 is split over both ranks with 5 tokens on each; a cap of 10 leaves room for one
    # more sample of 5 per rank: sample 1 (cost 10) on rank 0, sample 2 on rank 1, sample 3
    # finds no room and goes to the least filled (a tie: rank 0)
    first_N, _ = assign_ranks(np.array([1.0, 10.0, 1.0, 1.0]), np.array([2, 1, 1, 1]), 2,
                              search_iters=0, slice_tokens_N=np.array([5, 5, 5, 5]),
                              token_cap=10)
    assert first_N.tolist() == [0, 0, 1, 0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=2, max_size=30),
       st.lists(st.sampled_from([1.0, 0.5, 2.0, 0.25]), min_size=2, max_size=5),
       st.randoms(use_true_random=False))
def test_the_search_on_ranks_of_different_speeds_keeps_each_ranks_time(costs, inv_speeds, rng):
    cost_N = np.array(costs, float)
    inv_R = np.array(inv_speeds)
    rank_N = np.array([rng.randrange(len(inv_R)) for _ in costs], np.int64)
    load_R = np.bincount(rank_N, cost_N * inv_R[rank_N], minlength=len(inv_R))
    before = load_R.max()
    local_search(cost_N, rank_N, np.ones(len(cost_N), np.bool_), load_R, 100, 4,
                 inv_speed_R=inv_R)
    # each rank's time is its samples' cost over its speed, and the slowest finishes no later
    np.testing.assert_allclose(load_R, np.bincount(rank_N, cost_N * inv_R[rank_N],
                                                   minlength=len(inv_R)), rtol=1e-9, atol=1e-9)
    assert load_R.max() <= before + 1e-9


def test_a_move_over_the_cap_is_skipped_for_one_within_it():
    # rank 0: sample 0 (cost 5, 9 tokens) and sample 1 (cost 4, 1 token); rank 1: sample 2
    # (cost 1, 5 tokens); cap 10. Sample 0 cannot move (14 tokens on rank 1); sample 1 can,
    # which evens the ranks at 5 / 5 (a swap of 0 and 2 would too, but a move is tried first)
    cost_N, tokens_N = np.array([5.0, 4.0, 1.0]), np.array([9, 1, 5])
    rank_N = np.array([0, 0, 1])
    load_R = np.array([9.0, 1.0])
    tok_R = np.array([10, 5])
    local_search(cost_N, rank_N, np.ones(3, np.bool_), load_R, 10, 4, tokens_N, tok_R, 10)
    assert rank_N.tolist() == [0, 1, 1] and load_R.tolist() == [5.0, 5.0]
    assert tok_R.tolist() == [9, 6]
