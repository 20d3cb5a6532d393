"""The window's pieces one at a time: the arrays the balancer reads (tokens of media items by
the geometry's merge), the baselines run on each batch as drawn (with and without the
long-short split), the best baseline of a step, re-planning a window's tail and resizing a
window mid-way.

Oracles: hand-computed tokens and costs (a linear cost model: a sample costs its tokens), the
baselines of ``balancer.baselines`` called directly on a batch's samples, and displacement
recomputed from its definition ``|step - batch drawn for|``.
"""

from __future__ import annotations

import numpy as np
import pytest

from omniscale.balancer.baselines import BASELINES, BASELINES_NO_SPLIT
from omniscale.balancer.cost import CostModel, Costs
from omniscale.balancer.planner import plan_window
from omniscale.balancer.types import PlannerConfig, WindowSamples
from omniscale.dataplane import windows
from omniscale.dataplane.plane_config import PlaneConfig
from omniscale.dataplane.windows import (
    Window,
    best_baseline,
    plan_policy,
    replan_tail,
    window_samples,
)
from omniscale.geometry import MediaGeometry
from omniscale.refs import SampleRef

LINEAR = Costs(llm=CostModel(1.0, 0.0))  # a sample costs its tokens
PLACEMENT = ("sample_P", "rank_P", "micro_batch_P", "sp_size_P", "sp_index_P")


def same_placement(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in PLACEMENT)


def batch_alone(tokens) -> WindowSamples:
    return WindowSamples.from_lengths(tokens)


def test_image_tokens_follow_the_geometrys_merge_size():
    # merge 3: 3 x 3 patches make one LLM token; 90 patches -> 10, 45 -> 5; video the same
    refs = [SampleRef(0, "s", "sh", "k0", 0, 1, (), 40, 20, (90, 45)),
            SampleRef(0, "s", "sh", "k1", 0, 1, (), 30, 12, (), (18,))]
    samples = window_samples([refs], MediaGeometry(merge_size=3))
    assert samples.item_size_M.tolist() == [90, 45, 18]
    assert samples.item_tokens_M.tolist() == [10, 5, 2]
    assert window_samples([refs], MediaGeometry(merge_size=1)).item_tokens_M.tolist() == \
        [90, 45, 18]


# batch 0: a 180-token sample over a 100-token budget with two short ones; batch 1: short
LONG = WindowSamples.from_lengths([180, 20, 30, 40, 50, 60], batch_N=[0, 0, 0, 1, 1, 1])
SPLIT = PlannerConfig(dp=4, micro_batch_tokens=100, window=2, sp_max=2)


@pytest.mark.parametrize("policy", list(BASELINES_NO_SPLIT))
def test_with_sp_a_baseline_runs_a_sample_over_the_budget_on_a_group(policy):
    """sp_max 2: the 180-token sample cannot fit the 100-token budget whole, so every baseline
    is given the split and runs it on two ranks, 90 tokens each; the short ones stay whole."""
    for plans in (plan_policy(LONG, LINEAR, SPLIT, policy),
                  replan_tail(plan_policy(LONG, LINEAR, SPLIT, policy), LONG, 0, LINEAR, SPLIT,
                              policy)):
        step0 = plans[0]
        rows = step0.sample_P == 0
        assert step0.sp_size_P[rows].tolist() == [2, 2]
        assert sorted(step0.sp_index_P[rows].tolist()) == [0, 1]
        assert set(step0.sp_size_P[~rows].tolist()) == {1}
        assert step0.mb_tokens_RB.max() <= 100


@pytest.mark.parametrize("policy", list(BASELINES_NO_SPLIT))
def test_without_sp_each_batch_is_placed_as_the_plain_baseline_places_it(policy):
    # dp 4, batch 0 of three samples: the plain kk_cost puts them on other ranks than its
    # +split variant given all-ones sizes would, so the two are told apart
    samples = WindowSamples.from_lengths([30, 54, 92, 7, 8], batch_N=[0, 0, 0, 1, 1])
    config = PlannerConfig(dp=4, micro_batch_tokens=150, window=2, sp_max=1)
    one_step = PlannerConfig(dp=4, micro_batch_tokens=150, window=1, sp_max=1)
    want = [BASELINES[policy](batch_alone([30, 54, 92]), LINEAR, one_step),
            BASELINES[policy](batch_alone([7, 8]), LINEAR, one_step)]
    want[1].sample_P = want[1].sample_P + 3  # window numbering: batch 1 starts at sample 3
    got = plan_policy(samples, LINEAR, config, policy)
    again = replan_tail(got, samples, 0, LINEAR, config, policy)
    for plans in (got, again):
        assert [p.step for p in plans] == [0, 1]
        for p, w in zip(plans, want):
            assert same_placement(p, w), policy
            assert p.displacement_P.tolist() == [0] * len(p.sample_P)


