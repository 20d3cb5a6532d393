"""The planner weighs a micro-batch's fixed cost against the balance one more slot buys
(hand-computed cases)."""

import numpy as np

from omniscale.balancer.cost import CostModel, Costs
from omniscale.balancer.planner import plan_step
from omniscale.balancer.types import PlannerConfig, WindowSamples

# c(10) = 1 and c(100) = 20: α·10 + β·100 = 1, α·100 + β·10⁴ = 20
BETA = 1 / 900
ALPHA = 0.1 - 10 * BETA
# one sample of 100 tokens (cost 20) and 28 of 10 tokens (cost 1 each): 380 tokens, cost 48
SAMPLES = WindowSamples.from_lengths([100] + [10] * 28)
CONFIG = PlannerConfig(dp=2, micro_batch_tokens=200, window=1, sp_max=1)


def _plan(micro_batch: float):
    return plan_step(SAMPLES, Costs(llm=CostModel(ALPHA, BETA), micro_batch=micro_batch),
                     CONFIG)


def test_a_cheap_micro_batch_buys_the_cost_balance():
    # 24 cost on each rank needs 240 tokens on the rank of short samples: two slots, each
    # rank's 20-cost part in slot 0 (heights 20 + 4 = 24), plus 2 × 1 fixed = 26; one slot
    # (the 100-token sample and 8 short ones on one rank, 180 tokens; 20 short on the other)
    # would be 28 + 1 = 29.
    for micro_batch in (0.0, 1.0):
        plan = _plan(micro_batch)
        assert plan.num_micro_batches == 2
        assert np.isclose(plan.fsdp_time, 24.0)
        assert np.isclose(plan.rank_cost_R, 24.0).all()


def test_a_dear_micro_batch_keeps_the_fewest_slots():
    # with 5 per micro-batch: two slots 24 + 10 = 34, one slot 28 + 5 = 33
    plan = _plan(5.0)
    assert plan.num_micro_batches == 1
    assert (plan.mb_tokens_RB <= 200).all()
    assert np.isclose(plan.fsdp_time, 28.0)
    assert sorted(plan.rank_cost_R.round(9)) == [20.0, 28.0]
