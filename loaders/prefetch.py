"""Plans fetched ahead: a background thread keeps the next ``depth`` plans of one rank ready.

A plan fetch is a network round trip to the plane; doing it on the trainer's critical path
would add that latency to every step. The thread fetches steps in order, each once there is
room for it: at most ``depth`` plans are fetched and not yet taken. A plan fetched is a plan
the plane can no longer change, so fetching no further ahead than that keeps the steps the
plane may still re-plan (a slowed rank's speeds, ``dataplane.plane.DataPlane.set_speeds``)
as near as the loader's own read-ahead allows.
The plane refuses steps too far past the last commit (it has not planned them yet): that is
back-pressure, not an error, so the thread waits and asks again, with backoff, until the
trainer commits: it asks at once when its rank's plane session says a commit was
acknowledged (:meth:`PlanPrefetcher.committed`), so a one-rank job does not sleep past its own
commit. The end of the mixture ends the queue; any other refusal is handed on.

A loader sees only a :class:`PlanSource`; this module is the one place in ``loaders/`` that
connects to the plane.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections import deque
from typing import Callable, Protocol

from omniscale.dataplane.actions import Reason
from omniscale.dataplane.client import PlaneError
from omniscale.dataplane.local import connect
from omniscale.plan import decode_plan

END = "end"  # the queue's last item when the mixture is exhausted


class PlanSource(Protocol):
    """Where a loader takes its rank's plans from, in step order: ``(step, plan)`` each, then
    END (or the plane's refusal, raised). A loader is handed one
    (``tools.train.plane_session.PlaneSession.plans``) and never talks to the plane itself."""

    def get(self):
        """The next plan; blocks until there is one. END once the data has run out."""

    def poll(self):
        """The next plan if one is ready, else None (never blocks)."""

    def close(self) -> None:
        """Stop fetching; a ``get`` waiting returns END."""

    def restart(self, step: int) -> int:
        """Fetch again from ``step``: the plane re-planned it and later steps. Plans handed out
        after this carry the returned generation; those handed out before keep theirs (the
        loader drops what it made of them). Plans fetched and not handed out are dropped."""


class PlanPrefetcher:
    """``get()`` returns ``(step, plan)`` for start_step, start_step + 1, …, then END (or
    raises the plane's refusal). The plan is the typed ``omniscale.plan.RankPlan``, decoded
    here from the served table: the loader's edge, the one place a plan table is read."""

    def __init__(self, url: str, rank: int, start_step: int, depth: int,
                 token: str | None = None, stop: threading.Event | None = None,
                 on_plan=None) -> None:
        if depth < 1:
            raise ValueError(f"prefetch_steps: must be >= 1, got {depth}")
        self.url, self.rank, self.token = url, rank, token
        self.next_step = start_step
        # restart() and the fetch thread's hand-over of a plan, each whole under the lock: a
        # plan fetched before a restart is never handed out after it
        self._lock = threading.Lock()
        self.generation = 0
        self.on_plan = on_plan  # called with each plan as it arrives (cache prefetch)
        self.stop = stop or threading.Event()
        self._commit_seen = threading.Event()  # a commit acknowledged since the last refusal
        self._room = threading.Semaphore(depth)  # plans that may be fetched and not taken
        self._queue: queue.Queue = queue.Queue()  # bounded by _room (+ END or a refusal)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"omniscale-plans-{rank}")
        self._thread.start()

    def get(self):
        """The next plan; blocks until it is fetched. END once the data has run out."""
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if self.stop.is_set():
                    return END
                continue
            return self._taken(item)

    def _taken(self, item):
        if isinstance(item, BaseException):
            raise item
        if item is not END:
            self._room.release()
        return item

    def committed(self, *_) -> None:
        """A commit of this rank was acknowledged: a step refused as too far ahead may be
        planned now (a future's done-callback, hence the ignored argument)."""
        self._commit_seen.set()

    def poll(self):
        """The next plan if one is ready, else None (never blocks)."""
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        return self._taken(item)

    def restart(self, step: int) -> int:
        with self._lock:
            if not self._thread.is_alive():  # it handed out END or a refusal and stopped
                raise RuntimeError(f"rank {self.rank}: the plans cannot be fetched again from "
                                   f"step {step}: the plan source has ended")
            self.generation += 1
            self.next_step = int(step)
            while True:  # the plans fetched and not handed out: their room is free again
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    return self.generation
                if item is END or isinstance(item, BaseException):  # the source's last word
                    self._queue.put(item)
                    raise RuntimeError(f"rank {self.rank}: the plans cannot be fetched again "
                                       f"from step {step}: the plan source has ended")
                self._room.release()

    def _put(self, item) -> bool:
        self._queue.put(item)
        return not self.stop.is_set()

    def _hand_over(self, step: int, generation: int, plan) -> bool:
        """Queue ``plan`` of ``step`` unless a restart came since it was asked for (then its
        room is freed and the thread asks again, from the restart's step)."""
        with self._lock:
            if generation != self.generation:
                self._room.release()
                return True
            if generation:
                plan = dataclasses.replace(plan, generation=generation)
            self._queue.put((step, plan))
            self.next_step += 1
        if self.on_plan is not None:
            self.on_plan(plan)
        return not self.stop.is_set()

    def _wait_for_room(self) -> bool:
        while not self.stop.is_set():
            if self._room.acquire(timeout=0.5):
                return True
        return False

    def _run(self) -> None:
        # in-process if this process serves the plane, else stream=True: the plan lane
        client = connect(self.url, token=self.token, stream=True)
        delay = 0.01
        try:
            while self._wait_for_room():
                self._commit_seen.clear()  # set by a commit acknowledged from here on
                with self._lock:
                    step, generation = self.next_step, self.generation
                try:
                    plan = decode_plan(client.get_plan(step, self.rank))
                except PlaneError as e:
                    if e.reason == Reason.EXHAUSTED:
                        self._put(END)
                        return
                    if e.reason == Reason.TOO_FAR_AHEAD:  # wait for the trainer's commits
                        if not self._commit_seen.wait(delay):  # other ranks' commits: backoff
                            delay = min(delay * 2, 0.5)
                        self._room.release()  # the room waits for this step still
                        continue
                    self._put(e)
                    return
                delay = 0.01
                if not self._hand_over(step, generation, plan):
                    return
        except BaseException as e:  # noqa: BLE001 -- whatever happens, the consumer hears it
            self._put(e)
        finally:
            client.close()

    def close(self) -> None:
        self.stop.set()
        self._commit_seen.set()
        self._thread.join(timeout=5)


class WarmAhead:
    """A plan source that takes ``ahead`` plans from ``plans`` before they are asked for and
    hands each to ``on_plan`` as it takes it (a loader warming its node cache with the bytes
    of the next steps' remote samples: ``loaders.remote_cache.Prefetcher``). It takes only
    what ``plans`` has ready (``poll``) and waits only when nothing is buffered, so it never
    waits for a plan the plane holds back for a commit.
    """

    def __init__(self, plans: PlanSource, ahead: int, on_plan: Callable) -> None:
        self.plans, self.ahead, self.on_plan = plans, int(ahead), on_plan
        self._taken: deque = deque()  # (step, plan), then END or the refusal, in order
        self._ended = False  # END or a refusal taken: nothing follows it

    def get(self):
        self._take_ready()
        if not self._taken and not self._ended:
            self._keep(self._next(self.plans.get))
        return self._hand_out()

    def poll(self):
        self._take_ready()
        return self._hand_out() if self._taken else None

    def close(self) -> None:
        self.plans.close()

    def restart(self, step: int) -> int:
        """The source's restart; the plans buffered here keep their generation (dropped
        downstream), their bytes warmed for nothing."""
        return self.plans.restart(step)

    def _take_ready(self) -> None:
        while not self._ended and len(self._taken) <= self.ahead:
            got = self._next(self.plans.poll)
            if got is None:
                return
            self._keep(got)

    @staticmethod
    def _next(fetch):
        try:
            return fetch()
        except BaseException as e:  # noqa: BLE001 -- raised when its turn comes
            return e

    def _keep(self, got) -> None:
        if got is END or isinstance(got, BaseException):
            self._ended = True
        else:
            self.on_plan(got[1])
        self._taken.append(got)

    def _hand_out(self):
        got = self._taken.popleft() if self._taken else END
        if isinstance(got, BaseException):
            raise got
        return got
