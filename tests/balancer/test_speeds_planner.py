"""Ranks of different speeds (``PlannerConfig.rank_speed``): the planner gives a slower rank
proportionally less work.

Oracles: exhaustive search over every assignment of a small step (the optimum of the largest
per-rank time), the speed-proportional ideal of a large one (total work over summed speed),
and the speed-blind plan judged by the same speeds."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniscale.balancer.assign import assign_ranks
from omniscale.balancer.cost import Costs
from omniscale.balancer.encoder_plan import plan_encoders
from omniscale.balancer.planner import plan_window
from omniscale.balancer.types import PlannerConfig, WindowSamples


def _optimum(cost_N: np.ndarray, speed_R: np.ndarray) -> float:
    """The least possible largest per-rank time, by trying every assignment."""
    best = np.inf
    for ranks in itertools.product(range(len(speed_R)), repeat=len(cost_N)):
        time_R = np.bincount(ranks, weights=cost_N, minlength=len(speed_R)) / speed_R
        best = min(best, time_R.max())
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=7),
       st.lists(st.sampled_from([0.25, 0.5, 0.75, 1.0]), min_size=2, max_size=3))
def test_assignment_by_speed_is_within_lpts_bound_of_the_optimum(costs, speeds):
    """LPT by finish time on ranks of different speeds is within 2·R/(R+1) of the optimum
    (Gonzalez, Ibarra and Sahni, 1977); the local search only improves it."""
    cost_N, speed_R = np.array(costs, np.float64), np.array(speeds)
    first_N, time_R = assign_ranks(cost_N, np.ones(len(cost_N), np.int64), len(speed_R),
                                   speed_R=speed_R)
    expected = np.bincount(first_N, weights=cost_N, minlength=len(speed_R)) / speed_R
    np.testing.assert_allclose(time_R, expected)  # the returned loads are times
    dp = len(speed_R)
    assert time_R.max() <= 2 * dp / (dp + 1) * _optimum(cost_N, speed_R) * (1 + 1e-9)


def test_a_rank_at_half_speed_gets_a_third_of_the_work():
    """Two ranks, one at half speed: the perfect split gives it 1/3 of the work and both the
    same time. The planner's window comes within a few percent of that, where the speed-blind
    plan (judged by the same speeds) leaves the slow rank a third longer than the ideal."""
    rng = np.random.default_rng(7)
    samples = WindowSamples.from_lengths(rng.integers(100, 3000, 64),
                                         batch_N=np.repeat(np.arange(4), 16))
    costs = Costs.from_llm(1.0, 1 / 5500)
    speeds = (1.0, 0.5)
    aware = plan_window(samples, costs, PlannerConfig(dp=2, micro_batch_tokens=8192, window=4,
                                                      rank_speed=speeds))
    blind = plan_window(samples, costs, PlannerConfig(dp=2, micro_batch_tokens=8192, window=4))
    for a, b in zip(aware, blind):
        b.speed_R = np.array(speeds)  # judged by the speeds it was not given
        cost_R = a.rank_cost_R
        ideal = cost_R.sum() / sum(speeds)  # every rank done at once
        assert cost_R[1] / cost_R.sum() == pytest.approx(1 / 3, abs=0.02)
        assert a.ddp_time <= 1.02 * ideal
        assert b.ddp_time >= 1.3 * ideal
        assert a.imbalance <= 1.02 < 1.3 <= b.imbalance
        assert a.lower_bound == pytest.approx(ideal)


def test_equal_speeds_given_plan_as_equal_ranks():
    rng = np.random.default_rng(3)
    samples = WindowSamples.from_lengths(rng.integers(100, 3000, 40),
                                         batch_N=np.repeat(np.arange(4), 10))
    costs = Costs.from_llm(1.0, 1 / 5500, micro_batch=50.0)
    plain = plan_window(samples, costs, PlannerConfig(dp=4, micro_batch_tokens=4096))
    equal = plan_window(samples, costs, PlannerConfig(dp=4, micro_batch_tokens=4096,
                                                      rank_speed=(1.0,) * 4))
    for p, e in zip(plain, equal):
        np.testing.assert_array_equal(p.sample_P, e.sample_P)
        np.testing.assert_array_equal(p.rank_P, e.rank_P)
        assert p.fsdp_time == pytest.approx(e.fsdp_time)


def test_encoder_items_go_where_they_finish_first():
    """Eight equal items, consumed on rank 0, ranks at speeds 1 and 1/3: balanced by time the
    fast rank encodes 6 and the slow one 2 (time 6 against 6), not 4 and 4 (time 12)."""
    plan = plan_encoders(np.ones(8), np.ones(8, np.int64), np.zeros(8, np.int32), 2,
                         reshard_per_token=0.0, speed_R=np.array([1.0, 1 / 3]))
    assert plan.reshard
    assert np.bincount(plan.encode_rank_M, minlength=2).tolist() == [6, 2]
    assert plan.encoder_cost_R.tolist() == pytest.approx([6.0, 2.0])  # work, not time


@pytest.mark.parametrize("speeds", [(1.0,), (1.0, 0.0), (1.0, float("nan"))])
def test_bad_speeds_are_refused_naming_the_field(speeds):
    with pytest.raises(ValueError, match="^rank_speed: one finite speed > 0 per rank"):
        PlannerConfig(dp=2, micro_batch_tokens=10, rank_speed=speeds)