def test_best_baseline_is_the_cheapest_on_the_batch_as_drawn():
    # batch 0 [10, 1, 10, 1] on 2 ranks: strided puts both 10s on rank 0 (20); first_fit
    # (chunks [10, 1] | [10, 1]), token_lpt and kk_cost reach 11: the first of those wins
    samples = WindowSamples.from_lengths([10, 1, 10, 1, 5, 5, 5, 5],
                                         batch_N=[0, 0, 0, 0, 1, 1, 1, 1])
    config = PlannerConfig(dp=2, micro_batch_tokens=64, window=2, sp_max=1)
    costs = {p: BASELINES[p](batch_alone([10, 1, 10, 1]), LINEAR, config).ddp_time
             for p in BASELINES_NO_SPLIT}
    assert costs == {"strided": 20.0, "first_fit": 11.0, "token_lpt": 11.0, "kk_cost": 11.0}
    assert best_baseline(samples, 0, LINEAR, config) == {"baseline": "first_fit",
                                                         "baseline_step_cost": 11.0}
    # batch 1 [5, 5, 5, 5]: every baseline reaches 10, the first one stands
    assert best_baseline(samples, 1, LINEAR, config) == {"baseline": "strided",
                                                         "baseline_step_cost": 10.0}


def test_on_one_rank_the_best_baseline_costs_the_whole_batch():
    # one rank holds every sample of the batch: batch 0 costs 7 + 9 = 16, batch 1 costs 100
    samples = WindowSamples.from_lengths([7, 9, 100], batch_N=[0, 0, 1])
    config = PlannerConfig(dp=1, micro_batch_tokens=128, window=2, sp_max=1)
    got = [best_baseline(samples, j, LINEAR, config) for j in range(2)]
    assert [g["baseline_step_cost"] for g in got] == [16.0, 100.0]
    assert all(g["baseline"] in BASELINES_NO_SPLIT for g in got)


