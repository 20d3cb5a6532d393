"""A split sample's slices sized by its ranks' speeds (``balancer.speed_split``), and what the
planner and the plan's table make of them.

Oracles: hand-solved cases of the equal-finish equations, a brute-force search over the token
fractions of a two-rank split, the cost model's terms recomputed by hand for a planned split,
and the rows of the served tables read back column by column."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniscale.balancer.cost import Costs
from omniscale.balancer.metrics import recount_tokens, violations
from omniscale.balancer.planner import plan_step
from omniscale.balancer.speed_split import (
    head_counts,
    part_costs,
    slice_lengths,
    speed_fractions,
    split_parts,
)
from omniscale.balancer.types import PlannerConfig, WindowSamples
from omniscale.dataplane.plan_table import rank_tables
from omniscale.plan import decode_plan, rescale_lengths
from omniscale.refs import SampleRef


def _even(k):
    return np.full(k, 1.0 / k)  # equal heads: each rank attends 1/k of them


def _times(share, speeds, t_K, g_K=None):
    g_K = _even(len(t_K)) if g_K is None else np.asarray(g_K, np.float64)
    return part_costs(1.0, share, t_K, g_K) / np.asarray(speeds)


def test_half_the_work_in_attention_a_rank_at_half_speed_holds_a_sixth_of_the_tokens():
    """φ = 1/2, speeds (1, 1/2): rank j's part is t_j/2 + 1/4. Equal finish times 2/3
    (= 1 / Σ speeds) need t = (5/6, 1/6)."""
    t_K = speed_fractions(0.5, np.array([1.0, 0.5]), 1e-3, 1.0, _even(2))
    assert t_K.tolist() == pytest.approx([5 / 6, 1 / 6])
    assert _times(0.5, [1.0, 0.5], t_K).tolist() == pytest.approx([2 / 3, 2 / 3])


def test_a_slice_too_small_to_balance_is_clipped_and_the_slow_rank_sets_the_time():
    """φ = 0.8, speeds (1, 1/4): the slow rank's attention alone (0.4 of the work) takes 1.6,
    more than the 1/Σs = 0.8 a balance would need, so its slice is the least allowed."""
    t_K = speed_fractions(0.8, np.array([1.0, 0.25]), 0.01, 1.0, _even(2))
    assert t_K.tolist() == pytest.approx([0.99, 0.01])
    assert _times(0.8, [1.0, 0.25], t_K).max() == pytest.approx((0.2 * 0.01 + 0.4) / 0.25)


def test_a_slice_is_never_over_its_budget():
    """Speeds (1, 1/2), no attention: balance asks t = (2/3, 1/3), but a slice may hold at
    most 0.6 of the tokens (the micro-batch budget): the fast rank takes 0.6, the slow 0.4."""
    t_K = speed_fractions(0.0, np.array([1.0, 0.5]), 0.01, 0.6, _even(2))
    assert t_K.tolist() == pytest.approx([0.6, 0.4])


@pytest.mark.parametrize("k", [2, 4, 8])
def test_equal_speeds_give_equal_slices(k):
    t_K = speed_fractions(0.37, np.full(k, 0.8), 0.0, 1.0, _even(k))
    assert t_K.tolist() == pytest.approx([1 / k] * k)


@settings(max_examples=80, deadline=None)
@given(st.floats(0.0, 0.95), st.floats(0.1, 1.0), st.floats(0.1, 1.0))
def test_two_ranks_no_fractions_finish_sooner(share, s0, s1):
    """Against every split of a 1,000-step grid: none has a smaller largest part time."""
    speeds = np.array([s0, s1])
    t_K = speed_fractions(share, speeds, 1e-3, 1.0, _even(2))
    assert t_K.sum() == pytest.approx(1.0) and (t_K >= 1e-3 - 1e-12).all()
    grid = np.linspace(1e-3, 1 - 1e-3, 999)
    best = min(_times(share, speeds, np.array([g, 1 - g])).max() for g in grid)
    assert _times(share, speeds, t_K).max() <= best * (1 + 1e-9)


@pytest.mark.parametrize("speeds, n_heads, heads", [
    ((1.0, 0.52), 4, [3, 1]),  # 2.63 / 1.37: the larger remainder takes the last head
    ((1.0, 0.9), 4, [2, 2]),
    ((1.0, 0.5), 32, [21, 11]),  # 21.33 / 10.67
    ((1.0, 0.01), 4, [3, 1]),  # every rank keeps a head
    ((1.0, 1.0, 0.5, 0.5), 4, [1, 1, 1, 1]),
    ((0.01, 0.01, 1.0, 0.01), 8, [1, 1, 5, 1]),  # 0.08 each -> 1, taken back from 7.77
])
def test_heads_go_by_speed_each_rank_keeping_one(speeds, n_heads, heads):
    assert head_counts(np.array(speeds), n_heads).tolist() == heads


def test_heads_by_speed_lift_the_bound_a_slice_at_the_budget_sets():
    """φ = 0.72, speeds (1, 1/2), a slice at most 0.6 of the tokens (the budget): with equal
    heads the fast rank is at the budget and the slow one holds 0.4, its part (0.28·0.4 +
    0.36) / 0.5 = 0.944. Heads (3, 1) of 4: parts 0.28·t + 0.54 and (0.28·(1 − t) + 0.18) / 0.5
    are equal at t = 0.38 / 0.84, both 2/3 of the work. At a budget of half the tokens both
    slices are full: only the heads move, parts 0.68 and 0.64."""
    t_K, h_K = split_parts(0.72, np.array([1.0, 0.5]), 1e-4, 0.6, 4)
    assert h_K.tolist() == [3, 1]
    assert t_K.tolist() == pytest.approx([0.38 / 0.84, 1 - 0.38 / 0.84], rel=1e-6)
    assert _times(0.72, [1.0, 0.5], t_K, [0.75, 0.25]).tolist() == pytest.approx([2 / 3] * 2)
    even_t, none = split_parts(0.72, np.array([1.0, 0.5]), 1e-4, 0.6, 0)  # heads unknown
    assert none.tolist() == [0, 0] and even_t.tolist() == pytest.approx([0.6, 0.4])
    assert _times(0.72, [1.0, 0.5], even_t).max() == pytest.approx(0.944)
    t_K, h_K = split_parts(0.72, np.array([1.0, 0.5]), 1e-4, 0.5, 4)
    assert h_K.tolist() == [3, 1] and t_K.tolist() == pytest.approx([0.5, 0.5])
    assert _times(0.72, [1.0, 0.5], t_K, [0.75, 0.25]).tolist() == pytest.approx([0.68, 0.64])


@settings(max_examples=80, deadline=None)
@given(st.floats(0.0, 0.95), st.lists(st.floats(0.1, 1.0), min_size=2, max_size=2) |
       st.lists(st.floats(0.1, 1.0), min_size=4, max_size=4),
       st.floats(0.26, 1.0), st.sampled_from([0, 4, 8, 32]))
def test_heads_are_sized_by_speed_only_when_the_group_finishes_sooner(share, speeds, hi,
                                                                      n_heads):
    """Against equal heads (the fractions alone): never a later slowest part; heads that sum
    to the model's, at least one each, or none (zeros) given."""
    s_K = np.array(speeds)
    k = len(s_K)
    hi = max(hi, 1.0 / k)
    t_K, h_K = split_parts(share, s_K, 1e-3, hi, n_heads)
    even_K = speed_fractions(share, s_K, 1e-3, hi, _even(k))
    assert t_K.sum() == pytest.approx(1.0) and (t_K <= hi + 1e-9).all()
    if h_K.any():
        assert n_heads >= k and h_K.sum() == n_heads and h_K.min() >= 1
        assert _times(share, s_K, t_K, h_K / n_heads).max() < _times(share, s_K, even_K).max()
    else:
        assert t_K.tolist() == even_K.tolist()


