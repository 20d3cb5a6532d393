"""One rank's conversation with the plane: :class:`PlaneSession`.

Everything a trainer rank says to the plane or asks of it goes through its session: the plan
source its loader takes plans from (:meth:`PlaneSession.plans`), the corrupt samples the
loader reports (:meth:`PlaneSession.report`), the commits of the steps it trained, the guard's
suspect samples, the cost model's refits, the stragglers, the ranks' speeds, the checkpoint's
snapshot, status, and at the end of a run the reports the launcher lists
(:meth:`PlaneSession.write_reports`). A loader gets a plan source and a reporter and never
connects to the plane itself.

Two connections per rank: the plan lane of the plan source (the hot path, on its own
thread) and one control client for everything else. Rank 0 of an embedded plane calls it in
process (``dataplane.local.connect``): no connection at all.

:func:`loader_for` builds a loader with a session of its own from a plane's URL, for tools
and tests that drive one rank's loader by hand.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from omniscale.dataplane.actions import REPORT_KINDS
from omniscale.dataplane.client import PlaneError
from omniscale.dataplane.local import connect
from omniscale.loaders.prefetch import PlanPrefetcher
from omniscale.refs import SampleRef

REPORTS_FILE = "data_reports.json"  # RUN_DIR/…: the embedded plane's reports, for the launcher


class PlaneSession:
    """One rank's (``rank``: its data rank) conversation with the plane at ``url``.

    Commits go in step order, in the background (:meth:`commit`). Every other call is made
    on the caller's thread and answers as the plane does (a refusal is a ``PlaneError``)."""

    _MAX_COMMITS_IN_FLIGHT = 8

    def __init__(self, url: str, rank: int, token: str | None = None) -> None:
        self.url, self.rank, self.token = url, int(rank), token
        # One control client for the commit thread, the loader's assembly thread (corrupt
        # reports) and the trainer's thread, its calls one at a time: a PlaneClient is not
        # safe to share between threads making calls at once -- it opens its Flight channel
        # on first use and closes and reopens it when a call must be retried, under any
        # other call in flight. (A LocalPlaneClient holds no state; the plane has its lock.)
        self._control = connect(url, token=token)
        self._control_lock = threading.Lock()
        self._plans: PlanPrefetcher | None = None
        self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"omniscale-commit-{rank}")
        self._commits: deque[Future] = deque()  # sent, not yet known to be acknowledged
        self._unsent: deque[tuple[int, str | None, Future]] = deque()  # for the committer
        self._unsent_lock = threading.Lock()
        self._sending = False  # the committer is draining ``_unsent``

    def _ask(self, call):
        """``call(client)`` on the control client, one call at a time (see ``__init__``)."""
        with self._control_lock:
            return call(self._control)

    # -- the loader's side ----------------------------------------------------------------
    def plans(self, start_step: int, depth: int) -> PlanPrefetcher:
        """This rank's plan source from ``start_step``, ``depth`` plans fetched ahead over the
        plan lane (in process for rank 0 of an embedded plane); one per session. A commit
        acknowledged wakes it when the plane held a plan back for one."""
        if self._plans is not None:
            raise RuntimeError(f"rank {self.rank}: this plane session has a plan source already")
        self._plans = PlanPrefetcher(self.url, self.rank, start_step, depth, self.token)
        return self._plans

    def report(self, step: int, source: str, shard: str, key: str, reason: str, epoch: int
               ) -> SampleRef | None:
        """A planned sample does not decode (the loader's reporter, on its assembly thread):
        the plane quarantines it and hands back a replacement from its source (None: none)."""
        return self._ask(lambda c: c.report_corrupt(step, self.rank, source, shard, key,
                                                    reason, epoch))

    # -- commits --------------------------------------------------------------------------
    def commit(self, step: int, plan_fp: str | None = None) -> Future:
        """Tell the plane this rank trained ``step``, with the fingerprint of the plan it
        trained (``StepBatch.plan_fp``: a plan re-planned since is refused rather than
        silently committed).

        Sent in the background, in step order: the plane makes a commit durable (an fsync)
        before it answers, milliseconds the trainer's next step need not wait on. Commits
        that queue up while one is in flight go together in the next request
        (``commit_many``: one round trip, one fsync). A refused commit is raised by the next
        ``commit``, by :meth:`wait_commits` (call it before a checkpoint: a checkpoint means
        every step before it is committed) or by ``close``. Returns the commit's future (the
        plane's reply: ``committed``, ``next_step``)."""
        self._raise_failed_commit()
        while len(self._commits) >= self._MAX_COMMITS_IN_FLIGHT:  # a plane slower than steps
            self._commits.popleft().result()
        future: Future = Future()
        with self._unsent_lock:
            self._unsent.append((step, plan_fp, future))
            start, self._sending = not self._sending, True
        if start:
            self._committer.submit(self._send_commits)
        if self._plans is not None:
            future.add_done_callback(self._plans.committed)  # the plane may plan further now
        self._commits.append(future)
        return future

    def _send_commits(self) -> None:
        """On the commit thread: send what :meth:`commit` queued, all of it per request,
        until nothing is left."""
        while True:
            with self._unsent_lock:
                batch = list(self._unsent)
                self._unsent.clear()
                if not batch:
                    self._sending = False
                    return
            steps, prints, futures = zip(*batch)
            try:
                if len(batch) == 1:
                    replies = [self._ask(lambda c: c.commit(steps[0], self.rank,
                                                            plan_fp=prints[0]))]
                else:
                    got = self._ask(lambda c: c.commit_many(rank=self.rank, steps=list(steps),
                                                            plan_fps=list(prints)))
                    replies = [{"step": s, "committed": c, "next_step": got["next_step"]}
                               for s, c in zip(steps, got["committed"])]
            except BaseException as e:  # noqa: BLE001 -- raised by the trainer's next commit
                for future in futures:
                    future.set_exception(e)
                continue
            for future, reply in zip(futures, replies):
                future.set_result(reply)

    def wait_commits(self) -> None:
        """Block until every commit sent is acknowledged; raise the first refused one."""
        while self._commits:
            self._commits.popleft().result()

    def _raise_failed_commit(self) -> None:
        while self._commits and self._commits[0].done():
            self._commits.popleft().result()

    # -- the trainer's reports ------------------------------------------------------------
    def report_suspects(self, step: int, batch, reason: str, rank: int) -> None:
        """The guard did not apply ``step``: every rank's samples of it gathered, rank 0
        (global ``rank``) reports them (``guard.report_suspects``; a collective: every rank
        calls it)."""
        from omniscale.tools.train.guard import report_suspects

        report_suspects(self, step, batch, reason, rank)

    def report_suspect(self, step: int, samples: list[dict], reason: str) -> dict:
        return self._ask(lambda c: c.report_suspect(step, samples, reason))

    def refit(self, refit, deterministic: bool) -> dict | None:
        """The cost model refitted and sent (``cost_model.refit_and_send``)."""
        from omniscale.tools.train.cost_model import refit_and_send

        return refit_and_send(refit, self, deterministic)

    def set_costs(self, linear: float, quadratic: float) -> dict:
        return self._ask(lambda c: c.set_costs(linear, quadratic))

    def tell_stragglers(self, tracker, writer: bool) -> None:
        """The stragglers, when they changed (``stragglers.StragglerTracker.tell``)."""
        tracker.tell(self, writer)

    def report_stragglers(self, step: int, ranks: list[int], slowdown: list[float]) -> dict:
        return self._ask(lambda c: c.report_stragglers(step, ranks, slowdown))

    def tell_speeds(self, tracker, writer: bool, deterministic: bool,
                    from_step: int | None = None) -> dict | None:
        """The ranks' speeds, when they changed (``rank_speeds.SpeedTracker.tell``)."""
        return tracker.tell(self, writer, deterministic, from_step)

    def set_speeds(self, step: int, speeds: list[float], from_step: int | None = None) -> dict:
        return self._ask(lambda c: c.set_speeds(step, speeds, from_step))

    def snapshot(self, step: int) -> dict:
        """The plane's snapshot of ``step`` (a checkpoint's; ``{step, path}``)."""
        return self._ask(lambda c: c.snapshot(step))

    def status(self) -> dict:
        return self._ask(lambda c: c.status())

    def ray_namespace(self) -> str | None:
        """The Ray namespace of a plane served as a Ray actor (``plane serve --ray``), else
        None."""
        return self.status().get("ray_namespace")

    def mixture_weights(self) -> dict[str, float]:
        """The mixture weights the plane is drawing with now (ahead of training by up to a
        window of steps)."""
        return {m["source"]: m["weight"] for m in self.status()["mixture"]}

    def write_reports(self, run_dir: Path) -> Path:
        """Every corrupt and suspect report in the plane's log (the ``reports`` action), as
        ``RUN_DIR/data_reports.json`` ``{kind: [records]}``: what the launcher lists after the
        run, asked by rank 0 before its embedded plane stops. A plane that cannot answer
        costs the list, not the run: ``{"error": its one line}``."""
        try:
            found = {kind: self._ask(lambda c, kind=kind: c.reports(kind))
                     for kind in REPORT_KINDS}
        except PlaneError as e:
            found = {"error": str(e).splitlines()[0]}
        path = Path(run_dir) / REPORTS_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(found) + "\n")
        os.replace(tmp, path)
        return path

    # -- the end ----------------------------------------------------------------------------
    def close(self, raise_commit_errors: bool = True) -> None:
        """Wait for the commits sent (a refused one is raised once the rest is closed, unless
        ``raise_commit_errors`` is false), then stop the plan source and the connections."""
        failed = None
        try:
            self.wait_commits()
        except Exception as e:  # noqa: BLE001 -- raised once the session is closed
            failed = e
        self._commits.clear()
        self._committer.shutdown(wait=True)
        if self._plans is not None:
            self._plans.close()
        self._control.close()
        if failed is not None and raise_commit_errors:
            raise failed

    def __enter__(self) -> "PlaneSession":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(raise_commit_errors=exc_type is None)  # never mask the error in flight

    def loader(self, loader_cls, *args, start_step: int = 0, prefetch_steps: int = 2,
               **kwargs) -> "SessionLoader":
        """A ``loader_cls`` (``RankLoader``, ``RayRankLoader``) of this rank from
        ``start_step``, fed by this session's plan source and reporting to it, bound to the
        session (:class:`SessionLoader`: closing it closes the session too)."""
        loader = loader_cls(self.plans(start_step, prefetch_steps), self.report, self.rank,
                            *args, start_step=start_step, prefetch_steps=prefetch_steps,
                            **kwargs)
        return SessionLoader(loader, self)


