"""Metrics on hand-made plans, the step stream, the generators, and end-to-end simulation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from omniscale.balancer.baselines import BASELINES_NO_SPLIT, BASELINES_SPLIT
from omniscale.balancer.cost import CommModel, CostModel, Costs
from omniscale.balancer.distributions import (
    OMNI_SHARES,
    OMNI_SOURCES,
    exact_counts,
    generate,
    smart_resize,
)
from omniscale.balancer.metrics import (
    displacement,
    exactly_once,
    ideal_time,
    step_times,
    violations,
)
from omniscale.balancer.simulate import (
    OURS,
    OURS_STEP_SYNC,
    PolicyRun,
    compare,
    planner_split,
    reprice,
    run_policy,
    simulate,
)
from omniscale.balancer.stream import (
    arrival_step,
    steps_by_count,
    steps_by_tokens,
    take,
    window_samples,
    windows,
)
from omniscale.balancer.types import PlannerConfig, StepPlan, WindowSamples

COSTS = Costs(llm=CostModel(1.0, 0.0))


def hand_plan(step=0, encoder_cost_R=None, reshard=False) -> StepPlan:
    """Two ranks, two slots: rank 0 = [3, 1], rank 1 = [1, 1]; sample 2 split over both."""
    return StepPlan(
        step=step, sample_P=np.array([0, 1, 2, 2, 3]), rank_P=np.array([0, 0, 0, 1, 1], np.int32),
        micro_batch_P=np.array([0, 1, 1, 1, 0], np.int32),
        sp_size_P=np.array([1, 1, 2, 2, 1], np.int32),
        sp_index_P=np.array([0, 0, 0, 1, 0], np.int32),
        num_micro_batches=2, mb_cost_RB=np.array([[3.0, 1.0], [1.0, 1.0]]),
        mb_tokens_RB=np.array([[3, 1], [1, 1]]), lower_bound=3.0,
        encoder_cost_R=encoder_cost_R, reshard=reshard)


def test_step_times_and_imbalance_of_a_hand_made_plan():
    plan = hand_plan()
    assert (plan.ddp_time, plan.fsdp_time, plan.imbalance) == (4.0, 4.0, 4.0 / 3.0)
    assert step_times(plan) == (4.0, 4.0)
    # Encoder phase: with a reshard the phases synchronise apart (max + max) ...
    assert step_times(hand_plan(encoder_cost_R=np.array([1.0, 2.0]), reshard=True)) == (6.0, 6.0)
    # ... without one a rank runs straight on under DDP: max(4+1, 2+2).
    assert step_times(hand_plan(encoder_cost_R=np.array([1.0, 2.0]))) == (5.0, 6.0)


def test_violations_displacement_and_ideal():
    plan = hand_plan(step=2)
    tokens_N = np.array([3, 1, 2, 1])  # sample 2 split in two: one token per rank
    assert violations(plan, tokens_N, dp=2, budget=2) == 1  # rank 0 slot 0 holds 3
    assert violations(plan, tokens_N, dp=2, budget=3) == 0
    assert violations(plan, np.array([3, 1, 5, 1]), dp=2, budget=3) == 1  # slices of 3: 1+3
    assert displacement(plan, np.array([0, 1, 2, 3])).tolist() == [2, 1, 0, 0, 1]
    assert ideal_time(np.array([4.0, 2.0]), np.array([2.0]), dp=4) == 2.0


def test_exactly_once_counts_split_slices_and_finds_faults():
    assert exactly_once([hand_plan()], 4, 0)["ok"]
    assert exactly_once([hand_plan()], 5, 0) == {"missing": 1, "duplicated": 0, "ok": False}
    twice = hand_plan(step=1)
    assert exactly_once([hand_plan(), twice], 4, 0)["duplicated"] == 4
    lost_slice = hand_plan()
    lost_slice.sample_P = np.array([0, 1, 2, 3, 3])
    assert not exactly_once([lost_slice], 4, 0)["ok"]


def test_compare_ratios_on_hand_made_runs():
    stream = WindowSamples.from_lengths([3, 1, 2, 1])
    offsets_S1 = np.array([0, 4])
    ours = PolicyRun(OURS, [hand_plan()], np.array([1.0]))
    worse = hand_plan()
    worse.mb_cost_RB = np.array([[6.0, 2.0], [0.0, 0.0]])
    base = PolicyRun("strided", [worse], np.array([0.5]))
    better = hand_plan()
    better.mb_cost_RB = np.array([[5.0, 1.0], [0.0, 0.0]])
    split = PolicyRun("strided+split", [better], np.array([0.5]))
    result = compare([ours, base, split], stream, offsets_S1, COSTS, PlannerConfig(2, 4))
    assert result["ideal_time"] == 3.5  # 7 tokens of unit cost over 2 ranks
    assert result["policies"][OURS]["ddp_over_ideal"] == pytest.approx(4 / 3.5)
    # the headline is against the baselines that may split; the no-split ones beside it
    assert result["best_baseline"] == {"ddp": "strided+split", "fsdp": "strided+split"}
    assert result["speedup_vs_best_baseline"] == {"ddp": 1.5, "fsdp": 1.5}
    assert result["best_baseline_no_split"] == {"ddp": "strided", "fsdp": "strided"}
    assert result["speedup_vs_best_no_split_baseline"] == {"ddp": 2.0, "fsdp": 2.0}
    assert result["policies"]["strided"]["imbalance_mean"] == 2.0
    assert not result["policies"]["strided"]["may_split"]
    assert result["policies"]["strided+split"]["may_split"]
    assert result["policies"][OURS]["exactly_once"] and result["policies"][OURS]["may_split"]


def test_steps_by_count_and_by_tokens():
    assert steps_by_count(10, 3).tolist() == [0, 3, 6, 9]
    assert steps_by_count(10, 3, max_steps=2).tolist() == [0, 3, 6]
    # greedy to 10 tokens: [4 5] [2] [12]; the trailing [6 3] never closed, so it is dropped
    assert steps_by_tokens(np.array([4, 5, 2, 12, 6, 3]), 10).tolist() == [0, 2, 3, 4]
    assert steps_by_tokens(np.array([4, 5, 2, 12, 6, 3, 9]), 10).tolist() == [0, 2, 3, 4, 6]
    assert steps_by_tokens(np.array([4, 5, 2, 12, 6, 3]), 10, max_steps=2).tolist() == [0, 2, 3]


def test_windows_slice_items_and_number_batches():
    stream = generate("omni", 40, seed=0)
    offsets_S1 = steps_by_count(40, 8)
    assert windows(offsets_S1, 2) == [(0, 2), (2, 4), (4, 5)]
    win = window_samples(stream, offsets_S1, 2, 4)
    win.validate()
    assert win.batch_N.tolist() == [0] * 8 + [1] * 8
    lo, hi = stream.item_offsets_N1[16], stream.item_offsets_N1[32]
    assert np.array_equal(win.item_size_M, stream.item_size_M[lo:hi])
    assert take(stream, 0, 40).num_items == stream.num_items
    assert arrival_step(offsets_S1).tolist() == np.repeat(np.arange(5), 8).tolist()


def test_generators_are_seeded_and_omni_has_its_shares():
    a, b, c = generate("omni", 2000, 7), generate("omni", 2000, 7), generate("omni", 2000, 8)
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in (
        "tokens_N", "source_N", "item_offsets_N1", "item_size_M", "item_kind_M"))
    assert not np.array_equal(a.tokens_N, c.tokens_N)
    a.validate()
    counts = np.bincount(a.source_N, minlength=len(OMNI_SOURCES))
    assert counts.tolist() == exact_counts(2000, OMNI_SHARES).tolist() == [600, 1100, 100, 140, 60]
    items_N = np.diff(a.item_offsets_N1)
    assert np.all(items_N[a.source_N == 0] == 0) and np.all(items_N[a.source_N == 1] == 1)
    multi = items_N[a.source_N == 2]
    assert multi.min() >= 2 and multi.max() <= 6
    kind_N = a.item_kind_M[a.item_offsets_N1[:-1][items_N == 1]]
    assert set(kind_N[a.source_N[items_N == 1] == 3].tolist()) == {1}
    assert set(kind_N[a.source_N[items_N == 1] == 4].tolist()) == {2}
    image = a.item_kind_M == 0
    assert a.item_tokens_M[image].max() <= 1280 and a.item_tokens_M[image].min() >= 4
    media_N = np.bincount(np.repeat(np.arange(2000), items_N), weights=a.item_tokens_M,
                          minlength=2000)
    assert np.all(a.tokens_N > media_N)  # every media sample has some text too


def test_lognormal_is_clipped_long_tail():
    tokens_N = generate("lognormal", 20000, 0).tokens_N
    assert tokens_N.min() >= 1 and tokens_N.max() == 131072
    assert 1500 < np.median(tokens_N) < 2200  # e^7.5 ≈ 1808


def test_smart_resize_matches_the_loaders_geometry():
    from omniscale.geometry import smart_resize as reference

    rng = np.random.default_rng(0)
    h_K, w_K = rng.integers(20, 4000, 300), rng.integers(20, 4000, 300)
    h_K[:3], w_K[:3] = [30, 2000, 56], [30, 2000, 56]
    got_h, got_w = smart_resize(h_K, w_K, 56 * 56, 1280 * 28 * 28)
    want = [reference(int(h), int(w), 28, 56 * 56, 1280 * 28 * 28) for h, w in zip(h_K, w_K)]
    assert list(zip(got_h.tolist(), got_w.tolist())) == want


def test_simulate_baselines_on_a_stream_of_lengths():
    tokens_N = generate("lognormal", 4 * 64, 1).tokens_N
    result = simulate(tokens_N, steps_by_count(256, 64), Costs(llm=CostModel(24576.0, 1.0)),
                      PlannerConfig(dp=8, micro_batch_tokens=1 << 17), tuple(BASELINES_NO_SPLIT))
    assert result["ideal_time"] == pytest.approx(
        float((24576.0 * tokens_N + tokens_N.astype(float) ** 2).sum() / 8))
    for p in result["policies"].values():
        assert p["exactly_once"] and p["violations"] == 0 and p["displacement_max"] == 0
        assert p["ddp_over_ideal"] >= 1.0 and p["fsdp_time"] >= p["ddp_time"]
        assert p["steps"] == 4 and p["planner_ms_per_step"] > 0
    assert result["speedup_vs_best_baseline"] == {} and result["best_baseline"] == {}
    assert result["speedup_vs_best_no_split_baseline"] == {}
    assert set(result["best_baseline_no_split"].values()) <= set(BASELINES_NO_SPLIT)


@pytest.mark.parametrize("dist", ["lognormal", "omni"])
def test_simulate_our_planner_end_to_end(dist):
    stream = generate(dist, 6 * 8 * 16, 2)
    costs = Costs(llm=CostModel(24576.0, 1.0), encoders=(CostModel(3072.0, 0.5),) * 3)
    config = PlannerConfig(dp=8, micro_batch_tokens=16384, window=4, sp_max=8)
    run = run_policy(OURS, stream, steps_by_count(stream.num_samples, 128), costs, config)
    assert [p.step for p in run.plans] == list(range(6))  # a window of 4, then one of 2
    result = compare([run], stream, steps_by_count(stream.num_samples, 128), costs, config)
    ours = result["policies"][OURS]
    assert ours["exactly_once"] and ours["violations"] == 0
    assert ours["displacement_max"] <= 3


def test_ours_is_judged_on_each_objective_by_the_plan_made_for_it():
    """simulate() plans ours twice: its FSDP figures are the plans for ranks that meet every
    micro-batch, its DDP figures the plans for ranks that meet once a step -- each priced
    here from plan_window's own plans (`step_times`), outside the simulator."""
    from omniscale.balancer.planner import plan_window

    stream = generate("lognormal", 4 * 8 * 16, 3)
    costs = Costs(llm=CostModel(24576.0, 1.0))
    config = PlannerConfig(dp=8, micro_batch_tokens=16384, window=4, sp_max=8)
    offsets = steps_by_count(stream.num_samples, 128)
    result = simulate(stream, offsets, costs, config, (OURS, *BASELINES_SPLIT))
    assert OURS_STEP_SYNC not in result["policies"]
    ours = result["policies"][OURS]
    assert ours["ddp_planned_with_sync"] == "step"
    samples = window_samples(stream, offsets, 0, 4)
    by_sync = {sync: [step_times(p) for p in plan_window(
        samples, costs, dataclasses.replace(config, sync=sync))] for sync in ("micro_batch",
                                                                           "step")}
    assert ours["fsdp_time"] == pytest.approx(sum(f for _, f in by_sync["micro_batch"]))
    assert ours["ddp_time"] == pytest.approx(sum(d for d, _ in by_sync["step"]))


