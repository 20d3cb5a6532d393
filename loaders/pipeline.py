"""The trainer-side data path of one rank: plans in, StepBatches out, ahead of the trainer.

Three stages, each on its own thread so that none waits on another's latency:

1. plans: :class:`loaders.prefetch.PlanPrefetcher` fetches this rank's next plans;
2. decode: workers turn each plan's SampleRefs into decoded samples -- ``torch.utils.data``
   worker processes here (:class:`RankLoader`), Ray actor pools in
   :mod:`loaders.ray_loaders`. Workers are stateless and fetch by reference;
3. assemble: the corrupt-sample policy, SP slicing and packing
   (:mod:`loaders.assemble`), into a queue ``prefetch_steps`` deep.

The trainer's ``next()`` only takes from that queue; the time it blocks is the step's
``data_wait_s``. Committing a step is the trainer's call (:meth:`commit`): the plane must not
hear "trained" from the data path.
"""

from __future__ import annotations

import gc
import queue
import re
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data._utils import signal_handling

from omniscale.dataplane.local import connect
from omniscale.geometry import MediaGeometry
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens
from omniscale.loaders.assemble import (
    DecodedStep,
    StepAssembler,
    StepBatch,
    decode_work,
)
from omniscale.loaders.chunks import plan_chunks
from omniscale.loaders.prefetch import END, PlanPrefetcher
from omniscale.loaders.token_ids import check_tokenizer
from omniscale.loaders.transfer import ShmRing, fork_workers, transfer_bytes, unpack
from omniscale.loaders.worker import RefDataset, TimedDecoder, decoder_spec, identity
from omniscale.refs import SampleRef, table_to_refs

if TYPE_CHECKING:
    from omniscale.loaders.remote_cache import CacheConfig


