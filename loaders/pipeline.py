"""The default backend of a rank's loader: the loader's own worker processes decode by
reference (:class:`RankLoader`).

What every backend shares -- plans from a plan source, the assembly thread, iteration -- is
:class:`loaders.step_loader.StepLoader`; the Ray backend is :mod:`loaders.ray_loaders`. Commits
are the trainer's, through its plane session (``tools.train.plane_session``).
"""

from __future__ import annotations

import warnings
from collections import deque

from omniscale.loaders.assemble import DecodedStep
from omniscale.loaders.chunk_worker import RefDataset
from omniscale.loaders.chunks import plan_chunks
from omniscale.loaders.plan_items import PlanItems
from omniscale.loaders.prefetch import END
from omniscale.loaders.step_loader import StepLoader
from omniscale.loaders.transfer import ShmRing, transfer_bytes, unpack
from omniscale.loaders.worker_pool import WorkerDeath, WorkerPool

__all__ = ["RankLoader"]


class RankLoader(StepLoader):
    """The default backend: worker processes (``loaders.worker_pool``) decode by reference.

    Each plan becomes work items of a micro-batch each (``loaders.chunks``: the worker
    decodes its samples and packs it; one dummy item for an empty plan), fed to the workers
    in plan order as far as the prefetch bound allows (:class:`loaders.plan_items.PlanItems`),
    so workers run ahead across step boundaries and hand a micro-batch over in one piece
    (:func:`loaders.transfer.pack`). Results come back in order; a step is complete after its
    item count.

    A worker that dies (``kill -9``, the OOM killer) is replaced by the pool, and the items it
    held are decoded again by its successor; decoding is by reference and pure, so the
    StepBatches are exactly those of a run without the death. Each restart is counted in
    :attr:`worker_restarts` and warned about; the ``max_worker_restarts + 1``-th death in a
    row while on the same step (a sample that kills its decoder every time) ends the loader
    with an error. ``2 * decode_timeout + 60`` seconds without a result is only a backstop
    behind the per-sample watchdog.
    """

    _POLL_S = 1.0  # how often a wait for results looks at the stop flag (close interrupts it)
    # Items each worker may hold decoded ahead (what torch's prefetch_factor was; its default
    # is 2). 4 keeps a worker decoding while the trainer drains a long video item (measured:
    # mixed and video +5-13%, text and image unchanged), and matches the ring's 4 slots a
    # worker.
    _ITEMS_AHEAD = 4

    def __init__(self, *args, max_worker_restarts: int = 3, **kwargs) -> None:
        if max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts: must be >= 0, got {max_worker_restarts}")
        super().__init__(*args, **kwargs)
        self.max_worker_restarts = int(max_worker_restarts)
        self.worker_restarts = 0
        self._pool: WorkerPool | None = None  # the assembly thread's, while it runs
        self._on_step: int | None = None  # the step being assembled
        self._death_step, self._deaths_in_a_row = None, 0

    def _interrupt(self) -> None:
        pool = self._pool  # the assembly thread's; it may be closing it right now (harmless)
        if pool is not None:
            pool.interrupt()

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes (empty before the first ``next()`` and with
        ``num_workers=0``); a dead worker's successor takes its place."""
        pool = self._pool
        return pool.pids() if pool is not None else []

    def _decoded_steps(self):
        steps: deque = deque()  # (step, plan, item count), END, or an exception: plan order
        items = PlanItems(self.plans, steps, self._chunks)
        if not self.num_workers:
            yield from self._decoded_here(items, steps)
            return
        # Workers hand items over through slots mapped once, before they fork
        # (``loaders.transfer``); the pool owns the ring from here on.
        ring = ShmRing(self.num_workers)
        try:
            pool = WorkerPool(RefDataset(self.spec, self.decode_timeout, self.geometry,
                                         ring).__getitem__,
                              self.num_workers, self._ITEMS_AHEAD, ring=ring,
                              on_death=self._worker_died, name=f"omniscale-loader-{self.rank}")
        except BaseException:
            ring.close()  # mapped for workers that did not start
            raise
        self._pool = pool
        try:
            while not self._stop.is_set():
                self._feed(pool, items)
                head = _next_step(steps)
                if head is None:
                    return
                step, plan, count = head
                self._on_step = step
                decoded = DecodedStep({})
                for _ in range(count):
                    self._feed(pool, items)
                    got = self._next_result(pool)
                    if got is None:  # closing
                        return
                    decoded.transfer_bytes += transfer_bytes(got[1])
                    decoded.update(unpack(got[1]))
                yield step, plan, decoded
        finally:
            self._pool = None
            pool.close()

    def _decoded_here(self, items: PlanItems, steps: deque):
        """No worker processes: each step's items decoded on the assembly thread."""
        dataset = RefDataset(self.spec, self.decode_timeout, self.geometry)
        try:
            while not self._stop.is_set():
                items.wait()
                head = _next_step(steps)
                if head is None:
                    return
                step, plan, count = head
                decoded = DecodedStep({})
                for _ in range(count):
                    decoded.update(dataset[items.take()][1])
                yield step, plan, decoded
        finally:
            dataset.close()

    def _chunks(self, plan) -> list:
        """A plan's work items (``loaders.chunks.plan_chunks``: a micro-batch each, built in
        the worker); ``[None]`` for a plan with nothing to decode (its step still passes
        through)."""
        rank = self.rank if self.skip_moved_media else None
        return plan_chunks(plan, rank, encode_parts=max(1, self.num_workers)) or [None]

    @staticmethod
    def _feed(pool: WorkerPool, items: PlanItems) -> None:
        """Hand the workers the items that are ready, up to the pool's prefetch bound; wait
        for a plan first only when the pool holds nothing submitted and not yet returned (so
        no commit the plane waits for is held here)."""
        if not pool.outstanding:
            items.wait()
        while pool.has_room() and items.ready():
            pool.submit(items.take())

    def _next_result(self, pool: WorkerPool):
        """The next decoded item, waiting ``_POLL_S`` at a time; None once the loader is
        closing. A worker's death is handled inside (``_worker_died``)."""
        backstop = 2 * self.decode_timeout + 60 if self.decode_timeout else None
        waited = 0.0
        while True:
            got = pool.get(timeout=self._POLL_S)
            if got is not None:
                return got
            if self._stop.is_set():
                return None
            waited += self._POLL_S
            if backstop is not None and waited >= backstop:
                raise RuntimeError(f"rank {self.rank}: no result from the loader's workers "
                                   f"for {backstop:g} seconds")

    def _worker_died(self, death: WorkerDeath) -> None:
        """The pool's ``on_death``, on the assembly thread: count it, warn, or give up (by
        raising, which ends the loader) when the same step has killed one too often."""
        step = self._on_step
        self._deaths_in_a_row = self._deaths_in_a_row + 1 if step == self._death_step else 1
        self._death_step = step
        if self._deaths_in_a_row > self.max_worker_restarts:
            raise RuntimeError(
                f"rank {self.rank}: DataLoader worker (pid {death.pid}) died while on step "
                f"{step}, {self._deaths_in_a_row} times in a row; giving up (a sample of this "
                f"step or the next may kill its decoder every time; the last was "
                f"{death.reason})")
        self.worker_restarts += 1
        first = min((tag[0] for tag, _ in death.items), default=step)
        warnings.warn(f"rank {self.rank}: DataLoader worker (pid {death.pid}) died; new "
                      f"workers decode again from step {first} the {len(death.items)} work "
                      f"items it held ({death.reason}; restart {self.worker_restarts})",
                      RuntimeWarning, stacklevel=2)


def _next_step(steps: deque):
    """The next step's entry, ``(step, plan, item count)``, in plan order; None when the loader
    is closing (nothing queued) or the plans ran out; a plan source's error is raised."""
    if not steps:
        return None
    head = steps.popleft()
    if head is END:
        return None
    if isinstance(head, BaseException):
        raise head
    return head