# hidden 1024, 2 layers, bf16, 1 GB/s, a unit = 1 µs: see tests/balancer/test_cost.py
HAND = CommModel(hidden=1024, layers=2, dtype_bytes=2, bandwidth=1e9, unit_seconds=1e-6)


@pytest.mark.parametrize("name", [OURS, *BASELINES_SPLIT])
def test_one_split_sample_is_charged_its_hand_computed_all_to_all(name):
    """1000 tokens over k = 2 (the budget of 600 forces it): each rank carries half the
    compute, 10 x 1000 / 2 = 5000, plus 8192 units of all-to-all (test_cost.py)."""
    costs = Costs.from_llm(10.0, 0.0, **HAND.collectives())
    stream = WindowSamples.from_lengths([1000])
    config = PlannerConfig(dp=2, micro_batch_tokens=600, window=1, sp_max=2)
    run = run_policy(name, stream, np.array([0, 1]), costs, config)
    plan = run.plans[0]
    assert plan.sp_size_P.tolist() == [2, 2]
    assert plan.mb_cost_RB.ravel().tolist() == pytest.approx([5000.0 + 8192.0] * 2)
    result = compare([run], stream, np.array([0, 1]), costs, config)
    p = result["policies"][name]
    assert p["ddp_time"] == pytest.approx(13192.0) and p["fsdp_time"] == pytest.approx(13192.0)
    assert p["sp_comm_per_rank"] == pytest.approx(8192.0)
    assert result["ideal_time"] == pytest.approx(5000.0)  # compute only


