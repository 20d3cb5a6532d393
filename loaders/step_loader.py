"""What every backend of a rank's loader shares: plans in, StepBatches out, ahead of the
trainer, and the trainer's commits back to the plane.

Three stages, each on its own thread so that none waits on another's latency:

1. plans: :class:`loaders.prefetch.PlanPrefetcher` fetches this rank's next plans;
2. decode: workers turn each plan's SampleRefs into decoded samples -- the loader's own
   worker processes (:class:`loaders.pipeline.RankLoader`, ``loaders.worker_pool``), Ray
   actor pools in :mod:`loaders.ray_loaders`. Workers are stateless and fetch by reference;
3. assemble: the corrupt-sample policy, SP slicing and packing
   (:mod:`loaders.assemble`), into a queue ``prefetch_steps`` deep.

The trainer's ``next()`` only takes from that queue; the time it blocks is the step's
``data_wait_s``. Committing a step is the trainer's call (:meth:`StepLoader.commit`): the
plane must not hear "trained" from the data path.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omniscale.dataplane.local import connect
from omniscale.geometry import MediaGeometry
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens
from omniscale.loaders.assemble import StepAssembler, StepBatch, decode_work
from omniscale.loaders.prefetch import END, PlanPrefetcher
from omniscale.loaders.token_ids import check_tokenizer
from omniscale.loaders.worker import TimedDecoder, decoder_spec
from omniscale.plan import RankPlan
from omniscale.refs import SampleRef

if TYPE_CHECKING:
    from omniscale.loaders.remote_cache import CacheConfig


class StepLoader:
    """What both backends share: plan prefetch, assembly thread, iteration, commit.

    Subclasses implement :meth:`_decoded_steps`, a generator of
    ``(step, plan, assemble.DecodedStep)`` in step order, run on the assembly thread.

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
                    got = self._commit_client.commit_many(rank=self.rank, steps=list(steps),
                                                          plan_fps=list(prints))
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

    def _prefetch_shards(self, plan: RankPlan) -> None:
        """On the plan thread, as each plan arrives: its remote samples' bytes into the
        cache (non-blocking; the prefetcher's threads fetch)."""
        if self.shard_prefetcher is not None:
            refs = [r for r in plan.refs if r.source in self.shard_prefetcher.sources]
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
            for step, plan, decoded in self._decoded_steps():
                batch = self.assembler.assemble(step, plan, decoded)
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

    def _work(self, plan) -> list:
        """A plan's decode work: ``(ref, DecodeNeed | None)`` per distinct sample."""
        return decode_work(plan, self.rank if self.skip_moved_media else None)
