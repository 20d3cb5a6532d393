"""Baseline policies: every sample once, equal micro-batch counts, each policy's defining rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.baselines import BASELINES, assemble, karmarkar_karp_equal
from balancer.cost import CostModel, Costs
from balancer.distributions import generate
from balancer.types import PlannerConfig, WindowSamples

COSTS = Costs(llm=CostModel(24576.0, 1.0), encoders=(CostModel(3072.0, 0.5),) * 3)


def check_plan(plan, samples: WindowSamples, dp: int) -> None:
    n = samples.num_samples
    assert sorted(plan.sample_P.tolist()) == list(range(n))
    assert np.all(plan.sp_size_P == 1) and np.all(plan.sp_index_P == 0)
    assert plan.mb_cost_RB.shape == plan.mb_tokens_RB.shape == (dp, plan.num_micro_batches)
    assert np.all(plan.micro_batch_P < plan.num_micro_batches) and np.all(plan.rank_P < dp)
    grid_RB = np.zeros((dp, plan.num_micro_batches), np.int64)
    np.add.at(grid_RB, (plan.rank_P, plan.micro_batch_P), samples.tokens_N[plan.sample_P])
    assert np.array_equal(grid_RB, plan.mb_tokens_RB)
    assert np.isclose(plan.mb_cost_RB.sum(), COSTS.llm(samples.tokens_N).sum())
    assert plan.ddp_time >= plan.lower_bound * (1 - 1e-12)
    assert np.isclose(plan.encoder_cost_R.sum(),
                      COSTS.item_cost(samples.item_size_M, samples.item_kind_M).sum())
    assert np.array_equal(plan.encode_rank_M, plan.rank_P[np.argsort(plan.sample_P)]
                          [plan.item_sample_M])


@pytest.mark.parametrize("name", sorted(BASELINES))
@pytest.mark.parametrize("dist,n,dp", [("lognormal", 128, 8), ("omni", 300, 16),
                                       ("uniform", 5, 8), ("bimodal", 1000, 64)])
def test_every_sample_once_equal_micro_batch_counts(name, dist, n, dp):
    samples = generate(dist, n, seed=1)
    plan = BASELINES[name](samples, COSTS, PlannerConfig(dp=dp, micro_batch_tokens=16384))
    check_plan(plan, samples, dp)


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(1, 5000), min_size=1, max_size=80),
       dp=st.integers(1, 9), budget=st.integers(1, 8000), name=st.sampled_from(sorted(BASELINES)))
def test_budget_kept_unless_one_sample_exceeds_it(tokens, dp, budget, name):
    samples = WindowSamples.from_lengths(tokens)
    plan = BASELINES[name](samples, COSTS, PlannerConfig(dp=dp, micro_batch_tokens=budget))
    check_plan(plan, samples, dp)
    over_RB = plan.mb_tokens_RB > budget
    for r, b in zip(*np.nonzero(over_RB)):
        inside = plan.sample_P[(plan.rank_P == r) & (plan.micro_batch_P == b)]
        assert len(inside) == 1 and samples.tokens_N[inside[0]] > budget


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
        a, b = policy(samples, COSTS, cfg), policy(samples, COSTS, cfg)
        assert np.array_equal(a.rank_P, b.rank_P) and np.array_equal(a.micro_batch_P,
                                                                      b.micro_batch_P)


def test_assemble_lower_bound_is_mean_or_dearest_sample():
    samples = WindowSamples.from_lengths([100, 1, 1, 1])
    plan = assemble(samples, COSTS, PlannerConfig(dp=2, micro_batch_tokens=1000),
                    np.array([0, 1, 1, 1]), np.zeros(4, np.int64))
    assert plan.lower_bound == pytest.approx(float(COSTS.llm(100)))
    assert plan.imbalance == pytest.approx(plan.ddp_time / plan.rank_cost_R.mean())