def test_reprice_keeps_our_grid_and_charges_the_reshard():
    stream = generate("omni", 4 * 8 * 16, 4)
    costs = Costs.from_llm(24576.0, 1.0, **CommModel().collectives())
    config = PlannerConfig(dp=8, micro_batch_tokens=16384, window=4, sp_max=8)
    offsets_S1 = steps_by_count(stream.num_samples, 128)
    from omniscale.balancer.planner import plan_window

    own = plan_window(window_samples(stream, offsets_S1, 0, 4), costs, config)
    run = run_policy(OURS, stream, offsets_S1, costs, config)
    for mine, judged in zip(own, run.plans):  # the planner priced itself as the judge does
        np.testing.assert_allclose(judged.mb_cost_RB, mine.mb_cost_RB, rtol=1e-9)
        np.testing.assert_allclose(judged.encoder_cost_R, mine.encoder_cost_R, rtol=1e-9)
    moved = [p for p in run.plans if np.any(p.encode_rank_M != p.consume_rank_M)]
    assert moved and np.all(run.reshard_S[[p.step for p in moved]] > 0)
    # a hand-made reshard: 100 tokens moved from rank 1 to rank 0 -> 100 x reshard_per_token
    plan = dataclasses.replace(hand_plan(), item_M=np.array([0]),
                               item_sample_M=np.array([0]), encode_rank_M=np.array([1], np.int32),
                               consume_rank_M=np.array([0], np.int32), reshard=True)
    tiny = WindowSamples(tokens_N=np.array([300, 10, 20, 10]), source_N=np.zeros(4, np.int32),
                         batch_N=np.zeros(4, np.int32), item_offsets_N1=np.array([0, 1, 1, 1, 1]),
                         item_size_M=np.array([400]), item_kind_M=np.array([0], np.int8),
                         item_tokens_M=np.array([100]))
    priced, reshard, sp_comm = reprice(plan, tiny, Costs.from_llm(1.0, 0.0,
                                                                  **HAND.collectives()), 2)
    assert reshard == pytest.approx(409.6)  # 100 x 1024 x 2 bytes x 2 directions at 1 GB/s
    assert sp_comm == pytest.approx(2 * 4 * 2 * 1024 * 2 * 10 * 0.5 / 1e9 / 1e-6 * 2)
    assert priced.encoder_cost_R[1] > 0 and priced.encoder_cost_R[0] == 0


