"""Compile the planner's numba kernels once per session, so no test pays (or times) the JIT."""

import numpy as np
import pytest

from omniscale.balancer.cost import CostModel, Costs
from omniscale.balancer.planner import plan_window
from omniscale.balancer.types import PlannerConfig, WindowSamples


@pytest.fixture(scope="session", autouse=True)
def warm_numba():
    samples = WindowSamples.from_lengths([5, 40, 3, 9], [0, 1, 0, 1], [0, 0, 1, 1])
    plan_window(samples, Costs(llm=CostModel(1.0, 1.0)), PlannerConfig(dp=2, micro_batch_tokens=32,
                                                                      window=2, sp_max=2))
    return np
