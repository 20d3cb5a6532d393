"""The planner weighs a micro-batch's fixed cost against the balance one more slot buys, and
plans for when ranks wait for each other (hand-computed cases, one checked by brute force)."""

import itertools

import numpy as np
import pytest

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


# c(60) = 28/3 (α·60 + β·3600), c(100) = 20, c(10) = 1: 49 in all; 100 tokens a micro-batch
SYNC_SAMPLES = WindowSamples.from_lengths([60, 60, 60, 100, 10])


def _plan_for(sync: str):
    return plan_step(SYNC_SAMPLES, Costs(llm=CostModel(ALPHA, BETA)),
                     PlannerConfig(dp=2, micro_batch_tokens=100, window=1, sp_max=1, sync=sync))


def test_ranks_that_meet_once_a_step_get_the_cost_balance():
    # The least slowest-rank sum: the three 60s on one rank (28), 100 + 10 on the other (21).
    # Each 60 needs a micro-batch of its own there: three slots of 28/3 against 20 and 1.
    plan = _plan_for("step")
    assert np.isclose(plan.ddp_time, 28.0)
    assert np.isclose(plan.fsdp_time, 20 + 28 / 3 + 28 / 3)


def test_ranks_that_meet_every_micro_batch_get_slots_that_fill_alike():
    # Σ over slots of the slowest rank: 100 | 60 on one rank, 60 + 10 | 60 on the other, two
    # slots of heights 20 and 28/3 (the least any plan reaches: `_least_fsdp_time` tries all)
    plan = _plan_for("micro_batch")
    least = _least_fsdp_time([60, 60, 60, 100, 10], 100)
    assert np.isclose(least, 20 + 28 / 3)
    assert np.isclose(plan.fsdp_time, least)
    assert plan.num_micro_batches == 2 and (plan.mb_tokens_RB <= 100).all()


def test_an_unknown_sync_is_refused():
    with pytest.raises(ValueError, match="sync: must be one of micro_batch, step"):
        PlannerConfig(dp=2, micro_batch_tokens=100, sync="layer")


def _least_fsdp_time(lengths: list[int], budget: int) -> float:
    """Brute force on two ranks: every assignment, every packing of each rank's samples into
    micro-batches within the budget, slots paired costliest with costliest (which minimises
    Σ max of two sequences)."""
    cost = [float(ALPHA * n + BETA * n * n) for n in lengths]

    def partitions(items):
        if not items:
            yield []
            return
        for rest in partitions(items[1:]):
            yield [[items[0]], *rest]
            for i in range(len(rest)):
                yield [*rest[:i], [items[0], *rest[i]], *rest[i + 1:]]

    def slot_costs(members):
        return [sorted((sum(cost[i] for i in b) for b in p), reverse=True)
                for p in partitions(members) if all(sum(lengths[i] for i in b) <= budget
                                                    for b in p)]

    best = float("inf")
    for mask in range(2 ** len(lengths)):
        ranks = [[i for i in range(len(lengths)) if (mask >> i) & 1 == r] for r in (0, 1)]
        for a, b in itertools.product(*(slot_costs(r) for r in ranks)):
            m = max(len(a), len(b))
            best = min(best, sum(max(x, y) for x, y in zip(a + [0.0] * (m - len(a)),
                                                          b + [0.0] * (m - len(b)))))
    return best
