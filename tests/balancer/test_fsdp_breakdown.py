"""`metrics.fsdp_breakdown`: where a plan's FSDP time goes. A hand-computed plan, and on
simulated runs of every policy the parts adding up to the FSDP time `simulate` reports (the
oracle: `step_times`, summed by `summarize`, code the breakdown does not call)."""

from __future__ import annotations

import numpy as np
import pytest

from omniscale.balancer.cost import CommModel, Costs
from omniscale.balancer.distributions import generate
from omniscale.balancer.metrics import fsdp_breakdown
from omniscale.balancer.simulate import ALL_POLICIES, simulate
from omniscale.balancer.stream import steps_by_count
from omniscale.balancer.types import PlannerConfig, StepPlan

PARTS = ("work", "slot_idle", "encoder_idle", "reshard", "fixed")


def hand_plan(speed_R=None) -> StepPlan:
    """Two ranks, two slots, budget 10 tokens. Slot 0: sample 0 split over both ranks (5
    tokens and cost 4 each); slot 1: sample 1 whole on rank 0 (9 tokens, cost 6), sample 2 on
    rank 1 (2 tokens, cost 1). Encoders: 3 on rank 0, 1 on rank 1."""
    return StepPlan(
        step=0, sample_P=np.array([0, 0, 1, 2]), rank_P=np.array([0, 1, 0, 1], np.int32),
        micro_batch_P=np.array([0, 0, 1, 1], np.int32),
        sp_size_P=np.array([2, 2, 1, 1], np.int32), sp_index_P=np.array([0, 1, 0, 0], np.int32),
        num_micro_batches=2, mb_cost_RB=np.array([[4.0, 6.0], [4.0, 1.0]]),
        mb_tokens_RB=np.array([[5, 9], [5, 2]]), lower_bound=0.0,
        encoder_cost_R=np.array([3.0, 1.0]), speed_R=speed_R)


def test_a_hand_computed_plan():
    # ranks' work: 4 + 6 + 3 and 4 + 1 + 1 = 19 over 2 ranks; slot 0 waits for nobody, slot 1
    # rank 1 waits 5 (its 2 tokens leave room: not a full cell), the encoders 2 on rank 1;
    # reshard 0.5 a step, a slot's fixed cost 0.25: 2 slots. Ideal 8 (any number: the divisor)
    tokens_N = np.array([10, 9, 2])
    got = fsdp_breakdown([hand_plan()], tokens_N, dp=2, budget=10, ideal=8.0,
                         reshard_S=np.array([0.5]), micro_batch=0.25)
    assert got == pytest.approx({"work": 19 / 2 / 8, "slot_idle": 5 / 2 / 8,
                                 "slot_idle_beside_splits": 0.0, "slot_idle_in_full_cells": 0.0,
                                 "encoder_idle": 2 / 2 / 8, "reshard": 0.5 / 8,
                                 "fixed": 0.5 / 8})
    # the FSDP step by hand: slots 4 + 6, encoders 3, reshard 0.5, fixed 0.5 = 14
    assert sum(got[k] for k in PARTS) * 8 == pytest.approx(14.0)


def test_idle_beside_a_split_and_in_a_full_cell_are_told_apart():
    # rank 1 slower (speed 0.5): slot 0 takes 8 on rank 1, rank 0 waits 4 beside the split;
    # slot 1: rank 0's 6 against rank 1's 2, rank 1 waits 4; encoders 3 against 2, 1 waited.
    # Rank 0's slot 1 holds 9 of 10 tokens (full) but waits for no one.
    plan = hand_plan(speed_R=np.array([1.0, 0.5]))
    got = fsdp_breakdown([plan], np.array([10, 9, 2]), dp=2, budget=10, ideal=1.0)
    assert got["slot_idle"] == pytest.approx(8 / 2)
    assert got["slot_idle_beside_splits"] == pytest.approx(4 / 2)
    assert got["slot_idle_in_full_cells"] == 0.0
    assert got["work"] == pytest.approx((4 + 6 + 3 + 8 + 2 + 2) / 2)
    assert got["encoder_idle"] == pytest.approx(1 / 2)
    # rank 1 holding a sample of 9 tokens in slot 1 instead: it waits in a full cell now
    plan.sample_P[3] = 3
    got = fsdp_breakdown([plan], np.array([10, 9, 2, 9]), dp=2, budget=10, ideal=1.0)
    assert got["slot_idle_in_full_cells"] == pytest.approx(4 / 2)


@pytest.mark.parametrize("dataset", ["omni", "lognormal"])
def test_the_parts_add_up_to_every_policys_fsdp_time(dataset):
    dp, per_step = 16, 16 * 8
    stream = generate(dataset, per_step * 4, seed=3)
    comm = CommModel(bandwidth=25e9)
    costs = Costs.from_llm(24576.0, 1.0, **comm.collectives())
    config = PlannerConfig(dp=dp, micro_batch_tokens=16384, window=4, epsilon=0.05, sp_max=8)
    result = simulate(stream, steps_by_count(stream.num_samples, per_step), costs, config)
    assert set(result["policies"]) == set(ALL_POLICIES)
    for name, policy in result["policies"].items():
        parts = policy["fsdp_breakdown"]
        assert sum(parts[k] for k in PARTS) == pytest.approx(policy["fsdp_over_ideal"],
                                                             rel=1e-9), name
        assert 0.0 <= parts["slot_idle_beside_splits"] <= parts["slot_idle"] + 1e-12, name
        assert 0.0 <= parts["slot_idle_in_full_cells"] <= parts["slot_idle"] + 1e-12, name
        assert parts["work"] >= 1.0 - 1e-9, name  # compute alone is the ideal
