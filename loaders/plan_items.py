"""A rank's plans as decode work items, in plan order, for :class:`loaders.pipeline.RankLoader`.

Each plan becomes work items of a micro-batch each (the loader's ``chunks``: a cut of the
plan), tagged ``(step, i)``. Before a plan's first item leaves, its entry ``(step, plan,
item count)`` goes into ``steps``, the consumer's record of which results make up which step;
the end of the mixture (``prefetch.END``) or the plane's refusal goes there too, in order.

Plans are pulled from the prefetcher only as items are wanted: without waiting
(:meth:`PlanItems.ready`) while the loader still has items in flight, waiting
(:meth:`PlanItems.wait`) only when it holds none. The plane plans a step only so far past the
last commit, so waiting for a plan while holding an item of a step not yet trained would wait
for a commit that cannot come.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from omniscale.loaders.prefetch import END, PlanPrefetcher


class PlanItems:
    """Work items ``((step, i), chunk)`` of each plan ``plans`` hands out, each plan cut by
    ``chunks(plan)`` (a list, never empty), its entry recorded in ``steps`` first."""

    def __init__(self, plans: PlanPrefetcher, steps: deque, chunks: Callable) -> None:
        self.plans, self.steps, self.chunks = plans, steps, chunks
        self.pending: deque = deque()  # items of plans pulled, not handed out yet
        self.ended = False  # END or an error recorded in ``steps``: nothing more

    def ready(self) -> bool:
        """An item can be handed out now (pulls a plan that is ready, without waiting)."""
        return bool(self.pending) or (not self.ended and self._pull(False)
                                      and bool(self.pending))

    def wait(self) -> None:
        """Wait until an item can be handed out or nothing more will come."""
        while not self.pending and not self.ended:
            self._pull(True)

    def take(self):
        """The next item; :meth:`ready` or :meth:`wait` said there is one."""
        return self.pending.popleft()

    def _pull(self, block: bool) -> bool:
        """The next plan's items into ``pending``; False when none is ready (not blocking)."""
        try:
            got = self.plans.get() if block else self.plans.poll()
        except BaseException as e:  # noqa: BLE001 -- the consumer raises it in order
            got = e
        if got is None:
            return False
        if got is END or isinstance(got, BaseException):
            self.steps.append(got)
            self.ended = True
            return True
        step, plan = got
        chunks = self.chunks(plan)
        self.steps.append((step, plan, len(chunks)))
        self.pending.extend(((step, i), chunk) for i, chunk in enumerate(chunks))
        return True