def test_whole_token_slices_keep_their_sum_and_at_least_one_token_each():
    assert slice_lengths(1000, np.array([0.6663, 0.3327, 0.001])).tolist() == [666, 333, 1]
    assert rescale_lengths([666, 333, 1], 1000) == [666, 333, 1]
    # a replacement of 500 tokens: cut where the planned sample was (333, 499.5 -> 500), the
    # last slice kept at one token
    assert rescale_lengths([666, 333, 1], 500) == [333, 166, 1]
    assert rescale_lengths([600, 400], 10) == [6, 4]
    assert rescale_lengths([1, 1, 98], 3) == [1, 1, 1]


def test_the_planner_sizes_a_split_samples_slices_by_its_ranks_speeds():
    """A 6,000-token document over two ranks at speeds (1, 0.55), 4,096-token budget: the
    balance would give the fast rank more than the budget, so it holds 4,096 and the slow
    rank 1,904; the slot's predicted costs are the cost model's terms recomputed by hand
    (attention β·L²/2 on each rank, the rest in proportion to the slice)."""
    alpha, beta = 1.39e-4, 4.73e-8
    costs = Costs.from_llm(alpha, beta)
    samples = WindowSamples.from_lengths([6000, 1500, 1200, 900, 800, 700])
    plan = plan_step(samples, costs, PlannerConfig(dp=2, micro_batch_tokens=4096,
                                                   rank_speed=(1.0, 0.55)))
    split = plan.sp_size_P > 1
    assert plan.sample_P[split].tolist() == [0, 0]
    by_index = dict(zip(plan.sp_index_P[split].tolist(), plan.sp_tokens_P[split].tolist()))
    assert by_index == {0: 4096, 1: 1904}
    assert plan.rank_P[split].tolist() == [0, 1] or plan.rank_P[split].tolist() == [1, 0]
    slot = int(plan.micro_batch_P[split][0])
    attention, rest = beta * 6000 ** 2, costs.llm(np.array([6000]))[0] - beta * 6000 ** 2
    whole_ranks = plan.rank_P[~split & (plan.micro_batch_P == slot)]
    for rank, length in ((0, 4096), (1, 1904)):
        if rank in whole_ranks.tolist():
            continue  # the slot's cost holds a whole sample too: not this oracle's
        assert plan.mb_cost_RB[rank, slot] == pytest.approx(attention / 2 + rest * length / 6000)
        assert plan.mb_tokens_RB[rank, slot] == length
    assert plan.imbalance < 1.05


