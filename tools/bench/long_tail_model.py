"""The long-tail bench's measured steps beside the model's prediction of them: tokens/s of
the samples' own tokens, the measured over predicted time as calibrated and at the run's own
speed, and the model's agreement with the real step (issue #44, item 4) over rounds.

Used by ``tools/bench/e2e_long_tail.py`` (``--schedule separate``: one run per policy) and
``tools/bench/long_tail_turns.py`` (the policies in turns inside each run).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from omniscale.balancer.simulate import OURS

# tokens/s of the measured steps: the samples' own tokens (a split sample's padding to a
# multiple of k, which the trainer's "tokens" counts, left out) over the summed step time.
# Every policy trains the same samples in the measured windows, so a ratio of these is the
# inverse ratio of the time the policies took for the same work.
RATE = "tokens_per_s_real"
AGREEMENT = 0.15  # issue #44 item 4: the real step and the model's prediction, SP and reshard on
# The run's own speed is measured on its warm-up steps from this one: step 0 pays what a run
# pays once (threads started, the allocator and the decoders' first items), not its rate.
SPEED_FROM = 1
AT_RUN_SPEED = "_at_run_speed"  # the suffix of the figures with the run's speed (``_measured``)


def _measured(rows: list[dict], predicted: dict | None,
              speed_rows: Sequence[dict] = ()) -> dict:
    """A run's measured steps beside their prediction: step times, real tokens/s, and
    whether each step trained the tokens the prediction planned (padding included). With
    ``speed_rows`` (its warm-up steps from ``SPEED_FROM``, the prediction's ``speed_step_s``
    for the same steps) also the prediction at the run's own speed (``AT_RUN_SPEED``)."""
    out = _beside_prediction(rows, predicted)
    warm = [row["step_s"] for row in speed_rows]
    if "step_measured_over_predicted" in out and warm \
            and len(warm) == len(predicted.get("speed_step_s", ())):
        # seconds this run took per second the model predicts, on steps it is not checked on
        scale = sum(warm) / sum(predicted["speed_step_s"])
        out.update(speed_step_s=warm, speed_steps_tokens_as_predicted=[
            row["tokens"] for row in speed_rows] == predicted["speed_tokens_padded_per_step"])
        out.update(at_run_speed(out, predicted, [scale] * len(rows)))
    return out


def _beside_prediction(rows: list[dict], predicted: dict | None) -> dict:
    """``_measured`` without the run's speed: the steps' figures and the prediction's."""
    seconds = sum(row["step_s"] for row in rows)
    counted = [row["tokens"] for row in rows]
    out = {"step_s": [row["step_s"] for row in rows], "tokens_per_step": counted,
           "samples_per_step": [sum(row.get("mix_samples", {}).values()) for row in rows],
           "sp_split_per_step": [row.get("sp_split_samples", 0) for row in rows]}
    if predicted is None or "tokens_per_step" not in predicted:
        return {**out, RATE: sum(counted) / seconds, "measured_over_predicted": float("nan"),
                "tokens_as_predicted": False}
    out.update({RATE: sum(predicted["tokens_per_step"]) / seconds,
                "measured_over_predicted": seconds / sum(predicted["step_s"]),
                "step_measured_over_predicted": [m / p for m, p in zip(out["step_s"],
                                                                       predicted["step_s"])],
                "tokens_as_predicted": counted == predicted["tokens_padded_per_step"]})
    return out


def at_run_speed(out: dict, predicted: dict, scale_N: Sequence[float]) -> dict:
    """The prediction at the run's own speed: each measured step's predicted seconds times
    the speed scale of the run it ran in (``scale_N``: measured over predicted seconds on that
    run's warm-up steps; one run, one scale), the steps summed as in ``_beside_prediction``."""
    scaled = [p * k for p, k in zip(predicted["step_s"], scale_N)]
    return {"run_speed_scale": sum(scaled) / sum(predicted["step_s"]),
            f"measured_over_predicted{AT_RUN_SPEED}": sum(out["step_s"]) / sum(scaled),
            f"step_measured_over_predicted{AT_RUN_SPEED}": [
                m / p for m, p in zip(out["step_s"], scaled)]}


def _agreement(runs: list[dict], suffix: str = "") -> dict:
    total_key = f"measured_over_predicted{suffix}"
    steps_key = f"step_measured_over_predicted{suffix}"
    if not runs or any(math.isnan(r.get(total_key, float("nan"))) for r in runs):
        return {"measured_over_predicted": float("nan"), "step_min": float("nan"),
                "step_max": float("nan"), "held": False}
    total = statistics.median(r[total_key] for r in runs)
    steps = [x for r in runs for x in r[steps_key]]
    return {"measured_over_predicted": total, "step_min": min(steps), "step_max": max(steps),
            "held": abs(total - 1) <= AGREEMENT}


def model_agreement(rounds: list[dict]) -> dict:
    """Our runs' measured step time over the model's prediction for the same plans (SP splits
    and reshards on), the summed measured steps over the summed predicted ones, median over
    rounds, each step's ratio's range beside it -- two ways:

    - with the cost file's seconds as calibrated (the top level): what the model says before
      the run, this machine's speed at calibration time included;
    - at the run's own speed (``at_run_speed``): the prediction scaled by the run's measured
      seconds per predicted second over its warm-up steps (``SPEED_FROM`` to the first
      measured step, none of which it is checked on). What is left is the model's shape --
      how it prices one composition, split and reshard against another -- which is what the
      planner decides by; a machine whose speed moves between the calibration and the run
      cannot move it. ``held`` is judged on this one, within ``AGREEMENT``."""
    runs = [r["runs"][OURS] for r in rounds if OURS in r["runs"]]
    as_calibrated = _agreement(runs)
    at_run_speed = _agreement(runs, AT_RUN_SPEED)
    if runs and not math.isnan(at_run_speed["measured_over_predicted"]):
        at_run_speed["run_speed_scale"] = statistics.median(r["run_speed_scale"] for r in runs)
    return {"within": AGREEMENT, **{k: v for k, v in as_calibrated.items() if k != "held"},
            "held_as_calibrated": as_calibrated["held"], "at_run_speed": at_run_speed,
            "held": at_run_speed["held"]}
