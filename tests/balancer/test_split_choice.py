"""The planner splits a costly sample that fits the budget only where its plan is shorter for it:
the share rule's split against the budget rule's whole sample, weighed by communication
(hand-computed step times), and the baselines get the split the planner chose."""

import numpy as np
import pytest

from omniscale.balancer.baselines import split_sizes
from omniscale.balancer.cost import CostModel, Costs
from omniscale.balancer.planner import plan_step, plan_window
from omniscale.balancer.types import PlannerConfig, WindowSamples

# c(L) = L + L²/100: c(100) = 200, c(10) = 11. One sample of 100 tokens and 20 of 10: 300
# tokens, cost 420, on 2 ranks with a budget of 100 tokens a micro-batch. A rank's share is
# 210 over its 150 tokens' two slots, 105 a slot: the long sample (200) is over it, so the
# share rule splits it (k = 2); it fits the budget, so the budget rule keeps it whole.
LLM = CostModel(1.0, 0.01)
SAMPLES = WindowSamples.from_lengths([100] + [10] * 20)
CONFIG = PlannerConfig(dp=2, micro_batch_tokens=100, window=1, sp_max=2)
SPLIT_STEP = 210.0  # split: 100 + 25q per slice beside 5 short samples, then 5 each: 210 + 25q
WHOLE_STEP = 255.0  # whole: 200 beside 10 short (110), then 5 short each (55)


def _long_k(plan) -> int:
    return int(plan.sp_size_P[plan.sample_P == 0].max())


@pytest.mark.parametrize("q, k, step_time", [
    (0.0, 2, SPLIT_STEP),  # free all-to-all: splitting balances the slot, 210 < 255
    (1.0, 2, SPLIT_STEP + 25.0),  # 235 < 255: still pays
    (4.0, 1, WHOLE_STEP),  # 310 > 255: the all-to-all costs more than the idle it saves
])
def test_a_costly_sample_is_split_only_when_the_step_is_shorter(q, k, step_time):
    plan = plan_step(SAMPLES, Costs(llm=LLM, sp_comm_per_token=q), CONFIG)
    assert _long_k(plan) == k
    assert plan.fsdp_time == pytest.approx(step_time)
    assert plan.mb_tokens_RB.max() <= CONFIG.micro_batch_tokens


def test_a_sample_over_the_budget_is_split_however_dear_the_all_to_all():
    samples = WindowSamples.from_lengths([150] + [10] * 15)
    plan = plan_step(samples, Costs(llm=LLM, sp_comm_per_token=100.0), CONFIG)
    assert _long_k(plan) == 2


def test_the_window_follows_the_rule_its_first_step_plans_shorter():
    # Two steps of the case above (the window may move samples between them): with a dear
    # all-to-all both long samples run whole, and both split with a free one.
    samples = WindowSamples.from_lengths([100] + [10] * 20 + [100] + [10] * 20,
                                         batch_N=np.repeat([0, 1], 21))
    config = PlannerConfig(dp=2, micro_batch_tokens=100, window=2, sp_max=2)
    for q, k in ((4.0, 1), (0.0, 2)):
        costs = Costs(llm=LLM, sp_comm_per_token=q)
        plans = plan_window(samples, costs, config)
        sample_P = np.concatenate([p.sample_P for p in plans])
        size_P = np.concatenate([p.sp_size_P for p in plans])
        assert set(size_P[np.isin(sample_P, [0, 21])].tolist()) == {k}
        sizes_N = split_sizes(samples, costs, config, n_steps=2)
        assert sizes_N[[0, 21]].tolist() == [k, k]  # what the baselines are given
        assert (sizes_N[np.r_[1:21, 22:42]] == 1).all()



def test_step_0_is_planned_again_only_where_the_budget_rule_s_reordering_changed_it(
        monkeypatch):
    # The window above with a dear all-to-all: the budget rule wins. Its reordering keeps
    # step 0's samples, so the trial's plan of them is the window's first plan -- planned twice
    # (share rule, trial), not a third time -- and it is the plan a fresh planning gives.
    from omniscale.balancer import planner
    samples = WindowSamples.from_lengths([100] + [10] * 20 + [100] + [10] * 20,
                                         batch_N=np.repeat([0, 1], 21))
    config = PlannerConfig(dp=2, micro_batch_tokens=100, window=2, sp_max=2)
    costs = Costs(llm=LLM, sp_comm_per_token=4.0)
    item_cost_M = costs.item_cost(samples.item_size_M, samples.item_kind_M)
    planned, real = [], planner._plan_one
    monkeypatch.setattr(planner, "_plan_one",
                        lambda s, idx, *a: planned.append(idx.tolist()) or real(s, idx, *a))
    chosen = planner._choose_split(samples, 2, item_cost_M, costs, config, reorder=True)
    first = np.flatnonzero(chosen.step_N == 0)
    assert chosen.sp_size_N[[0, 21]].tolist() == [1, 1]  # the budget rule won
    assert planned == [first.tolist(), first.tolist()]  # share rule, trial; no third
    fresh = real(samples, first, 0, chosen.sp_size_N, chosen.unit_N, item_cost_M, costs, config)
    for field in ("sample_P", "rank_P", "micro_batch_P", "sp_size_P", "sp_index_P",
                  "mb_cost_RB", "mb_tokens_RB", "encode_rank_M"):
        assert np.array_equal(getattr(chosen.first_plan, field), getattr(fresh, field)), field