def test_without_speeds_a_plan_keeps_equal_slices():
    costs = Costs.from_llm(1.39e-4, 4.73e-8)
    plan = plan_step(WindowSamples.from_lengths([6000, 1500, 1200]), costs,
                     PlannerConfig(dp=2, micro_batch_tokens=4096))
    assert plan.sp_tokens_P is None and (plan.sp_size_P > 1).any()


def test_each_rank_of_the_group_is_served_every_slice_length():
    """The served tables: both ranks' rows of the split sample list (4096, 1904) in slice
    order; a whole sample's row lists none. Decoded, the micro-batch hands them to collate."""
    costs = Costs.from_llm(1.39e-4, 4.73e-8)
    lengths = [6000, 1500, 1200, 900, 800, 700]
    plan = plan_step(WindowSamples.from_lengths(lengths), costs,
                     PlannerConfig(dp=2, micro_batch_tokens=4096, rank_speed=(1.0, 0.55)))
    refs = [SampleRef(0, "docs", "s0", f"k{i}", 0, 1, llm_tokens=n, text_tokens=n)
            for i, n in enumerate(lengths)]
    tables = rank_tables(plan, refs, np.zeros(len(lengths), np.int64), step=0, dp=2)
    for table in tables:
        rows = table.to_pylist()
        assert {row["key"]: row["sp_slices"] for row in rows if row["key"] == "k0"} == \
            {"k0": [4096, 1904]}
        assert all(row["sp_slices"] is None for row in rows if row["key"] != "k0")
        decoded = decode_plan(table)
        seqs = [s for mb in decoded.micro_batches for s in mb.sequences() if s[0].key == "k0"]
        assert [s[3] for s in seqs] == [(4096, 1904)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(50, 3000), min_size=4, max_size=24),
       st.lists(st.sampled_from([0.3, 0.55, 0.8, 1.0]), min_size=4, max_size=4),
       st.sampled_from([2, 4]))