def test_split_baselines_get_the_planners_window_split():
    stream = generate("lognormal", 6 * 8 * 16, 5)
    costs = Costs.from_llm(24576.0, 1.0, **CommModel().collectives())
    config = PlannerConfig(dp=8, micro_batch_tokens=16384, window=4, sp_max=8)
    offsets_S1 = steps_by_count(stream.num_samples, 128)
    ours = run_policy(OURS, stream, offsets_S1, costs, config)
    want_N = planner_split(stream, offsets_S1, costs, config)
    for run in [ours] + [run_policy(n, stream, offsets_S1, costs, config)
                         for n in BASELINES_SPLIT]:
        k_N = np.zeros(stream.num_samples, np.int64)
        for plan in run.plans:
            k_N[plan.sample_P] = plan.sp_size_P
        assert np.array_equal(k_N, want_N), run.name


def test_ranks_of_given_speeds_hand_computed():
    """Six samples of 100 tokens (cost 100 each), ranks at speeds 1 and 0.5, one step: ours
    puts four on the fast rank and two on the slow one (400 time units each); strided puts
    three on each (the slow one takes 600). Ideal: 600 of work over 1.5 ranks' speed = 400."""
    config = PlannerConfig(2, 1000, window=1, sp_max=1, rank_speed=(1.0, 0.5))
    result = simulate(np.full(6, 100), np.array([0, 6]), COSTS, config,
                      policies=(OURS, "strided"))
    assert result["ideal_time"] == pytest.approx(400.0)
    assert result["rank_speed"] == [1.0, 0.5]
    ours, strided = result["policies"][OURS], result["policies"]["strided"]
    assert ours["ddp_time"] == pytest.approx(400.0) and ours["fsdp_time"] == pytest.approx(400.0)
    assert strided["ddp_time"] == pytest.approx(600.0)
    assert result["speedup_vs_best_no_split_baseline"] == pytest.approx({"ddp": 1.5, "fsdp": 1.5})
    # the slowest rank's time over the step's bound in time (400): strided's slow rank holds
    # 300 of work, 600 of time; in work it would read 0.75, under the bound
    assert ours["max_over_lb_max"] == pytest.approx(1.0)
    assert strided["max_over_lb_max"] == pytest.approx(1.5)


