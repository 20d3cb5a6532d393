"""The long-tailed bench's check of the cost model against the real step
(``long_tail_model.model_agreement`` and the run's own speed in ``_measured``), on hand-made
rounds and rows."""

from __future__ import annotations

import math

import pytest

from omniscale.tools.bench.long_tail_model import (
    AGREEMENT,
    AT_RUN_SPEED,
    OURS,
    _measured,
    model_agreement,
)


def rounds_of(*runs: tuple[float, list[float]], scale: float = 1.0) -> list[dict]:
    """Rounds whose runs took ``total`` (and ``steps``) times the cost file's prediction and
    ran at ``scale`` times its seconds on their warm-up steps."""
    def run(total, steps):
        return {"measured_over_predicted": total, "step_measured_over_predicted": steps,
                "run_speed_scale": scale,
                f"measured_over_predicted{AT_RUN_SPEED}": total / scale,
                f"step_measured_over_predicted{AT_RUN_SPEED}": [x / scale for x in steps]}
    return [{"runs": {OURS: run(total, steps), "token_lpt": run(9.0, [9.0])}}
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


def test_the_runs_speed_takes_out_the_machines_speed_and_the_verdict_follows_it():
    # a run 1.2x slower than calibrated, everywhere: the model's shape is right
    got = model_agreement(rounds_of((1.26, [1.2, 1.32]), scale=1.2))
    assert not got["held_as_calibrated"] and got["measured_over_predicted"] == 1.26
    assert got["at_run_speed"]["measured_over_predicted"] == pytest.approx(1.05)
    assert got["at_run_speed"]["run_speed_scale"] == 1.2
    assert got["at_run_speed"]["step_max"] == pytest.approx(1.1)
    assert got["held"] and got["at_run_speed"]["held"]
    # as calibrated on the mark, but the measured steps 1.25x slower than the warm-up ones:
    # the model priced them wrong against the warm-up's
    got = model_agreement(rounds_of((1.0, [1.0]), scale=0.8))
    assert got["held_as_calibrated"] and not got["held"]


def test_runs_without_a_prediction_hold_nothing():
    got = model_agreement(rounds_of((float("nan"), [])))
    assert not got["held"] and math.isnan(got["measured_over_predicted"])
    assert not model_agreement([])["held"]


def test_measured_scales_the_prediction_by_the_warm_up_steps_it_is_not_checked_on():
    predicted = {"tokens_per_step": [100, 100], "tokens_padded_per_step": [100, 102],
                 "step_s": [1.0, 2.0], "speed_step_s": [0.5, 1.5],
                 "speed_tokens_padded_per_step": [90, 90]}
    warm = [{"step_s": 0.6, "tokens": 90}, {"step_s": 1.8, "tokens": 90}]  # 2.4 s for 2.0
    rows = [{"step_s": 1.5, "tokens": 100}, {"step_s": 2.1, "tokens": 102}]  # 3.6 s for 3.0
    got = _measured(rows, predicted, warm)
    assert got["measured_over_predicted"] == pytest.approx(1.2)
    assert got["run_speed_scale"] == pytest.approx(1.2)
    assert got[f"measured_over_predicted{AT_RUN_SPEED}"] == pytest.approx(1.0)
    assert got[f"step_measured_over_predicted{AT_RUN_SPEED}"] == pytest.approx([1.25, 0.875])
    assert got["tokens_as_predicted"] and got["speed_steps_tokens_as_predicted"]
    # a warm-up that trained other tokens than planned is said
    assert not _measured(rows, predicted, [{"step_s": 1.0, "tokens": 1}] * 2)[
        "speed_steps_tokens_as_predicted"]
    # no warm-up steps (--warmup 1 or 0): no figure at the run's speed
    assert "run_speed_scale" not in _measured(rows, predicted, [])
