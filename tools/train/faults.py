"""A test's faults and debug hooks (the config's ``debug.*``), behind one object.

The trainer builds one :class:`Faults` per rank from ``debug:`` (``Faults.of``) before the
step environment (``step.StepEnv.faults``); the step, the loop and the checkpoint call its
methods at their injection points and never read ``debug.*`` themselves. Each setting is
narrowed to this rank when the object is built, so a method only compares the step. A run
without any of them gets :data:`NO_FAULTS`, whose methods do nothing (``on_loss`` hands the
loss back untouched).

The points, in the order a step meets them:

- ``before_step`` (trainer, before the task's step): ``debug.hang`` -- this rank sleeps.
- ``in_compute`` (first thing inside the compute clock): ``debug.slow_rank`` -- this data
  rank spins, so the straggler detection sees compute, not waiting.
- ``on_loss`` (each micro-batch's summed loss, before the backward): ``debug.poison`` -- a
  NaN or a spike for the update guard to catch.
- ``before_clip`` (after the backward, before clipping): ``debug.dump_grads_at_step`` -- the
  whole gradients to ``RUN_DIR/grads-step-N.pt`` (a collective: every rank calls it).
- ``in_save`` (rank 0, a synchronous checkpoint's files written, ``meta.json`` not yet
  renamed into place): ``debug.kill_in_save`` -- kill -9.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omniscale.tools.train import collectives

if TYPE_CHECKING:
    from omniscale.tools.train.config import (
        DebugSection,
        HangSection,
        PoisonSection,
        SlowRankSection,
    )


@dataclasses.dataclass(frozen=True)
class Faults:
    """This rank's share of ``debug:`` (module docstring); every field None: nothing."""

    poison: PoisonSection | None = None  # this rank's (global rank)
    hang: HangSection | None = None  # this rank's (global rank)
    slow_rank: SlowRankSection | None = None  # this data rank's
    dump_grads_at_step: int | None = None
    kill_in_save: int | None = None
    writer: bool = False  # global rank 0: writes the gradients
    output_dir: Path | None = None  # RUN_DIR, where the gradients go

    @classmethod
    def of(cls, debug: DebugSection, rank: int, data_rank: int, writer: bool,
           output_dir: str | Path) -> Faults:
        """This rank's faults: ``rank`` the global rank (``debug.poison`` and ``debug.hang``
        name one), ``data_rank`` the plane's (``debug.slow_rank`` names one); NO_FAULTS
        when the run sets none."""
        faults = cls(
            poison=debug.poison if debug.poison is not None and debug.poison.rank == rank
            else None,
            hang=debug.hang if debug.hang is not None and debug.hang.rank == rank else None,
            slow_rank=debug.slow_rank
            if debug.slow_rank is not None and debug.slow_rank.rank == data_rank else None,
            dump_grads_at_step=debug.dump_grads_at_step, kill_in_save=debug.kill_in_save)
        if faults == NO_FAULTS:
            return NO_FAULTS
        return dataclasses.replace(faults, writer=writer, output_dir=Path(output_dir))

    def before_step(self, step: int) -> None:
        """``debug.hang``: a test's hang -- this rank sleeps inside the step."""
        hang = self.hang
        if hang is not None and hang.step == step:
            time.sleep(hang.seconds)

    def in_compute(self, step: int) -> None:
        """``debug.slow_rank``: a test's straggler -- this data rank computes ``seconds``
        longer at every step from ``from_step``. It spins rather than sleeps: on CPU the
        compute clock reads CPU time, which a sleep does not use (``compute_clock``)."""
        slow = self.slow_rank
        if slow is not None and step >= slow.from_step:
            until = time.thread_time() + slow.seconds
            while time.thread_time() < until:
                pass

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``debug.poison``: a test's bad batch -- this rank's loss NaN, or a multiple of
        itself."""
        poison = self.poison
        if poison is None or poison.step != step:
            return loss
        return loss * (float("nan") if poison.kind == "nan" else poison.factor)

    def before_clip(self, step: int, model: torch.nn.Module, pp_group=None) -> None:
        """``debug.dump_grads_at_step``: the step's gradients before clipping, summed over the
        ranks (every stage's, given the pipeline's ``pp_group``), to
        ``RUN_DIR/grads-step-N.pt`` (rank 0 writes; ``torch.load(..., weights_only=True)``
        reads the dict). Tests compare them between 1 and N processes."""
        if step != self.dump_grads_at_step:
            return
        grads = collectives.full_gradients(model, pp_group)
        if self.writer:
            torch.save(grads, self.output_dir / f"grads-step-{step}.pt")

    def in_save(self, step: int) -> None:
        """``debug.kill_in_save``: a test's crash while the checkpoint of ``step`` is saved,
        between its files and ``meta.json`` (rank 0, synchronous saves)."""
        if self.kill_in_save == step:
            os.kill(os.getpid(), signal.SIGKILL)


NO_FAULTS = Faults()  # a run without debug faults: every method does nothing