class StepLoader:
    """What both backends share: plan prefetch, assembly thread, iteration, commit.

    Subclasses implement :meth:`_decoded_steps`, a generator of
    ``(step, plan table, assemble.DecodedStep)`` in step order, run on the assembly thread.

    ``skip_moved_media``: media items the plan has another rank encode are not decoded here
    (``assemble.decode_work``): their embeddings arrive by the reshard, which the omni task's
    step does (``tools.train.media_step``); a consumer of the pixels themselves (the
    video_gen task) keeps the default, every sample whole.
    """

    def __init__(self, plane_url: str, rank: int, sources: dict[str, str | Path],
                 tokenizer_path: str | Path, geometry: MediaGeometry, num_workers: int = 2,
                 prefetch_steps: int = 2, policy: str = "skip", decode_timeout: float = 30.0,
                 token: str | None = None, start_step: int = 0,
                 pin_memory: bool | None = None, skip_moved_media: bool = False,
                 special_tokens: SpecialTokens = DEFAULT_SPECIAL_TOKENS,
                 indexes: dict | None = None, cache: "CacheConfig | None" = None,
                 cache_prefetch_steps: int = 0) -> None:
        self.url, self.rank, self.token = plane_url, int(rank), token
        self.skip_moved_media = skip_moved_media
        self.geometry = geometry
        self.num_workers, self.decode_timeout = int(num_workers), decode_timeout
        # the index's token ids must be this tokenizer's, its markers these
        check_tokenizer(indexes or sources, tokenizer_path, special_tokens)
        self.spec = decoder_spec(sources, tokenizer_path, geometry, special=special_tokens,
                                 indexes=indexes, cache=cache)
        # Remote sources with a cache: the plans of the next steps warm it before workers
        # read (the plane knows them; no per-rank streaming loader can).
        remote = {name: loc for name, loc in self.spec.sources.items() if not loc.is_local}
        self.shard_prefetcher = None
        if cache is not None and remote and cache_prefetch_steps > 0:
            from omniscale.loaders.remote_cache import Prefetcher

            self.shard_prefetcher = Prefetcher(remote, cache)
        # In-process when this process serves the plane (rank 0 of an embedded one).
        self.client = connect(plane_url, token=token)
        self._report_client = connect(plane_url, token=token)  # used by the assembly thread
        self._commit_client = connect(plane_url, token=token)  # used by the commit thread
        self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"omniscale-commit-{rank}")
        self._commits: deque[Future] = deque()  # sent, not yet known to be acknowledged
        self._unsent: deque[tuple[int, str | None, Future]] = deque()  # for the committer
        self._unsent_lock = threading.Lock()
        self._sending = False  # the committer is draining ``_unsent``
        self._local = TimedDecoder(self.spec, decode_timeout)  # replacements, on that thread
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.assembler = StepAssembler(self.rank, geometry, policy, self._report,
                                       self._local.decode, pin_memory=pin)
        self._stop = threading.Event()
        ahead = cache_prefetch_steps if self.shard_prefetcher is not None else 0
        self.plans = PlanPrefetcher(plane_url, self.rank, start_step, prefetch_steps + ahead,
                                    token, self._stop, on_plan=self._prefetch_shards)
        self._out: queue.Queue = queue.Queue(maxsize=prefetch_steps)
        self._fps: dict[int, str] = {}
        self.next_step = start_step
        self.data_wait_s = 0.0
        self.samples = self.tokens = 0
        self._thread: threading.Thread | None = None

    # -- the trainer's side ---------------------------------------------------------------
    def __iter__(self) -> "StepLoader":
        return self

    def __next__(self) -> StepBatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._assemble_loop, daemon=True,
                                            name=f"omniscale-loader-{self.rank}")
            self._thread.start()
        start = time.perf_counter()
        item = self._out.get()
        wait = time.perf_counter() - start
        if item is END:
            self._out.put(END)  # later calls end too
            raise StopIteration
        if isinstance(item, BaseException):
            self._out.put(item)
            raise item
        item.data_wait_s = wait
        self.data_wait_s += wait
        self.samples += item.num_samples
        self.tokens += item.num_tokens
        self._fps[item.step] = item.plan_fp
        self.next_step = item.step + 1
        return item

    def step(self, step: int) -> StepBatch:
        """The batch of ``step``; steps come in order, so earlier ones are passed over."""
        if step < self.next_step:
            raise ValueError(f"step {step}: this loader is at step {self.next_step} (steps "
                             "come in order; start a new loader to go back)")
        for batch in self:
            if batch.step == step:
                return batch
        raise StopIteration(f"step {step}: the mixture ended before it")

    _MAX_COMMITS_IN_FLIGHT = 8

    def commit(self, step: int) -> Future:
        """Tell the plane this rank trained ``step``, with the fingerprint of the plan it
        trained (so a plan re-planned since is refused rather than silently committed).

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
            self._unsent.append((step, self._fps.pop(step, None), future))
            start, self._sending = not self._sending, True
        if start:
            self._committer.submit(self._send_commits)
        future.add_done_callback(self.plans.committed)  # the plane may plan further now
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
                    replies = [self._commit_client.commit(steps[0], self.rank,
                                                          plan_fp=prints[0])]
                else:
                    got = self._commit_client.commit_many(list(steps), self.rank,
                                                          list(prints))
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

    @property
    def corrupt_reasons(self):
        return self.assembler.corrupt_reasons

    def _prefetch_shards(self, table) -> None:
        """On the plan thread, as each plan arrives: its remote samples' bytes into the
        cache (non-blocking; the prefetcher's threads fetch)."""
        if self.shard_prefetcher is not None:
            refs = [r for r in table_to_refs(table) if r.source in self.shard_prefetcher.sources]
            self.shard_prefetcher.submit(refs)

    def close(self, raise_commit_errors: bool = True) -> None:
        """Stop the threads and workers; commits already sent are waited for first (a refused
        one is raised after the rest is closed, unless ``raise_commit_errors`` is false)."""
        failed = None
        try:
            self.wait_commits()
        except Exception as e:  # noqa: BLE001 -- raised once the loader is closed
            failed = e
        self._commits.clear()
        self._committer.shutdown(wait=True)
        self._stop.set()
        self.plans.close()
        if self.shard_prefetcher is not None:
            self.shard_prefetcher.close()
        while self._thread is not None and self._thread.is_alive():
            try:  # unblock an assembly thread waiting to hand over a batch
                self._out.get(timeout=0.1)
            except queue.Empty:
                pass
        self._local.close()
        self.client.close()
        self._report_client.close()
        self._commit_client.close()
        if failed is not None and raise_commit_errors:
            raise failed

    def __enter__(self) -> "StepLoader":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(raise_commit_errors=exc_type is None)  # never mask the error in flight

    # -- the assembly thread ----------------------------------------------------------------
    def _report(self, step: int, source: str, shard: str, key: str, reason: str, epoch: int
                ) -> SampleRef | None:
        return self._report_client.report_corrupt(step, self.rank, source, shard, key, reason,
                                                  epoch)

    def _assemble_loop(self) -> None:
        try:
            for step, table, decoded in self._decoded_steps():
                batch = self.assembler.assemble(step, table, decoded)
                if not self._put(batch):
                    return
            self._put(END)
        except BaseException as e:  # noqa: BLE001 -- handed to the trainer's next()
            self._put(e)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._out.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _decoded_steps(self):
        raise NotImplementedError

    def _work(self, table) -> list:
        """A plan's decode work: ``(ref, DecodeNeed | None)`` per distinct sample."""
        return decode_work(table, self.rank if self.skip_moved_media else None)


class RankLoader(StepLoader):
    """The default backend: ``torch.utils.data`` worker processes decode by reference.

    The DataLoader's sampler is fed from the plan queue: each plan becomes work items of a
    micro-batch each (``loaders.chunks``: the worker decodes its samples and packs it; one
    dummy item for an empty plan), so workers run ahead across step boundaries and hand a
    micro-batch over in one piece (:func:`loaders.transfer.pack`). Results come back in order;
    a step is complete after its item count.

    A worker that dies (``kill -9``, the OOM killer) is replaced: the whole DataLoader is,
    since its queues may be left locked by the dead process. The new one's sampler first
    replays every plan the old one had pulled -- the step being assembled (decoded again from
    scratch, its partial results dropped), then the queued ones, in order -- and goes on from
    the plan prefetcher. Decoding is by reference and pure, so the StepBatches are exactly
    those of a run without the death. Each restart is counted in :attr:`worker_restarts` and
    warned about; the ``max_worker_restarts + 1``-th death in a row while on the same step
    (a sample that kills its decoder every time) ends the loader with an error.

    Worker deaths are noticed by polling (the DataLoader waits ``_POLL_S`` at a time); its
    SIGCHLD handler, which would raise in the main thread wherever the trainer happens to
    be, is kept off these workers. ``2 * decode_timeout + 60`` seconds without a result is
    only a backstop behind the per-sample watchdog.
    """

    _POLL_S = 1.0
    # Items each worker may hold decoded ahead (torch's prefetch_factor; its default is 2).
    # 4 keeps a worker decoding while the trainer drains a long video item (measured: mixed
    # and video +5-13%, text and image unchanged), and matches the ring's 4 slots a worker.
    _ITEMS_AHEAD = 4

    def __init__(self, *args, max_worker_restarts: int = 3, **kwargs) -> None:
        if max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts: must be >= 0, got {max_worker_restarts}")
        super().__init__(*args, **kwargs)
        self.max_worker_restarts = int(max_worker_restarts)
        self.worker_restarts = 0
        self._it = None  # the current DataLoader iterator (the assembly thread's)
        self._ring: ShmRing | None = None  # its workers' slots (``loaders.transfer``)

    def worker_pids(self) -> list[int]:
        """The pids of the current DataLoader's worker processes (empty before the first
        ``next()`` and with ``num_workers=0``); they change when dead workers are replaced."""
        it = self._it
        return [w.pid for w in getattr(it, "_workers", ())]

    def _decoded_steps(self):
        steps: deque = deque()  # (step, table, items), END, or an exception: sampler order
        sampler = _PlanItems(self.plans, steps, self._chunks, blocking=not self.num_workers)
        it = self._start(sampler)
        first = None
        redo_step, in_a_row = None, 0  # worker deaths in a row while on one step
        try:
            while not self._stop.is_set():
                if self.num_workers:
                    _feed(it, sampler)
                elif not steps:  # no worker processes: the sampler runs inside next()
                    first = next(it, None)
                if not steps:  # closing
                    return
                head = steps.popleft()
                if head is END:
                    return
                if isinstance(head, BaseException):
                    raise head
                step, table, count = head
                decoded = DecodedStep({})
                try:
                    for _ in range(count):
                        if first is not None:
                            got, first = first, None
                        else:
                            if self.num_workers:
                                _feed(it, sampler)
                            got = self._next_item(it)
                            if got is None:  # closing
                                return
                        decoded.transfer_bytes += transfer_bytes(got[1])
                        decoded.update(unpack(got[1]))
                except _WorkerDied as e:
                    pids = e.pids
                    in_a_row = in_a_row + 1 if step == redo_step else 1
                    redo_step = step
                    if in_a_row > self.max_worker_restarts:
                        raise RuntimeError(
                            f"rank {self.rank}: DataLoader worker (pid {pids}) died while on "
                            f"step {step}, {in_a_row} times in a row; giving up (a sample of "
                            f"this step or the next may kill its decoder every time)") from e
                    replay = [head, *steps]  # every plan the dead DataLoader pulled, in order
                    self._shutdown(it)
                    self.worker_restarts += 1
                    warnings.warn(f"rank {self.rank}: DataLoader worker (pid {pids}) died; "
                                  f"new workers decode again from step {step} (restart "
                                  f"{self.worker_restarts})", RuntimeWarning, stacklevel=2)
                    steps = deque()
                    sampler = _PlanItems(self.plans, steps, self._chunks, replay,
                                         blocking=not self.num_workers)
                    it = self._start(sampler)
                    continue
                yield step, table, decoded
        finally:
            self._it = None
            self._shutdown(it)

    def _chunks(self, table) -> list:
        """A plan's work items (``loaders.chunks.plan_chunks``: a micro-batch each, built in
        the worker); ``[None]`` for a plan with nothing to decode (its step still passes
        through)."""
        rank = self.rank if self.skip_moved_media else None
        return plan_chunks(table, rank, encode_parts=max(1, self.num_workers)) or [None]

    def _start(self, sampler: "_PlanItems"):
        """A DataLoader over ``sampler``, iterating: forks the workers, which start on the
        first items at once."""
        # Workers hand items over through slots mapped once (``loaders.transfer``).
        self._ring = ShmRing(self.num_workers) if self.num_workers and fork_workers() else None
        loader = torch.utils.data.DataLoader(
            RefDataset(self.spec, self.decode_timeout, self.geometry, self._ring),
            batch_size=None,
            sampler=sampler,
            num_workers=self.num_workers, collate_fn=identity, pin_memory=False,
            timeout=self._POLL_S if self.num_workers else 0,
            prefetch_factor=self._ITEMS_AHEAD if self.num_workers else None)
        try:
            it = _forked(loader)
        except BaseException:
            self._shutdown(None)  # the ring, mapped for workers that did not start
            raise
        if getattr(it, "_worker_pids_set", False):
            # Off torch's SIGCHLD handler (set by any DataLoader iterated on the main thread):
            # it would raise this death in the main thread; _next_item notices it here.
            signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        self._it = it
        return it

    def _shutdown(self, it) -> None:
        """Stop ``it``'s workers, then unmap the ring they handed items over in."""
        _shutdown(it)
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def _next_item(self, it):
        """The next decoded item, waiting ``_POLL_S`` at a time; None once the loader is
        closing. A dead worker raises :class:`_WorkerDied`: torch names it when a wait times
        out; a worker killed while handing a result over (its tensors' file descriptors) makes
        the receive fail with a connection error first, then the worker's exit decides."""
        backstop = 2 * self.decode_timeout + 60 if self.decode_timeout else None
        waited = 0.0
        while True:
            try:
                return next(it)
            except RuntimeError as e:
                pids = _dead_workers(e)
                if pids is not None:
                    raise _WorkerDied(pids) from e
                if not self.num_workers or not str(e).startswith("DataLoader timed out"):
                    raise
            except (OSError, EOFError) as e:
                pids = _exited_workers(it, self._POLL_S * 5)
                if not pids:
                    raise
                raise _WorkerDied(pids) from e
            if self._stop.is_set():
                return None
            waited += self._POLL_S
            if backstop is not None and waited >= backstop:
                raise RuntimeError(f"rank {self.rank}: DataLoader timed out after "
                                   f"{backstop:g} seconds")


class _WorkerDied(Exception):
    """A worker process of the current DataLoader died (``pids``: torch's or our listing)."""

    def __init__(self, pids: str) -> None:
        super().__init__(f"DataLoader worker (pid {pids}) died")
        self.pids = pids


_DEAD_WORKER = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([0-9, ]+)\) "
                          r"(?:exited unexpectedly|is killed by signal)")


