"""What every backend of a rank's loader shares: plans in, StepBatches out, ahead of the
trainer.

A loader is given a plan source (:class:`loaders.prefetch.PlanSource`) and a reporter of
corrupt samples, and nothing else of the plane: the rank's plane session
(``tools.train.plane_session``) holds every conversation with it, commits included.

Three stages, each on its own thread so that none waits on another's latency:

1. plans: the plan source (the session's :class:`loaders.prefetch.PlanPrefetcher`) fetches
   this rank's next plans;
2. decode: workers turn each plan's SampleRefs into decoded samples -- the loader's own
   worker processes (:class:`loaders.pipeline.RankLoader`, ``loaders.worker_pool``), Ray
   actor pools in :mod:`loaders.ray_loaders`. Workers are stateless and fetch by reference;
3. assemble: the corrupt-sample policy, SP slicing and packing
   (:mod:`loaders.assemble`), into a queue ``prefetch_steps`` deep.

The trainer's ``next()`` only takes from that queue; the time it blocks is the step's
``data_wait_s``. Committing a step is the trainer's call, through its plane session: the
plane must not hear "trained" from the data path.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from omniscale.geometry import MediaGeometry
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens
from omniscale.loaders.assemble import StepAssembler, StepBatch, decode_work
from omniscale.loaders.prefetch import END, PlanSource, WarmAhead
from omniscale.loaders.token_ids import check_tokenizer
from omniscale.loaders.worker import TimedDecoder, decoder_spec
from omniscale.plan import RankPlan
from omniscale.refs import SampleRef

if TYPE_CHECKING:
    from omniscale.loaders.block_cache import CacheConfig


class StepLoader:
    """What both backends share: plans taken from ``plans``, the assembly thread, iteration.

    ``report(step, source, shard, key, reason, epoch)``: tells the plane a planned sample does
    not decode and returns its replacement (a SampleRef, or None); called on the assembly
    thread. The loader closes ``plans`` when it closes.

    Subclasses implement :meth:`_decoded_steps`, a generator of
    ``(step, plan, assemble.DecodedStep)`` in step order, run on the assembly thread.

    ``skip_moved_media``: media items the plan has another rank encode are not decoded here
    (``assemble.decode_work``): their embeddings arrive by the reshard, which the omni task's
    step does (``tools.train.media_step``); a consumer of the pixels themselves (the
    video_gen task) keeps the default, every sample whole.
    """

    def __init__(self, plans: PlanSource, report: Callable[..., SampleRef | None], rank: int,
                 sources: dict[str, str | Path], tokenizer_path: str | Path,
                 geometry: MediaGeometry, num_workers: int = 2, prefetch_steps: int = 2,
                 policy: str = "skip", decode_timeout: float = 30.0, start_step: int = 0,
                 pin_memory: bool | None = None, skip_moved_media: bool = False,
                 special_tokens: SpecialTokens = DEFAULT_SPECIAL_TOKENS,
                 indexes: dict | None = None, cache: "CacheConfig | None" = None,
                 cache_prefetch_steps: int = 0) -> None:
        self.rank = int(rank)
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
        self._local = TimedDecoder(self.spec, decode_timeout)  # replacements, on that thread
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.assembler = StepAssembler(self.rank, geometry, policy, report,
                                       self._local.decode, pin_memory=pin)
        self._stop = threading.Event()
        self.plans = plans if self.shard_prefetcher is None else \
            WarmAhead(plans, cache_prefetch_steps, self._prefetch_shards)
        self._out: queue.Queue = queue.Queue(maxsize=prefetch_steps)
        self.next_step = start_step
        self.generation = 0  # plans of an older one are of steps re-planned since: dropped
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
        while isinstance(item, StepBatch) and self._stale(item.plan):
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

    def replan_from(self, step: int) -> None:
        """The plane re-planned ``step`` (the next this loader hands out) and every later
        step, after this loader fetched some of them (``DataPlane.set_speeds`` with
        ``from_step``: a slowed rank's speeds applied at once). What was fetched, decoded or
        assembled of those steps is dropped as it comes out of the pipeline, and their plans
        are fetched again; the workers keep running."""
        if step != self.next_step:
            raise ValueError(f"replan_from({step}): this loader hands out step "
                             f"{self.next_step} next (only the steps not handed out can be "
                             "re-planned)")
        self.generation = self.plans.restart(step)

    def _stale(self, plan: RankPlan | None) -> bool:
        return plan is not None and plan.generation < self.generation

    @property
    def corrupt_reasons(self):
        return self.assembler.corrupt_reasons

    def _prefetch_shards(self, plan: RankPlan) -> None:
        """As each plan is taken, ``cache_prefetch_steps`` ahead of its turn: its remote
        samples' bytes into the cache (non-blocking; the prefetcher's threads fetch)."""
        if self.shard_prefetcher is not None:
            refs = [r for r in plan.refs if r.source in self.shard_prefetcher.sources]
            self.shard_prefetcher.submit(refs)

    def close(self) -> None:
        """Stop the threads, the workers and the plan source."""
        self._stop.set()
        self._interrupt()
        self.plans.close()
        if self.shard_prefetcher is not None:
            self.shard_prefetcher.close()
        while self._thread is not None and self._thread.is_alive():
            try:  # unblock an assembly thread waiting to hand over a batch
                self._out.get(timeout=0.1)
            except queue.Empty:
                pass
        self._local.close()

    def _interrupt(self) -> None:
        """Wake the assembly thread where it waits for decoded results (a backend's pool),
        so that close does not wait out a poll."""

    def __enter__(self) -> "StepLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the assembly thread ----------------------------------------------------------------
    def _assemble_loop(self) -> None:
        try:
            for step, plan, decoded in self._decoded_steps():
                if self._stale(plan):  # its step was re-planned since it was fetched
                    continue
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
