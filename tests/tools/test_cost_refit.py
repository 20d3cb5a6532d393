"""The trainer's online cost refit: measured (lengths, seconds) per rank and step give back the
cost model that produced them; a poor fit is not sent."""

from __future__ import annotations

import numpy as np

from omniscale.tools.train.cost_model import CostRefit


def test_refit_recovers_the_cost_model_from_step_measurements():
    rng = np.random.default_rng(0)
    refit = CostRefit()
    for _ in range(40):  # 40 steps x 2 ranks
        lengths = [rng.integers(50, 4000, size=rng.integers(1, 8)).tolist() for _ in range(2)]
        seconds = [2e-5 * sum(r) + 3e-9 * sum(n * n for n in r) + 1e-3 * len(r)
                   for r in lengths]
        refit.add(lengths, seconds)
    got = refit.fit()
    assert got is not None and got["r2"] > 0.999
    assert abs(got["linear"] - 2e-5) / 2e-5 < 1e-3 and abs(got["quadratic"] - 3e-9) / 3e-9 < 1e-3


def test_noise_is_not_a_cost_model():
    rng = np.random.default_rng(1)
    refit = CostRefit()
    for _ in range(40):
        lengths = [rng.integers(50, 4000, size=3).tolist() for _ in range(2)]
        refit.add(lengths, rng.uniform(0.1, 1.0, size=2).tolist())
    assert refit.fit() is None
    assert CostRefit().fit() is None  # no measurements yet