def _dead_workers(e: BaseException) -> str | None:
    """The pid(s) torch names in a "DataLoader worker ... exited unexpectedly / is killed by
    signal" RuntimeError; None for any other error."""
    m = _DEAD_WORKER.search(str(e))
    return m.group(1) if m else None


def _exited_workers(it, timeout: float) -> str:
    """The pids of ``it``'s workers that have exited or exit within ``timeout`` seconds (a
    process killed closes its sockets just before it can be waited for); "" if none."""
    workers = [w for w in getattr(it, "_workers", ()) if w.pid is not None]
    ready = mp_connection.wait([w.sentinel for w in workers], timeout) if workers else []
    return ", ".join(str(w.pid) for w in workers if w.sentinel in ready)


def _forked(loader: torch.utils.data.DataLoader):
    """``iter(loader)`` -- which forks its workers -- with this process's objects kept out of
    the workers' garbage collector. A forked worker that collects garbage it inherited (a
    closed plane client, a stopped embedded plane: Arrow Flight / gRPC objects whose threads
    did not survive the fork) can crash with SIGSEGV; frozen objects are never collected."""
    if not loader.num_workers:
        return iter(loader)
    gc.collect()  # the garbage is freed here, where its threads still run
    ours = gc.get_freeze_count() == 0  # leave anyone else's freeze as it is
    gc.freeze()
    try:
        return iter(loader)
    finally:
        if ours:
            gc.unfreeze()


