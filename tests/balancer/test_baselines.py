"""Baseline policies: every sample once, equal micro-batch counts, each policy's defining rule;
the ``+split`` variants: the planner's split, no budget violation, no worse balance."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniscale.balancer.baselines import (
    BASELINES,
    BASELINES_NO_SPLIT,
    BASELINES_SPLIT,
    STATIC_LAYOUTS,
    _strided_groups,
    assemble,
    karmarkar_karp_equal,
    may_split,
    split_sizes,
)
from omniscale.balancer.cost import CommModel, CostModel, Costs
from omniscale.balancer.distributions import generate
from omniscale.balancer.metrics import exactly_once, violations
from omniscale.balancer.planner import plan_window
from omniscale.balancer.split import unit_cost
from omniscale.balancer.stream import take
from omniscale.balancer.types import PlannerConfig, WindowSamples, slice_tokens

COSTS = Costs(llm=CostModel(24576.0, 1.0), encoders=(CostModel(3072.0, 0.5),) * 3)
# SP all-to-all and reshard priced (25 GB/s, 7B-like shape; units of the cost above)
COMM_COSTS = Costs(llm=COSTS.llm, encoders=COSTS.encoders, **CommModel().collectives())


def check_plan(plan, samples: WindowSamples, dp: int, costs=COSTS) -> None:
    n = samples.num_samples
    once = exactly_once([plan], n, samples.num_items)
    assert once["ok"], once
    assert sorted(np.unique(plan.sample_P).tolist()) == list(range(n))
    k_N = np.ones(n, np.int64)
    k_N[plan.sample_P] = plan.sp_size_P
    if k_N.max() == 1:
        assert np.all(plan.sp_index_P == 0)
    for i in np.flatnonzero(k_N > 1):  # a group: aligned ranks, one slot, slices 0..k-1
        mine = plan.sample_P == i
        first = plan.rank_P[mine][plan.sp_index_P[mine] == 0][0]
        assert first % k_N[i] == 0
        assert sorted((plan.rank_P[mine] - first).tolist()) == list(range(k_N[i]))
        assert np.array_equal(plan.rank_P[mine] - first, plan.sp_index_P[mine])
        assert len(set(plan.micro_batch_P[mine].tolist())) == 1
    assert plan.mb_cost_RB.shape == plan.mb_tokens_RB.shape == (dp, plan.num_micro_batches)
    assert np.all(plan.micro_batch_P < plan.num_micro_batches) and np.all(plan.rank_P < dp)
    grid_RB = np.zeros((dp, plan.num_micro_batches), np.int64)
    np.add.at(grid_RB, (plan.rank_P, plan.micro_batch_P),
              slice_tokens(samples.tokens_N[plan.sample_P], plan.sp_size_P))
    assert np.array_equal(grid_RB, plan.mb_tokens_RB)
    unit_N = unit_cost(costs.llm(samples.tokens_N), samples.tokens_N, k_N,
                       costs.sp_comm_per_token)
    assert np.isclose(plan.mb_cost_RB.sum(), (unit_N * k_N).sum())
    assert plan.ddp_time >= plan.lower_bound * (1 - 1e-12)
    assert np.isclose(plan.encoder_cost_R.sum(),
                      costs.item_cost(samples.item_size_M, samples.item_kind_M).sum())
    slice0_N = np.zeros(n, np.int64)
    slice0_N[plan.sample_P[plan.sp_index_P == 0]] = plan.rank_P[plan.sp_index_P == 0]
    assert np.array_equal(plan.encode_rank_M, slice0_N[plan.item_sample_M])


@pytest.mark.parametrize("name", sorted({**BASELINES_NO_SPLIT, **BASELINES_SPLIT}))
@pytest.mark.parametrize("dist,n,dp", [("lognormal", 128, 8), ("omni", 300, 16),
                                       ("uniform", 5, 8), ("bimodal", 1000, 64)])
def test_every_sample_once_equal_micro_batch_counts(name, dist, n, dp):
    samples = generate(dist, n, seed=1)
    plan = BASELINES[name](samples, COSTS, PlannerConfig(dp=dp, micro_batch_tokens=16384))
    check_plan(plan, samples, dp)


def test_no_split_and_split_variants_are_labelled():
    assert set(BASELINES) == (set(BASELINES_NO_SPLIT) | set(BASELINES_SPLIT) | set(STATIC_LAYOUTS)
                              | {name + "+split" for name in STATIC_LAYOUTS})
    assert {name + "+split" for name in BASELINES_NO_SPLIT} == set(BASELINES_SPLIT)
    assert not any(may_split(name) for name in BASELINES_NO_SPLIT)
    assert all(may_split(name) for name in BASELINES_SPLIT)


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(1, 5000), min_size=1, max_size=80),
       dp=st.integers(1, 9), budget=st.integers(1, 8000),
       name=st.sampled_from(sorted(BASELINES_NO_SPLIT)))
def test_budget_kept_unless_one_sample_exceeds_it(tokens, dp, budget, name):
    samples = WindowSamples.from_lengths(tokens)
    plan = BASELINES[name](samples, COSTS, PlannerConfig(dp=dp, micro_batch_tokens=budget))
    check_plan(plan, samples, dp)
    over_RB = plan.mb_tokens_RB > budget
    for r, b in zip(*np.nonzero(over_RB)):
        inside = plan.sample_P[(plan.rank_P == r) & (plan.micro_batch_P == b)]
        assert len(inside) == 1 and samples.tokens_N[inside[0]] > budget


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(1, 40000), min_size=1, max_size=120),
       dp=st.sampled_from([1, 2, 3, 4, 6, 8, 16]), sp_max=st.sampled_from([1, 2, 4, 8, 32]),
       budget=st.sampled_from([1000, 4096, 16384]), comm=st.booleans(),
       name=st.sampled_from(sorted(BASELINES_SPLIT)))
def test_split_baselines_never_exceed_the_budget_and_keep_every_sample_once(
        tokens, dp, sp_max, budget, comm, name):
    k_max = min(sp_max, 1 << (dp.bit_length() - 1))
    samples = WindowSamples.from_lengths(np.minimum(tokens, budget * k_max))
    costs = COMM_COSTS if comm else COSTS
    config = PlannerConfig(dp=dp, micro_batch_tokens=budget, sp_max=sp_max)
    plan = BASELINES[name](samples, costs, config)
    check_plan(plan, samples, dp, costs)
    assert violations(plan, samples.tokens_N, dp, budget) == 0
    assert plan.mb_tokens_RB.max() <= budget
    # the planner's split: same group size for every sample
    k_N = np.ones(samples.num_samples, np.int64)
    k_N[plan.sample_P] = plan.sp_size_P
    assert np.array_equal(k_N, split_sizes(samples, costs, config))


@settings(max_examples=25, deadline=None)
@given(dp=st.sampled_from([8, 16, 32, 64]), per_rank=st.sampled_from([8, 16]),
       seed=st.integers(0, 2**31 - 1), sp_max=st.sampled_from([8, 32]), comm=st.booleans(),
       name=st.sampled_from(sorted(BASELINES_NO_SPLIT)))
def test_the_split_never_balances_worse_on_lognormal_streams(dp, per_rank, seed, sp_max, comm,
                                                             name):
    """Mean imbalance over 4 lognormal steps: with the split at most without it. (Per step it
    can lose: a split sample's k slices may leave the rest unevenly dealt; over a stream of
    steps with 8+ samples per rank that never showed in 7,680 tried cases.)"""
    stream = generate("lognormal", 4 * dp * per_rank, seed)
    costs = COMM_COSTS if comm else COSTS
    config = PlannerConfig(dp=dp, micro_batch_tokens=16384, sp_max=sp_max)
    whole, split = [], []
    for s in range(4):
        step = take(stream, s * dp * per_rank, (s + 1) * dp * per_rank)
        whole.append(BASELINES[name](step, costs, config).imbalance)
        split.append(BASELINES[name + "+split"](step, costs, config).imbalance)
    assert np.mean(split) <= np.mean(whole)


def test_split_sizes_are_the_planners():
    window = generate("lognormal", 4 * 8 * 16, 3)
    window = WindowSamples(**{**window.__dict__,
                              "batch_N": np.repeat(np.arange(4), 128).astype(np.int32)})
    for costs in (COSTS, COMM_COSTS):
        config = PlannerConfig(dp=8, micro_batch_tokens=16384, sp_max=8, window=4)
        ours = np.zeros(window.num_samples, np.int64)  # the group sizes the planner's plans run
        for plan in plan_window(window, costs, config):
            ours[plan.sample_P] = plan.sp_size_P
        assert np.array_equal(split_sizes(window, costs, config, n_steps=4), ours)
        assert ours.max() > 1


def test_strided_split_groups_follow_the_cursor():
    # whole -> 0; k=2 takes the aligned pair from the cursor (1 -> 2,3); whole -> 4;
    # k=4 from cursor 5 -> the aligned four at 8 = 0 (wrapped); whole -> 4
    assert _strided_groups(np.array([1, 2, 1, 4, 1]), 8).tolist() == [0, 2, 4, 0, 4]
    # 6 ranks hold one aligned group of 4: from cursor 1 it wraps to 0
    assert _strided_groups(np.array([1, 4, 2]), 6).tolist() == [0, 0, 4]


def test_split_piece_shares_one_slot_and_packs_around_it():
    # 30 tokens over k=2 on a budget of 20: 15 a rank in one slot; the 10s fill what is left
    samples = WindowSamples.from_lengths([30, 10, 10, 5])
    plan = BASELINES["token_lpt+split"](samples, COSTS, PlannerConfig(2, 20, sp_max=2))
    assert plan.sp_size_P[plan.sample_P == 0].tolist() == [2, 2]
    assert violations(plan, samples.tokens_N, 2, 20) == 0
    check_plan(plan, samples, 2)


def test_strided_is_round_robin_with_consecutive_micro_batches():
    samples = WindowSamples.from_lengths([10, 10, 10, 10, 10, 10, 1, 1])
    plan = BASELINES["strided"](samples, COSTS, PlannerConfig(dp=2, micro_batch_tokens=20))
    assert plan.rank_P.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert plan.micro_batch_P.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_first_fit_takes_contiguous_chunks_and_fills_earlier_slots():
    samples = WindowSamples.from_lengths([6, 6, 3, 4, 9, 9, 9, 9])
    plan = BASELINES["first_fit"](samples, COSTS, PlannerConfig(dp=2, micro_batch_tokens=10))
    assert plan.rank_P.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # 6 | 6 -> new slot; 3 fits slot 0; 4 fits slot 1
    assert plan.micro_batch_P[:4].tolist() == [0, 1, 0, 1]
    assert plan.num_micro_batches == 4  # rank 1 needs four; rank 0 is padded to four


def test_token_lpt_balances_tokens():
    samples = WindowSamples.from_lengths([8, 7, 6, 5, 4])
    plan = BASELINES["token_lpt"](samples, COSTS, PlannerConfig(dp=2, micro_batch_tokens=100))
    # 8 -> r0, 7 -> r1, 6 -> r1 (13), 5 -> r0 (13), 4 -> r0: the textbook LPT trace
    assert plan.mb_tokens_RB.sum(axis=1).tolist() == [17, 13]


def test_kk_cost_gives_equal_counts_and_beats_round_robin():
    samples = generate("uniform", 8 * 16 + 3, seed=3)
    cfg = PlannerConfig(dp=8, micro_batch_tokens=1 << 17)
    plan = BASELINES["kk_cost"](samples, COSTS, cfg)
    counts_R = np.bincount(plan.rank_P, minlength=8)
    assert counts_R.max() - counts_R.min() <= 1
    assert plan.ddp_time < BASELINES["strided"](samples, COSTS, cfg).ddp_time


def test_karmarkar_karp_equal_partition_of_known_values():
    rank_N = karmarkar_karp_equal(np.array([8.0, 7, 6, 5, 4, 3, 2, 1]), 2)
    sums = np.bincount(rank_N, weights=[8, 7, 6, 5, 4, 3, 2, 1])
    assert np.bincount(rank_N).tolist() == [4, 4] and sums.tolist() == [18.0, 18.0]
    assert karmarkar_karp_equal(np.zeros(0), 4).tolist() == []


def test_baselines_are_deterministic():
    samples = generate("omni", 200, seed=5)
    cfg = PlannerConfig(dp=8, micro_batch_tokens=16384)
    for policy in BASELINES.values():
        a, b = policy(samples, COMM_COSTS, cfg), policy(samples, COMM_COSTS, cfg)
        assert np.array_equal(a.rank_P, b.rank_P) and np.array_equal(a.micro_batch_P,
                                                                      b.micro_batch_P)


def test_assemble_lower_bound_is_mean_or_dearest_sample():
    samples = WindowSamples.from_lengths([100, 1, 1, 1])
    plan = assemble(samples, COSTS, PlannerConfig(dp=2, micro_batch_tokens=1000),
                    np.array([0, 1, 1, 1]), np.zeros(4, np.int64))
    assert plan.lower_bound == pytest.approx(float(COSTS.llm(100)))
    assert plan.imbalance == pytest.approx(plan.ddp_time / plan.rank_cost_R.mean())
