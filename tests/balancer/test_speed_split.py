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
    part_costs,
    slice_lengths,
    speed_fractions,
)
from omniscale.balancer.types import PlannerConfig, WindowSamples
from omniscale.dataplane.plan_table import rank_tables
from omniscale.plan import decode_plan, rescale_lengths
from omniscale.refs import SampleRef


def _times(share, speeds, t_K):
    return part_costs(1.0, share, t_K) / np.asarray(speeds)


def test_half_the_work_in_attention_a_rank_at_half_speed_holds_a_sixth_of_the_tokens():
    """φ = 1/2, speeds (1, 1/2): rank j's part is t_j/2 + 1/4. Equal finish times 2/3
    (= 1 / Σ speeds) need t = (5/6, 1/6)."""
    t_K = speed_fractions(0.5, np.array([1.0, 0.5]), 1e-3, 1.0)
    assert t_K.tolist() == pytest.approx([5 / 6, 1 / 6])
    assert _times(0.5, [1.0, 0.5], t_K).tolist() == pytest.approx([2 / 3, 2 / 3])


def test_a_slice_too_small_to_balance_is_clipped_and_the_slow_rank_sets_the_time():
    """φ = 0.8, speeds (1, 1/4): the slow rank's attention alone (0.4 of the work) takes 1.6,
    more than the 1/Σs = 0.8 a balance would need, so its slice is the least allowed."""
    t_K = speed_fractions(0.8, np.array([1.0, 0.25]), 0.01, 1.0)
    assert t_K.tolist() == pytest.approx([0.99, 0.01])
    assert _times(0.8, [1.0, 0.25], t_K).max() == pytest.approx((0.2 * 0.01 + 0.4) / 0.25)


def test_a_slice_is_never_over_its_budget():
    """Speeds (1, 1/2), no attention: balance asks t = (2/3, 1/3), but a slice may hold at
    most 0.6 of the tokens (the micro-batch budget): the fast rank takes 0.6, the slow 0.4."""
    t_K = speed_fractions(0.0, np.array([1.0, 0.5]), 0.01, 0.6)
    assert t_K.tolist() == pytest.approx([0.6, 0.4])


@pytest.mark.parametrize("k", [2, 4, 8])
def test_equal_speeds_give_equal_slices(k):
    assert speed_fractions(0.37, np.full(k, 0.8), 0.0, 1.0).tolist() == pytest.approx([1 / k] * k)


@settings(max_examples=80, deadline=None)
@given(st.floats(0.0, 0.95), st.floats(0.1, 1.0), st.floats(0.1, 1.0))
def test_two_ranks_no_fractions_finish_sooner(share, s0, s1):
    """Against every split of a 1,000-step grid: none has a smaller largest part time."""
    speeds = np.array([s0, s1])
    t_K = speed_fractions(share, speeds, 1e-3, 1.0)
    assert t_K.sum() == pytest.approx(1.0) and (t_K >= 1e-3 - 1e-12).all()
    grid = np.linspace(1e-3, 1 - 1e-3, 999)
    best = min(_times(share, speeds, np.array([g, 1 - g])).max() for g in grid)
    assert _times(share, speeds, t_K).max() <= best * (1 + 1e-9)


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
