"""Invariants of plan_window on random windows (hypothesis)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniscale.balancer.cost import CostModel, Costs
from omniscale.balancer.planner import plan_step, plan_window
from omniscale.balancer.types import PlannerConfig, WindowSamples, slice_tokens

COSTS = Costs(llm=CostModel(50.0, 1.0, 10.0),
              encoders=(CostModel(2.0, 0.01), CostModel(1.0, 0.02), CostModel(0.5, 0.0)),
              sp_comm_per_token=0.5, reshard_per_token=0.1)


@st.composite
def windows(draw):
    dp = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    window = draw(st.integers(1, 4))
    sp_max = draw(st.sampled_from([1, 2, 4, 8]))
    budget = draw(st.sampled_from([256, 1000, 4096]))
    k_max = min(sp_max, 1 << (dp.bit_length() - 1))
    n = draw(st.integers(1, 120))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    tokens = np.clip(rng.lognormal(draw(st.floats(2.0, 6.0)), draw(st.floats(0.1, 2.0)), n),
                     1, budget * k_max).astype(np.int64)
    n_items = rng.integers(0, 4, n) * (rng.random(n) < 0.5)
    offsets = np.concatenate([[0], np.cumsum(n_items)]).astype(np.int64)
    m = int(offsets[-1])
    samples = WindowSamples(
        tokens_N=tokens,
        source_N=rng.integers(0, 3, n).astype(np.int32),
        batch_N=rng.integers(0, window, n).astype(np.int32),
        item_offsets_N1=offsets,
        item_size_M=rng.integers(1, 2000, m).astype(np.int64),
        item_kind_M=rng.integers(0, 3, m).astype(np.int8),
        item_tokens_M=rng.integers(1, 300, m).astype(np.int64),
    )
    config = PlannerConfig(dp=dp, micro_batch_tokens=budget, window=window, sp_max=sp_max,
                           epsilon=draw(st.sampled_from([0.02, 0.05, 0.2])))
    return samples, config


def check_plan(samples: WindowSamples, config: PlannerConfig, plans):
    assert [p.step for p in plans] == list(range(config.window))
    seen = np.zeros(samples.num_samples, np.int64)
    items_seen = np.zeros(samples.num_items, np.int64)
    for p in plans:
        R, B = config.dp, p.num_micro_batches
        assert p.mb_cost_RB.shape == (R, B) and p.mb_tokens_RB.shape == (R, B)
        assert B >= 1 or len(p.sample_P) == 0
        assert np.all((0 <= p.micro_batch_P) & (p.micro_batch_P < B))
        assert np.all((0 <= p.rank_P) & (p.rank_P < R))
        # Budget: rebuild the token grid from the placements; it matches and never exceeds.
        grid = np.zeros((R, B), np.int64)
        np.add.at(grid, (p.rank_P, p.micro_batch_P),
                  slice_tokens(samples.tokens_N[p.sample_P], p.sp_size_P))
        np.testing.assert_array_equal(grid, p.mb_tokens_RB)
        assert p.mb_tokens_RB.max(initial=0) <= config.micro_batch_tokens
        # Each sample: k placements, sp_index 0..k-1 on an aligned group, one slot.
        for s in np.unique(p.sample_P):
            rows = np.flatnonzero(p.sample_P == s)
            k = int(p.sp_size_P[rows[0]])
            assert len(rows) == k and np.all(p.sp_size_P[rows] == k)
            order = np.argsort(p.sp_index_P[rows])
            np.testing.assert_array_equal(p.sp_index_P[rows][order], np.arange(k))
            ranks = p.rank_P[rows][order]
            assert ranks[0] % k == 0
            np.testing.assert_array_equal(ranks, ranks[0] + np.arange(k))
            assert len(set(p.micro_batch_P[rows].tolist())) == 1
            seen[s] += 1
        assert np.all(p.displacement_P <= config.window - 1)
        np.testing.assert_array_equal(p.displacement_P,
                                      np.abs(p.step - samples.batch_N[p.sample_P]))
        if len(p.sample_P):
            assert p.rank_cost_R.max() >= p.lower_bound * (1 - 1e-9)
        # Encoder items of the step's samples, each once, consumed where slice 0 runs.
        step_samples = np.unique(p.sample_P)
        offs = samples.item_offsets_N1
        expect = np.concatenate([np.arange(offs[s], offs[s + 1]) for s in step_samples]) \
            if len(step_samples) else np.zeros(0, np.int64)
        np.testing.assert_array_equal(np.sort(p.item_M), np.sort(expect))
        items_seen[p.item_M] += 1
        head = (p.sp_index_P == 0)
        rank_of = dict(zip(p.sample_P[head].tolist(), p.rank_P[head].tolist()))
        assert [rank_of[s] for s in p.item_sample_M.tolist()] == p.consume_rank_M.tolist()
        assert np.all((0 <= p.encode_rank_M) & (p.encode_rank_M < R))
        if not p.reshard:
            np.testing.assert_array_equal(p.encode_rank_M, p.consume_rank_M)
    np.testing.assert_array_equal(seen, 1)
    np.testing.assert_array_equal(items_seen, 1)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows())
def test_plan_window_invariants(window):
    samples, config = window
    plans = plan_window(samples, COSTS, config)
    check_plan(samples, config, plans)
    again = plan_window(samples, COSTS, config)
    for a, b in zip(plans, again):
        for name in ("sample_P", "rank_P", "micro_batch_P", "sp_size_P", "sp_index_P",
                     "mb_cost_RB", "mb_tokens_RB", "item_M", "encode_rank_M", "consume_rank_M"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert a.lower_bound == b.lower_bound and a.reshard == b.reshard


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([2, 3, 4]), st.sampled_from([4, 8]),
       st.sampled_from([0.03, 0.05, 0.1]))
def test_token_bounds_hold_for_many_small_samples(seed, window, dp, eps):
    # Feasible by construction: hundreds of samples per step, each far below ε·T.
    rng = np.random.default_rng(seed)
    n = window * dp * 30
    tokens = rng.integers(20, 200, n)
    samples = WindowSamples.from_lengths(tokens, rng.integers(0, 3, n),
                                         rng.integers(0, window, n))
    config = PlannerConfig(dp=dp, micro_batch_tokens=1024, window=window, sp_max=4,
                           epsilon=eps)
    plans = plan_window(samples, COSTS, config)
    target = tokens.sum() / len(plans)
    src = samples.source_N
    share = np.bincount(src, tokens, minlength=3) / tokens.sum()
    for p in plans:
        mine = np.unique(p.sample_P)
        assert abs(tokens[mine].sum() / target - 1) <= eps
        step_share = np.bincount(src[mine], tokens[mine], minlength=3) / tokens[mine].sum()
        assert np.abs(step_share - share).max() <= eps
        assert p.imbalance < 1.2


def test_plan_step_is_the_one_step_window():
    rng = np.random.default_rng(3)
    samples = WindowSamples.from_lengths(rng.integers(1, 3000, 200))
    config = PlannerConfig(dp=8, micro_batch_tokens=1024, window=1, sp_max=8)
    one = plan_step(samples, COSTS, config)
    (win,) = plan_window(samples, COSTS, config)
    np.testing.assert_array_equal(one.rank_P, win.rank_P)
    np.testing.assert_array_equal(one.mb_cost_RB, win.mb_cost_RB)
    check_plan(samples, config, [one])
    assert one.imbalance < 1.05


def test_empty_window_and_bad_batch():
    config = PlannerConfig(dp=2, micro_batch_tokens=100, window=2)
    empty = plan_window(WindowSamples.from_lengths([]), COSTS, config)
    assert [p.num_micro_batches for p in empty] == [0, 0]
    assert all(p.mb_cost_RB.shape == (2, 0) and p.lower_bound == 0.0 for p in empty)
    with pytest.raises(ValueError, match="outside a window of 2"):
        plan_window(WindowSamples.from_lengths([5, 5], batch_N=[0, 2]), COSTS, config)
