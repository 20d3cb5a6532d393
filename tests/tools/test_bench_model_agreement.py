"""The long-tailed bench's check of the cost model against the real step
(``e2e_long_tail.model_agreement``), on hand-made rounds."""

from __future__ import annotations

import math

from omniscale.tools.bench.e2e_long_tail import AGREEMENT, OURS, model_agreement


def rounds_of(*runs: tuple[float, list[float]]) -> list[dict]:
    return [{"runs": {OURS: {"measured_over_predicted": total,
                             "step_measured_over_predicted": steps},
                      "token_lpt": {"measured_over_predicted": 9.0,
                                    "step_measured_over_predicted": [9.0]}}}
            for total, steps in runs]


def test_the_median_round_decides_and_every_step_is_shown():
    got = model_agreement(rounds_of((1.02, [0.9, 1.1]), (1.20, [1.3]), (1.10, [1.05, 0.97])))
    assert got["measured_over_predicted"] == 1.10  # median of 1.02, 1.10, 1.20
    assert (got["step_min"], got["step_max"]) == (0.9, 1.3)  # ours only, every round
    assert got["held"] and got["within"] == AGREEMENT == 0.15


def test_a_model_off_by_more_than_the_bound_either_way_misses():
    assert not model_agreement(rounds_of((1.16, [1.16]), (1.2, [1.2])))["held"]
    assert not model_agreement(rounds_of((0.84, [0.84])))["held"]
    assert model_agreement(rounds_of((0.86, [0.86])))["held"]


def test_runs_without_a_prediction_hold_nothing():
    got = model_agreement(rounds_of((float("nan"), [])))
    assert not got["held"] and math.isnan(got["measured_over_predicted"])
    assert not model_agreement([])["held"]