class SessionLoader:
    """A loader with a plane session of its own, for a rank driven by hand (tools, tests):
    the loader's batches and attributes, and the session's commits -- ``commit(step)`` sends
    the fingerprint of the plan this loader handed out for ``step``."""

    def __init__(self, loader, session: PlaneSession) -> None:
        self.loader, self.session = loader, session
        self._fps: dict[int, str] = {}  # the plans handed out, by step, until committed

    def __getattr__(self, name: str):  # the loader's own (worker_pids, pool_stats, …)
        return getattr(self.loader, name)

    def __iter__(self) -> "SessionLoader":
        return self

    def __next__(self):
        return self._handed_out(next(self.loader))

    def step(self, step: int):
        return self._handed_out(self.loader.step(step))

    def _handed_out(self, batch):
        self._fps[batch.step] = batch.plan_fp
        return batch

    def commit(self, step: int) -> Future:
        return self.session.commit(step, self._fps.pop(step, None))

    def wait_commits(self) -> None:
        self.session.wait_commits()

    def close(self, raise_commit_errors: bool = True) -> None:
        try:
            self.loader.close()
        finally:
            self.session.close(raise_commit_errors)

    def __enter__(self) -> "SessionLoader":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(raise_commit_errors=exc_type is None)


def loader_for(url: str, rank: int, loader_cls, *args, token: str | None = None,
               **kwargs) -> SessionLoader:
    """Rank ``rank``'s loader (``loader_cls``: ``loaders.pipeline.RankLoader``) of the plane at
    ``url``, with a session of its own (:meth:`PlaneSession.loader`)."""
    session = PlaneSession(url, rank, token=token)
    try:
        return session.loader(loader_cls, *args, **kwargs)
    except BaseException:
        session.close(raise_commit_errors=False)
        raise


def ray_loader_for(url: str, rank: int, *args, token: str | None = None,
                   **kwargs) -> SessionLoader:
    """:func:`loader_for` a ``loaders.ray_loaders.RayRankLoader``: its pools named after the
    plane's URL (as every rank of the job names them), planned for the mixture the plane
    draws now (asked of the session)."""
    from omniscale.loaders.ray_loaders import RayRankLoader, pools_name_for

    session = PlaneSession(url, rank, token=token)
    try:
        return session.loader(RayRankLoader, *args, **{
            "pools_name": pools_name_for(url), "mixture": session.mixture_weights, **kwargs})
    except BaseException:
        session.close(raise_commit_errors=False)
        raise