def test_the_window_split_is_reused_for_an_equal_cost_model_built_again(monkeypatch):
    """The plane rebuilds the window's cost model (``PlaneConfig.cost_model``) for every
    step it asks the best baseline of: an equal model must find the split already made."""
    samples = WindowSamples.from_lengths([180, 20, 30, 40, 50, 60, 70, 80],
                                         batch_N=[0, 0, 1, 1, 2, 2, 3, 3])
    plane = PlaneConfig(dp=4, micro_batch_tokens=100, sp_max=2, global_batch_samples=2)
    calls = []
    real = windows.split_sizes
    monkeypatch.setattr(windows, "split_sizes",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(windows, "_last_split", None)
    got = [best_baseline(samples, j, plane.cost_model(1.0, 0.5), plane.planner(4, 4))
           for j in range(4)]
    assert len(calls) == 1
    monkeypatch.setattr(windows, "_last_split", None)
    assert [best_baseline(samples, j, plane.cost_model(1.0, 0.5), plane.planner(4, 4))
            for j in range(4)] == got


def test_a_window_just_planned_gives_its_baselines_the_planners_split(monkeypatch):
    """The plane plans a window (ours), then reports its steps' best baselines with the same
    split: the planner's decision is kept, not made again."""
    samples = WindowSamples.from_lengths([180, 20, 30, 40, 50, 60, 70, 80],
                                         batch_N=[0, 0, 1, 1, 2, 2, 3, 3])
    plane = PlaneConfig(dp=4, micro_batch_tokens=100, sp_max=2, global_batch_samples=2)
    costs, config = plane.cost_model(1.0, 0.5), plane.planner(4, 4)
    calls = []
    real = windows.split_sizes
    monkeypatch.setattr(windows, "split_sizes",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(windows, "_last_split", None)
    plans = plan_policy(samples, costs, config)
    got = [best_baseline(samples, j, plane.cost_model(1.0, 0.5), config) for j in range(4)]
    assert calls == []
    ours_N = np.ones(samples.num_samples, np.int64)
    for plan in plans:
        ours_N[plan.sample_P] = plan.sp_size_P
    assert windows._last_split[3].tolist() == ours_N.tolist() and ours_N[0] == 2
    monkeypatch.setattr(windows, "_last_split", None)  # decided afresh: the same reports
    assert [best_baseline(samples, j, costs, config) for j in range(4)] == got
    assert calls == [1]


def test_a_replanned_tail_keeps_each_steps_samples_and_their_displacement():
    """The planner moves samples between the window's steps; re-planning from step 0 on more
    ranks keeps every step's samples, and each placement's displacement is still the distance
    from its step to the batch it was drawn for."""
    tokens = [231, 91, 206, 352, 207, 387, 355, 337, 147, 347, 336, 173, 202, 252, 35, 1,
              180, 241, 117, 351, 211, 8, 341, 199]
    samples = WindowSamples.from_lengths(tokens, batch_N=np.repeat(np.arange(4), 6))
    config = PlannerConfig(dp=2, micro_batch_tokens=500, window=4, sp_max=1)
    plans = plan_window(samples, LINEAR, config)
    moved = [(p.step, int(b)) for p in plans for b in samples.batch_N[p.samples()]
             if b != p.step]
    assert moved  # the case is one where the planner moves samples
    wider = PlannerConfig(dp=4, micro_batch_tokens=500, window=4, sp_max=1)
    again = replan_tail(plans, samples, 0, LINEAR, wider)
    for old, new in zip(plans, again):
        assert new.step == old.step
        assert np.array_equal(new.samples(), old.samples())
        assert set(new.rank_P.tolist()) <= set(range(4))
        want = np.abs(new.step - samples.batch_N[new.sample_P].astype(np.int64))
        assert new.displacement_P.tolist() == want.tolist()
    assert sum(int(p.displacement_P.sum()) for p in again) == \
        sum(abs(s - b) for s, b in moved)


def make_window(first_step=8):
    samples = WindowSamples.from_lengths(list(range(10, 90, 5)),
                                         batch_N=np.repeat(np.arange(4), 4))
    plane = PlaneConfig(dp=2, micro_batch_tokens=256, sp_max=1, global_batch_samples=4,
                        balance="token_lpt")
    costs = plane.cost_model(1.0, 0.0)
    plans = plan_policy(samples, costs, plane.planner(2, 4), plane.balance)
    window = Window(k=2, first_step=first_step, start_state={}, spec_path="mix.yaml", refs=[],
                    samples=samples, plans=plans, dp_of_step=[2] * 4)
    window.tables = {(s, r): None for s in range(first_step, first_step + 4) for r in (0, 1)}
    window.prints = {(s, r): "x" for s in range(first_step, first_step + 4) for r in (0, 1)}
    return window, plane, costs


@pytest.mark.parametrize("at", [8, 9])
def test_resizing_a_window_replans_from_that_step_on(at):
    window, plane, costs = make_window()
    before = [p.samples().tolist() for p in window.plans]
    kept = window.plans[:at - 8]
    window.resize(at, 4, costs, plane)
    assert window.dp_of_step == [2] * (at - 8) + [4] * (12 - at)
    assert all(a is b for a, b in zip(window.plans, kept))  # the steps before: untouched
    assert [p.samples().tolist() for p in window.plans] == before
    for j, p in enumerate(window.plans):
        assert p.mb_cost_RB.shape[0] == window.dp_of_step[j]
    assert sorted({s for s, _ in window.tables}) == list(range(8, at))
    assert sorted({s for s, _ in window.prints}) == list(range(8, at))


def test_resizing_before_a_window_replans_all_of_it_and_after_it_nothing():
    window, plane, costs = make_window()
    window.resize(3, 4, costs, plane)  # a step before the window: all of it
    assert window.dp_of_step == [4] * 4
    assert all(p.mb_cost_RB.shape[0] == 4 for p in window.plans)
    plans = list(window.plans)
    for step in (12, 13, 40):  # at the window's end and past it: nothing to re-plan
        window.resize(step, 1, costs, plane)
        assert all(a is b for a, b in zip(window.plans, plans)) and len(window.plans) == 4
        assert window.dp_of_step == [4] * 4
