"""The static SP layout (``baselines.static_sp``): every sample sharded over the SP group,
packed under the per-rank budget, deterministic; reachable by name through the plane's
``plan_policy`` and the trainer's ``data.balance``. Oracles: hand-traced small cases, and
recounts from the placements alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniscale.balancer.baselines import BASELINES, STATIC_LAYOUTS
from omniscale.balancer.cost import CostModel, Costs
from omniscale.balancer.distributions import generate
from omniscale.balancer.metrics import exactly_once, recount_tokens, violations
from omniscale.balancer.types import PlannerConfig, WindowSamples
from omniscale.dataplane.windows import plan_policy, replan_tail

LINEAR = Costs(llm=CostModel(1.0, 0.0))  # a sample costs its tokens
ENC = Costs(llm=CostModel(1.0, 0.0), encoders=(CostModel(1.0, 0.0),) * 3)


def placements(plan) -> dict[int, list[tuple[int, int, int]]]:
    """sample -> sorted (rank, sp_index, slot) of its rows."""
    out: dict[int, list] = {}
    for i, r, j, b in zip(plan.sample_P.tolist(), plan.rank_P.tolist(),
                          plan.sp_index_P.tolist(), plan.micro_batch_P.tolist()):
        out.setdefault(i, []).append((r, j, b))
    return {i: sorted(v) for i, v in out.items()}


def test_one_group_hand_traced():
    # slices ⌈L/2⌉ = 6 3 2 2 1, first-fit decreasing under 10 a rank:
    # 6 -> slot 0; 3 -> 0 (9); 2 -> 0 would be 11: slot 1; 2 -> 1 (4); 1 -> 0 (10)
    samples = WindowSamples.from_lengths([12, 6, 4, 3, 2])
    plan = STATIC_LAYOUTS["static_sp"](samples, LINEAR,
                                       PlannerConfig(dp=2, micro_batch_tokens=10, sp_max=2))
    slots = [0, 0, 1, 1, 0]
    assert placements(plan) == {i: [(0, 0, b), (1, 1, b)] for i, b in enumerate(slots)}
    assert plan.sp_size_P.tolist() == [2] * 10
    assert plan.num_micro_batches == 2
    assert plan.mb_tokens_RB.tolist() == [[10, 4], [10, 4]]
    # c/2 a rank: slot 0 holds 12/2 + 6/2 + 2/2, slot 1 holds 4/2 + 3/2
    assert plan.mb_cost_RB.tolist() == [[10.0, 3.5], [10.0, 3.5]]


def test_two_groups_hand_traced():
    # dp 4, k 2: groups {0,1} and {2,3}. Slices 5 4 4 3 1 by LPT on tokens (ties to the
    # lower group): 5 -> g0, 4 -> g1, 4 -> g1 (4 < 5), 3 -> g0 (5 < 8), 1 -> g0 (8 = 8).
    # Packing under 8 a rank: g0 holds 5 + 3 in slot 0, the 1 in slot 1; g1 holds 4 + 4.
    samples = WindowSamples.from_lengths([10, 8, 8, 6, 2])
    plan = BASELINES["static_sp"](samples, LINEAR,
                                  PlannerConfig(dp=4, micro_batch_tokens=8, sp_max=2))
    want = {0: (0, 0), 1: (2, 0), 2: (2, 0), 3: (0, 0), 4: (0, 1)}
    assert placements(plan) == {i: [(a, 0, b), (a + 1, 1, b)] for i, (a, b) in want.items()}
    assert plan.mb_tokens_RB.tolist() == [[8, 1], [8, 1], [8, 0], [8, 0]]


def test_idle_ranks_past_the_last_group():
    # dp 6, sp_max 4: one group of 4, ranks 4 and 5 carry nothing
    samples = WindowSamples.from_lengths([40, 8, 12, 4])
    plan = BASELINES["static_sp"](samples, LINEAR,
                                  PlannerConfig(dp=6, micro_batch_tokens=16, sp_max=4))
    assert set(plan.rank_P.tolist()) == {0, 1, 2, 3}
    assert plan.mb_tokens_RB[4:].sum() == 0
    assert plan.sp_size_P.tolist() == [4] * 16


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(1, 40000), min_size=1, max_size=60),
       dp=st.sampled_from([1, 2, 3, 4, 6, 8, 16]), sp_max=st.sampled_from([1, 2, 4, 8]),
       budget=st.sampled_from([1000, 4096, 16384]))
def test_every_sample_on_the_whole_group_within_the_budget(tokens, dp, sp_max, budget):
    k = min(sp_max, 1 << (dp.bit_length() - 1))
    samples = WindowSamples.from_lengths(np.minimum(tokens, budget * k))
    plan = BASELINES["static_sp"](samples, LINEAR,
                                  PlannerConfig(dp=dp, micro_batch_tokens=budget, sp_max=sp_max))
    assert exactly_once([plan], samples.num_samples, 0)["ok"]
    rows = placements(plan)
    assert sorted(rows) == list(range(samples.num_samples))
    for i, got in rows.items():  # k ranks, aligned, slice j on the group's j-th rank, one slot
        first, slot = got[0][0], got[0][2]
        assert first % k == 0 and first + k <= dp
        assert got == [(first + j, j, slot) for j in range(k)]
    assert violations(plan, samples.tokens_N, dp, budget) == 0
    assert np.array_equal(recount_tokens(plan, samples.tokens_N, dp)[:, :plan.num_micro_batches],
                          plan.mb_tokens_RB)
    # the group's ranks carry the same: c/k each
    cost_R = plan.rank_cost_R
    for g in range(dp // k):
        assert np.allclose(cost_R[g * k:(g + 1) * k], cost_R[g * k])
    assert np.isclose(plan.mb_cost_RB.sum(), samples.tokens_N.sum())


def test_deterministic_and_its_media_spread_over_the_group():
    samples = generate("omni", 120, seed=7)
    config = PlannerConfig(dp=2, micro_batch_tokens=16384, sp_max=2)
    a = BASELINES["static_sp"](samples, ENC, config)
    b = BASELINES["static_sp"](samples, ENC, config)
    for name in ("sample_P", "rank_P", "micro_batch_P", "sp_index_P", "encode_rank_M",
                 "consume_rank_M", "mb_cost_RB", "encoder_cost_R"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    # every item is consumed on slice 0's rank (rank 0: one group), but encoded on both ranks
    assert samples.num_items and set(a.consume_rank_M.tolist()) == {0}
    item_cost_M = ENC.item_cost(samples.item_size_M, samples.item_kind_M)
    enc_R = np.bincount(a.encode_rank_M, weights=item_cost_M[a.item_M], minlength=2)
    assert np.allclose(enc_R, a.encoder_cost_R) and a.reshard
    assert enc_R.max() - enc_R.min() <= item_cost_M.max()  # LPT: within one item
    # when moving an embedding costs more than any saving, items stay with their consumer
    dear = Costs(llm=ENC.llm, encoders=ENC.encoders, reshard_per_token=1e9)
    kept = BASELINES["static_sp"](samples, dear, config)
    assert np.array_equal(kept.encode_rank_M, kept.consume_rank_M) and not kept.reshard


def test_through_plan_policy_each_batch_as_drawn():
    tokens = [12, 6, 4, 3, 2, 9, 9, 1]
    window = WindowSamples.from_lengths(tokens, batch_N=[0, 0, 0, 1, 1, 1, 1, 0])
    config = PlannerConfig(dp=2, micro_batch_tokens=10, sp_max=2, window=2)
    plans = plan_policy(window, LINEAR, config, "static_sp")
    assert [sorted(p.samples().tolist()) for p in plans] == [[0, 1, 2, 7], [3, 4, 5, 6]]
    for p in plans:
        assert set(p.sp_size_P.tolist()) == {2}
        assert violations(p, window.tokens_N, 2, 10) == 0
    # re-planned from step 1 (a resize keeps each step's samples): the same layout again
    again = replan_tail(plans, window, 1, LINEAR, config, "static_sp")
    assert np.array_equal(again[1].sample_P, plans[1].sample_P)
    assert np.array_equal(again[1].micro_batch_P, plans[1].micro_batch_P)
    # without SP (sp_max 1) the layout keeps every sample whole
    whole = plan_policy(window, LINEAR, PlannerConfig(dp=2, micro_batch_tokens=16, sp_max=1,
                                                      window=2), "static_sp")
    assert all(set(p.sp_size_P.tolist()) == {1} for p in whole)


def test_a_run_and_a_plane_accept_it_by_name():
    from omniscale.dataplane.plane_config import POLICIES, PlaneConfig
    from omniscale.tools.train.config import DataSection

    assert "static_sp" in POLICIES
    assert PlaneConfig(dp=2, global_batch_tokens=1024, balance="static_sp").balance == "static_sp"
    assert DataSection(balance="static_sp").balance == "static_sp"
    with pytest.raises(ValueError):
        DataSection(balance="static_none")