def test_slices_by_speed_cover_their_sample_and_keep_the_budget(lengths, speeds, dp):
    """Every split sample's slices sum to its tokens, each holds a token or more, and every
    micro-batch's tokens, recounted from the placements, are the plan's and within budget."""
    budget = 1024
    lengths = [min(n, budget * dp) for n in lengths]  # longer cannot run at all
    costs = Costs.from_llm(1.39e-4, 4.73e-8)
    samples = WindowSamples.from_lengths(lengths)
    plan = plan_step(samples, costs, PlannerConfig(dp=dp, micro_batch_tokens=budget, sp_max=dp,
                                                   rank_speed=tuple(speeds[:dp])))
    split = plan.sp_size_P > 1
    for i in np.unique(plan.sample_P[split]).tolist():
        mine = plan.sample_P == i
        assert plan.sp_tokens_P[mine].sum() == lengths[i]
        assert plan.sp_tokens_P[mine].min() >= 1
    recounted = recount_tokens(plan, samples.tokens_N, dp)
    np.testing.assert_array_equal(recounted[:, :plan.num_micro_batches], plan.mb_tokens_RB)
    assert violations(plan, samples.tokens_N, dp, budget) == 0


def _fsdp_by_hand(plan, lengths, costs, speeds, micro_batch):
    """A plan's step recomputed from its placements and the cost model: per slot the slowest
    rank's time, plus the slot's fixed cost. A whole sample costs c(L); a slice of T of L
    tokens β·L²/2 (its heads' attention over the whole sequence) plus (c(L) − β·L²)·T/L."""
    beta = costs.llm.beta
    c = costs.llm(lengths)
    work_RB = np.zeros((2, plan.num_micro_batches))
    tokens_P = plan.sp_tokens_P if plan.sp_tokens_P is not None else np.zeros(len(plan.rank_P))
    for i, rank, slot, k, tokens in zip(plan.sample_P, plan.rank_P, plan.micro_batch_P,
                                        plan.sp_size_P, tokens_P):
        L = lengths[i]
        work_RB[rank, slot] += c[i] if k == 1 else \
            beta * L * L / 2 + (c[i] - beta * L * L) * tokens / L
    np.testing.assert_allclose(work_RB, plan.mb_cost_RB)
    return (work_RB / speeds[:, None]).max(axis=0).sum() + micro_batch * work_RB.shape[1]


def test_a_step_of_few_samples_splits_some_to_follow_the_speeds(monkeypatch):
    """Six long samples on ranks at speeds (1, 0.55), a micro-batch's fixed cost 70 ms: dealt
    whole, the slow rank's share moves a sample at a time (0.44 of the work, 3.04 s); splitting
    samples over the pair with slices sized to the speeds gets the step, recomputed by hand
    from the placements, more than 10 % shorter."""
    import omniscale.balancer.planner as planner

    costs = Costs.from_llm(1.39e-4, 4.73e-8, micro_batch=0.07)
    lengths = np.array([3000, 2900, 2500, 2400, 2000, 1800])
    speeds = np.array([1.0, 0.55])
    config = PlannerConfig(dp=2, micro_batch_tokens=4096, rank_speed=tuple(speeds))
    split = plan_step(WindowSamples.from_lengths(lengths), costs, config)
    monkeypatch.setattr(planner, "BALANCING_SPLITS", 0)
    whole = plan_step(WindowSamples.from_lengths(lengths), costs, config)
    assert (split.sp_size_P > 1).any() and (whole.sp_size_P == 1).all()
    by_hand = [_fsdp_by_hand(p, lengths, costs, speeds, 0.07) for p in (split, whole)]
    assert by_hand[0] < 0.9 * by_hand[1], by_hand


