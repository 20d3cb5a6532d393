"""Rank speeds: how fast each data rank works through its plans, for the planner to give a slower
rank proportionally less work.

A rank's speed at a step is its plan's predicted cost (work, in cost units) over its compute
seconds (``compute_clock``: on CPU the time its threads were runnable, so a noisy neighbour on
its core counts and waiting for the other ranks does not; on CUDA the wall time for now). Only
ratios matter: the fastest rank is 1. Part of a step costs a rank the same whatever its share
(the optimizer, micro-batches it fills with a placeholder), so a slowed rank's speed falls as
its share does; measured again at each share, the speeds settle where the ranks' compute times
are even, which is what the step waits for. Smoothed: each rank's speed is the median of its last
``window`` steps, so one odd step (a page fault, a collection pause) moves nothing and two slow
steps in a row do.

Rank 0 tells the plane (``plane_session.PlaneSession.tell_speeds``, the ``speeds`` action) when
a rank's smoothed speed moved by more than ``tolerance`` of what the plane has; ranks all
within ``tolerance`` of the fastest are equal (``[]``), so even hardware keeps the plans of
equal ranks. The plane logs them and re-plans from the next step no rank has started, and
every rank's loader fetches those plans again (``trainer.Trainer.tell_speeds``), so a slowed
rank gets less work from the step after the one that showed it, and its full share back once
it recovers. Not in
deterministic mode: plans there must not depend on timing (the speeds are still in the rows).
Every rank keeps the same tracker (every rank sees every rank's timing in ``records.flush``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque


@dataclasses.dataclass
class SpeedTracker:
    window: int = 3  # steps each rank's speed is the median of
    tolerance: float = 0.10  # relative change that is news; spread under which ranks are equal
    history: dict[int, deque] = dataclasses.field(default_factory=dict)
    told: list[float] = dataclasses.field(default_factory=list)  # the plane's; []: equal
    pending: tuple[int, list[float]] | None = None  # (as of step, speeds) not yet told

    def observe(self, step: int, costs: list[float], secs: list[float]) -> dict:
        """One step's per-rank predicted costs and compute seconds: the row's fields
        (``rank_speed``: each rank's smoothed relative speed, once every rank has one)."""
        for rank, (cost, seconds) in enumerate(zip(costs, secs)):
            if cost > 0 and seconds > 0:  # an idle rank says nothing about its speed
                self.history.setdefault(rank, deque(maxlen=self.window)).append(cost / seconds)
        if len(costs) < 2 or any(not self.history.get(r) for r in range(len(costs))):
            return {}
        smoothed = [statistics.median(self.history[r]) for r in range(len(costs))]
        top = max(smoothed)
        relative = [v / top for v in smoothed]
        wanted = [] if min(relative) >= 1 - self.tolerance else relative
        if self._news(wanted):
            self.pending = (step, wanted)
        return {"rank_speed": [round(v, 3) for v in relative]}

    def _news(self, wanted: list[float]) -> bool:
        if not wanted or not self.told:
            return bool(wanted) != bool(self.told)
        return len(wanted) != len(self.told) or any(
            abs(w - t) > self.tolerance * t for w, t in zip(wanted, self.told))

    def tell(self, plane, writer: bool, deterministic: bool, from_step: int | None = None
             ) -> dict | None:
        """Rank 0 (``writer``) sends the pending speeds to ``plane`` (the rank's
        ``PlaneSession``), to apply from ``from_step`` if given (the first step no rank has
        started: ``DataPlane.set_speeds``); the plane's reply (``{applies_at_step, speeds}``)
        or None. A plane that cannot take them costs one line, not the run: the plans stay as
        they were."""
        from omniscale.dataplane.client import PlaneError

        if self.pending is None or not writer or plane is None or deterministic:
            return None
        step, speeds = self.pending
        self.pending = None
        try:
            reply = plane.set_speeds(step, speeds, from_step)
        except PlaneError as e:
            print(f"rank speeds: the plane was not told ({str(e).splitlines()[0]})",
                  flush=True)
            return None
        self.told = speeds
        return reply