def test_a_slice_sized_by_speed_is_repriced_as_its_share_of_the_work():
    """One sample of 100 tokens split over two ranks holding 2/3 and 1/3 of its tokens, equal
    heads, cost 100 + 0.01·100² = 200 (attention share φ = 0.5): parts 200·(0.5·t + 0.5·0.5)."""
    costs = Costs(llm=CostModel(1.0, 0.01))
    plan = StepPlan(
        step=0, sample_P=np.array([0, 0]), rank_P=np.array([0, 1], np.int32),
        micro_batch_P=np.array([0, 0], np.int32), sp_size_P=np.array([2, 2], np.int32),
        sp_index_P=np.array([0, 1], np.int32), num_micro_batches=1,
        mb_cost_RB=np.zeros((2, 1)), mb_tokens_RB=np.array([[67], [33]]), lower_bound=0.0,
        speed_R=np.array([1.0, 0.5]), sp_tokens_P=np.array([200, 100]))
    priced, _, _ = reprice(plan, WindowSamples.from_lengths([100]), costs, 2)
    assert priced.mb_cost_RB[:, 0] == pytest.approx([200 * (1 / 3 + 1 / 4), 200 * (1 / 6 + 1 / 4)])
    assert priced.mb_time_RB[:, 0] == pytest.approx([200 * (7 / 12), 200 * (5 / 12) / 0.5])