def test_the_planner_sizes_heads_by_speed_where_the_budget_holds_the_fast_rank():
    """An 8,191-token document (attention ~70 % of its cost) over two ranks at speeds (1, 0.52),
    4,096-token budget: both slices are at the budget, so only heads can move -- 3 of the
    model's 4 to the fast rank. The slot's predicted costs are the cost model's terms
    recomputed by hand (attention β·L² × h/4 on each rank, the rest in proportion to the
    slice), the predicted step shorter than with H/k heads, and the served tables list the
    group's heads on both ranks' rows of the document, decoded for collate."""
    alpha, beta = 1.35e-4, 4.3e-8
    costs = Costs.from_llm(alpha, beta)
    lengths = [8191, 1500, 1200, 900, 800, 700]
    samples = WindowSamples.from_lengths(lengths)
    config = PlannerConfig(dp=2, micro_batch_tokens=4096, rank_speed=(1.0, 0.52), n_heads=4)
    plan = plan_step(samples, costs, config)
    split = plan.sp_size_P > 1
    assert plan.sample_P[split].tolist() == [0, 0]
    rank_of = dict(zip(plan.sp_index_P[split].tolist(), plan.rank_P[split].tolist()))
    heads = dict(zip(plan.rank_P[split].tolist(), plan.sp_heads_P[split].tolist()))
    tokens = dict(zip(plan.rank_P[split].tolist(), plan.sp_tokens_P[split].tolist()))
    assert heads == {0: 3, 1: 1} and sorted(tokens.values()) == [4095, 4096]
    assert (plan.sp_heads_P[~split] == 0).all()
    slot = int(plan.micro_batch_P[split][0])
    attention, rest = beta * 8191 ** 2, costs.llm(np.array([8191]))[0] - beta * 8191 ** 2
    whole_ranks = plan.rank_P[~split & (plan.micro_batch_P == slot)].tolist()
    for rank in (0, 1):
        if rank not in whole_ranks:  # a slot holding a whole sample too: not this oracle's
            assert plan.mb_cost_RB[rank, slot] == pytest.approx(
                attention * heads[rank] / 4 + rest * tokens[rank] / 8191)
    even = plan_step(samples, costs, PlannerConfig(dp=2, micro_batch_tokens=4096,
                                                   rank_speed=(1.0, 0.52)))
    assert even.sp_heads_P is None
    assert plan.mb_time_RB.max(axis=0).sum() < even.mb_time_RB.max(axis=0).sum()

    refs = [SampleRef(0, "docs", "s0", f"k{i}", 0, 1, llm_tokens=n, text_tokens=n)
            for i, n in enumerate(lengths)]
    want = [heads[rank_of[j]] for j in range(2)]
    for table in rank_tables(plan, refs, np.zeros(len(lengths), np.int64), step=0, dp=2):
        rows = table.to_pylist()
        assert [row["sp_heads"] for row in rows if row["key"] == "k0"] == [want]
        assert all(row["sp_heads"] is None for row in rows if row["key"] != "k0")
        decoded = decode_plan(table)
        seqs = [s for mb in decoded.micro_batches for s in mb.sequences()]
        assert [s[4] for s in seqs if s[0].key == "k0"] == [tuple(want)]
        assert all(s[4] is None for s in seqs if s[0].key != "k0")