def _feed(it, sampler: "_PlanItems") -> None:
    """Hand the DataLoader's workers the items that are ready, up to torch's limit; wait for
    a plan first only when the loader holds nothing sent and not yet returned (so no commit
    the plane waits for is held here). Uses the iterator's own bookkeeping, which
    ``_try_put_index`` keeps."""
    if it._rcvd_idx >= it._send_idx:
        sampler.wait()
    # torch's own bound: items sent and not yet returned (received out of order included)
    limit = it._prefetch_factor * it._num_workers
    while it._send_idx - it._rcvd_idx < limit and sampler.ready():
        it._try_put_index()


def _shutdown(it) -> None:
    """Stop a DataLoader iterator's workers now (not whenever it is garbage-collected)."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()


class _PlanItems:
    """The sampler: work items ``((step, i), chunk)`` of each plan (``chunks``: the loader's
    cut of a plan), recording each step's item count in ``steps`` before its first item
    leaves (the consumer reads counts from there). ``replay``: entries of ``steps`` a
    replaced DataLoader had pulled, sent again first.

    ``blocking=False`` (worker processes): with no plan ready it raises StopIteration at once and
    is asked again later -- torch asks for indices while it hands an item over (and for
    ``prefetch_factor * workers`` of them before its iterator exists), and the plane plans a
    step only so far past the last commit: waiting there for a plan that needs the commit of
    the very item in hand would hang. The loader waits for plans itself (:meth:`wait`),
    only when it holds nothing. ``blocking=True`` (no workers): one index per item, waited for."""

    def __init__(self, plans: PlanPrefetcher, steps: deque, chunks, replay: list | None = None,
                 blocking: bool = True) -> None:
        self.plans, self.steps, self.chunks = plans, steps, chunks
        self.replay = deque(replay or ())
        self.blocking = blocking
        self.pending: deque = deque()  # items of plans pulled, not handed out yet
        self.ended = False  # END or an error recorded in ``steps``: nothing more

    def __iter__(self):
        return self

    def __next__(self):
        while not self.pending:
            if self.ended or not self._pull(self.blocking):
                raise StopIteration
        return self.pending.popleft()

    def ready(self) -> bool:
        """An item can be handed out now (pulls a plan that is ready without waiting)."""
        return bool(self.pending) or (not self.ended and self._pull(False)
                                      and bool(self.pending))

    def wait(self) -> None:
        """Wait until an item can be handed out or nothing more will come."""
        while not self.pending and not self.ended:
            self._pull(True)

    def _pull(self, block: bool) -> bool:
        """The next plan's items into ``pending``; False when none is ready (not blocking)."""
        if self.replay:
            entry = self.replay.popleft()
        else:
            try:
                got = self.plans.get() if block else self.plans.poll()
            except BaseException as e:  # noqa: BLE001 -- the consumer raises it in order
                got = e
            if got is None:
                return False
            entry = got  # (step, table), END or an error
        if entry is END or isinstance(entry, BaseException):
            self.steps.append(entry)
            self.ended = True
            return True
        step, table = entry[0], entry[1]  # a replayed entry also carries its old count
        chunks = self.chunks(table)
        self.steps.append((step, table, len(chunks)))
        self.pending.extend(_items(step, chunks))
        return True


def _items(step: int, work: list):
    for i, item in enumerate(work):
        yield (step, i), item
