"""The cost model's life in a run, in one place: read the calibrated file, measure, refit, send.

- **read**: ``data.costs`` (a file of ``omniscale balance calibrate``; its format is
  ``balancer.cost_file``) gives the planner seconds for every kind (:func:`read_cost_file`);
- **measure**: every step's records give each data rank's sequence lengths and compute seconds
  (``records.flush`` hands them to :class:`CostRefit`, and the predicted costs with the seconds
  to :class:`CostFit`, the seconds per cost unit the straggler check and the predicted step
  time use);
- **refit and send**: every ``data.refit_costs_every`` steps rank 0 refits the LLM's model
  (``balancer.cost.fit``) and sends it to the plane (:func:`refit_and_send`), which plans the
  windows no rank has seen with it. A deterministic run logs the fit and sends nothing (its
  plans depend on the data alone).
"""

from __future__ import annotations

import json
from pathlib import Path

from omniscale.balancer.cost import fit
from omniscale.balancer.cost_file import planner_costs
from omniscale.errors import UserError


def read_cost_file(path: str | Path) -> dict:
    """``PlaneConfig`` arguments from a cost file; one line naming the file on a bad one."""
    try:
        return planner_costs(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a cost file of `omniscale balance calibrate` "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def write_cost_file(path: str | Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


class CostFit:
    """seconds ≈ k · predicted cost, k by least squares over (cost, seconds) pairs so far."""

    def __init__(self) -> None:
        self.sxy = self.sxx = 0.0

    @property
    def k(self) -> float | None:
        return self.sxy / self.sxx if self.sxx > 0 else None

    def update(self, costs: list[float], seconds: list[float]) -> None:
        for c, s in zip(costs, seconds):
            self.sxy += c * s
            self.sxx += c * c


class CostRefit:
    """The balancer's LLM cost model refitted from measured step times: every (step, rank) is
    one measurement (the lengths of the sequences the rank trained, its compute seconds);
    ``balancer.cost.fit`` gives ``α·ΣL + β·ΣL² + γ·count`` over the last ``keep``."""

    def __init__(self, keep: int = 512) -> None:
        self.lengths: list[list[int]] = []
        self.seconds: list[float] = []
        self.keep = keep

    def add(self, lengths_by_rank: list[list[int]], seconds_by_rank: list[float]) -> None:
        self.lengths += lengths_by_rank
        self.seconds += seconds_by_rank
        del self.lengths[:-self.keep], self.seconds[:-self.keep]

    def fit(self) -> dict | None:
        """``{linear, quadratic, r2, mape}`` when the measurements determine a usable model
        (non-negative coefficients, R² ≥ 0.5), else None."""
        try:
            result = fit(self.lengths, self.seconds)
        except ValueError:
            return None
        m = result.model
        if m.alpha < 0 or m.beta < 0 or (m.alpha == 0 and m.beta == 0) or result.r2 < 0.5:
            return None
        return {"linear": m.alpha, "quadratic": m.beta, "r2": round(result.r2, 4),
                "mape": round(result.mape, 4)}


def refit_and_send(refit: CostRefit, client, deterministic: bool) -> dict | None:
    """Fit the cost model to the measured step times and send it to the plane unless the run
    is deterministic (then plans depend on data alone and the fit is only logged): the fit
    for the metrics row (with the step it applies from, when sent), or None."""
    fitted = refit.fit()
    if fitted is None:
        return None
    if not deterministic:
        fitted["applies_at_step"] = client.set_costs(fitted["linear"],
                                                     fitted["quadratic"])["applies_at_step"]
    return fitted
