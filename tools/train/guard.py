"""The update guard: a step whose loss or gradient norm is not finite, or whose loss is above
``guard.spike_factor`` times the median of the last ``guard.spike_window`` applied steps, is not
applied.

The verdict is one collective decision: one all-reduce of (this rank's loss sum, whether its
gradient norm is finite), so every rank skips or steps together, paid with one host
synchronisation a step (the loss must be on the host to be judged). A skipped step changes
nothing the optimizer holds -- no AdamW moments, no step count, no router bias -- so the
parameters equal those of a run that never trained it. The data plane still counts the step as
trained (its samples are committed, not served again) and hears which samples it held
(``report_suspect``: kept in its state dir, quarantined from later epochs, listed by ``plane
status`` and in ``result.json``). ``guard.max_skipped_steps`` skips in a row stop the run with one
line: then it is not one bad batch.

The running median is seeded from the metrics rows of the steps before a resume, so a resumed run
judges its steps as the uninterrupted one did.
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path

import torch

from omniscale.errors import UserError
from omniscale.tools.train import collectives


class UpdateGuard:
    """One rank's guard (every rank holds the same history: it is fed all-reduced values)."""

    def __init__(self, cfg, history: list[float] = ()) -> None:
        self.cfg = cfg  # config.GuardSection
        self.losses = deque(history, maxlen=cfg.spike_window)
        self.skipped_in_a_row = 0

    def judge(self, loss_sum: torch.Tensor, divisor, grad_norm: torch.Tensor,
              contributes: bool = True) -> str | None:
        """Why this step must not be applied (None: apply it). ``loss_sum``: this rank's share
        of the step's summed loss (``contributes`` False: a copy another rank adds, e.g. a
        tensor-parallel peer's); ``divisor``: the global count it is divided by; ``grad_norm``:
        the global gradient norm (``parallel.grads.clip_grad_norm``). Every rank calls it."""
        local = loss_sum.detach().double().reshape(()) if contributes \
            else torch.zeros((), dtype=torch.float64, device=loss_sum.device)
        bad_norm = (~torch.isfinite(grad_norm.detach().double().reshape(()))).double()
        both = torch.stack([local, bad_norm.to(local.device)])
        # the world: each figure has one contributor per data rank
        total, bad = collectives.guard_verdict(both).tolist()  # the step's one host synchronisation
        loss = total / max(float(divisor), 1.0)
        reason = None
        if bad:
            reason = f"gradient norm {float(grad_norm):g}"
        elif not math.isfinite(loss):
            reason = f"loss {loss:g}"
        elif len(self.losses) >= self.cfg.min_history:
            median = sorted(self.losses)[len(self.losses) // 2]
            if loss > self.cfg.spike_factor * median:
                reason = (f"loss {loss:.4g} above {self.cfg.spike_factor:g} x the median "
                          f"{median:.4g} of the last {len(self.losses)} steps")
        if reason is None:
            self.losses.append(loss)
            self.skipped_in_a_row = 0
        else:
            self.skipped_in_a_row += 1
        return reason

    @property
    def stops_run(self) -> bool:
        """``max_skipped_steps`` steps in a row were not applied."""
        return self.skipped_in_a_row >= self.cfg.max_skipped_steps

    def stop(self, step: int, reason: str, run_dir: Path) -> None:
        """Stop the run in one line (every rank raises it)."""
        raise UserError(
            f"guard: {self.skipped_in_a_row} steps in a row not applied (step {step}: "
            f"{reason}); stopping -- the parameters are those of the last applied step, the "
            f"skipped steps' samples are suspect (`omniscale plane status`; state dir "
            f"{run_dir / 'plane'}); resume from the last checkpoint with a lower optim.lr, or "
            f"raise guard.max_skipped_steps")


def seeded(cfg, metrics: Path, start_step: int) -> UpdateGuard:
    """The guard of a run starting at ``start_step``: its history from the losses of the
    applied steps before it (``metrics.jsonl``), as the uninterrupted run had them."""
    history: list[float] = []
    if start_step > 0 and metrics.exists():
        from omniscale.tools.train.metrics import read_metrics

        history = [r["loss"] for r in read_metrics(metrics)
                   if r.get("step", start_step) < start_step and "update_skipped" not in r
                   and isinstance(r.get("loss"), float) and math.isfinite(r["loss"])]
    return UpdateGuard(cfg, history[-cfg.spike_window:])


def guarded_update(guard: UpdateGuard | None, optimizer, loss_sum: torch.Tensor, divisor,
                   grad_norm: torch.Tensor, contributes: bool = True) -> str | None:
    """``optimizer.step()`` unless ``guard`` (the run's, ``step.RunState.guard``; None: no
    guard) says the step must not be applied: then its gradients are dropped and the reason
    returned. ``contributes``: as for :meth:`UpdateGuard.judge`. Every rank calls it."""
    if guard is None:
        optimizer.step()
        return None
    reason = guard.judge(loss_sum, divisor, grad_norm, contributes=contributes)
    if reason is None:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return reason


def step_samples(batch) -> set[tuple]:
    """(source, shard, key, epoch) of every sample this rank's part of the step trained."""
    return {(r.source, r.shard, r.key, r.epoch) for mb in batch.micro_batches
            for r in (mb.seq_refs or ()) if r is not None}


def report_suspects(plane, step: int, batch, reason: str, rank: int) -> None:
    """Every rank's samples of a step not applied, gathered; rank 0 reports them to the plane
    (``plane``: the rank's ``plane_session.PlaneSession``, ``report_suspect``) and says so in
    one line."""
    gathered = collectives.gather_suspect_samples(step_samples(batch))
    if rank != 0:
        return
    samples = sorted(set().union(*gathered))
    plane.report_suspect(step, [dict(zip(("source", "shard", "key", "epoch"), s))
                                for s in samples], reason)
    print(f"guard: step {step} not applied ({reason}); its {len(samples)} samples reported to "
          f"the plane as suspect", flush=True)
