"""Every rank table's metadata, written from per-step text (``plan_table._metadata_text``),
is the JSON of the metadata dict the plan module defines (``omniscale.plan.with_metadata``):
the same keys in the same order and the same values, rank and predicted cost per rank."""

from __future__ import annotations

import json

import numpy as np

from omniscale.balancer.cost import Costs
from omniscale.balancer.planner import plan_step
from omniscale.balancer.types import PlannerConfig, WindowSamples
from omniscale.dataplane.plan_table import window_rank_tables
from omniscale.plan import METADATA_KEY
from omniscale.refs import SampleRef


def test_metadata_is_the_dicts_json():
    dp = 5
    tokens_N = np.array([900, 40, 3000, 7, 512, 2048, 33, 1200], np.int64)
    samples = WindowSamples.from_lengths(tokens_N)
    config = PlannerConfig(dp=dp, micro_batch_tokens=4096, window=1, sp_max=1)
    plans = [plan_step(samples, Costs.from_llm(3.0, 0.001), config, step=0)]
    refs = [SampleRef(0, "src", "s.tar", f"k{i}", 0, 1, llm_tokens=int(t))
            for i, t in enumerate(tokens_N)]
    for side in ({"baseline": "token_lpt", "baseline_step_cost": 1.0 / 3.0}, None):
        tables = window_rank_tables(plans, refs, samples.item_offsets_N1[:-1], [7], [dp],
                                    [side])
        plan = plans[0]
        for r in range(dp):
            expected = {"step": 7, "rank": r, "dp": dp,
                        "num_micro_batches": plan.num_micro_batches,
                        "predicted_cost": float(plan.mb_cost_RB[r].sum()),
                        "step_max_cost": float(plan.mb_cost_RB.sum(axis=1).max()),
                        "lower_bound": plan.lower_bound,
                        "imbalance": plan.imbalance, "reshard": plan.reshard, **(side or {})}
            text = tables[(7, r)].schema.metadata[METADATA_KEY].decode()
            assert text == json.dumps(expected)
