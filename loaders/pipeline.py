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

import queue
import threading
import time
from collections import deque
from pathlib import Path

import torch

from dataplane.client import PlaneClient
from dataplane.refs import SampleRef
from loaders.assemble import StepAssembler, StepBatch, sample_id, unique_refs
from loaders.geometry import MediaGeometry
from loaders.prefetch import END, PlanPrefetcher
from loaders.worker import Decoded, RefDataset, TimedDecoder, decoder_spec, identity


class StepLoader:
    """What both backends share: plan prefetch, assembly thread, iteration, commit.

    Subclasses implement :meth:`_decoded_steps`, a generator of
    ``(step, plan table, {sample uid: Decoded})`` in step order, run on the assembly thread.
    """

    def __init__(self, plane_url: str, rank: int, sources: dict[str, str | Path],
                 tokenizer_path: str | Path, geometry: MediaGeometry, num_workers: int = 2,
                 prefetch_steps: int = 2, policy: str = "skip", decode_timeout: float = 30.0,
                 token: str | None = None, start_step: int = 0,
                 pin_memory: bool | None = None) -> None:
        self.url, self.rank, self.token = plane_url, int(rank), token
        self.geometry = geometry
        self.num_workers, self.decode_timeout = int(num_workers), decode_timeout
        self.spec = decoder_spec(sources, tokenizer_path, geometry)
        self.client = PlaneClient(plane_url, token=token)
        self._report_client = PlaneClient(plane_url, token=token)  # used by the assembly thread
        self._local = TimedDecoder(self.spec, decode_timeout)  # replacements, on that thread
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.assembler = StepAssembler(self.rank, geometry, policy, self._report,
                                       self._local.decode, pin_memory=pin)
        self._stop = threading.Event()
        self.plans = PlanPrefetcher(plane_url, self.rank, start_step, prefetch_steps, token,
                                    self._stop)
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

    def commit(self, step: int) -> dict:
        """Tell the plane this rank trained ``step``, with the fingerprint of the plan it
        trained (so a plan re-planned since is refused rather than silently committed)."""
        return self.client.commit(step, self.rank, plan_fp=self._fps.pop(step, None))

    @property
    def corrupt_reasons(self):
        return self.assembler.corrupt_reasons

    def close(self) -> None:
        self._stop.set()
        self.plans.close()
        while self._thread is not None and self._thread.is_alive():
            try:  # unblock an assembly thread waiting to hand over a batch
                self._out.get(timeout=0.1)
            except queue.Empty:
                pass
        self._local.close()
        self.client.close()
        self._report_client.close()

    def __enter__(self) -> "StepLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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


class RankLoader(StepLoader):
    """The default backend: ``torch.utils.data`` worker processes decode by reference.

    The DataLoader's sampler is fed from the plan queue: each plan becomes one work item per
    distinct sample (one dummy item for an empty plan), so workers run ahead across step
    boundaries. Results come back in order; a step is complete after its item count.
    ``timeout`` on the DataLoader is only a backstop behind the per-sample watchdog.
    """

    def _decoded_steps(self):
        steps: deque = deque()  # (step, table, items), END, or an exception: sampler order
        loader = torch.utils.data.DataLoader(
            RefDataset(self.spec, self.decode_timeout), batch_size=None,
            sampler=_PlanItems(self.plans, steps), num_workers=self.num_workers,
            collate_fn=identity, pin_memory=False,
            timeout=(2 * self.decode_timeout + 60) if self.num_workers else 0,
            prefetch_factor=2 if self.num_workers else None)
        it = iter(loader)  # forks the workers, which start on the first items at once
        first = None
        while not self._stop.is_set():
            if not steps:  # no worker processes: the sampler runs inside next()
                first = next(it, None)
            head = steps.popleft()
            if head is END:
                return
            if isinstance(head, BaseException):
                raise head
            step, table, count = head
            decoded: dict[tuple, Decoded] = {}
            for _ in range(count):
                _, out = first if first is not None else next(it)
                first = None
                if out.ref is not None:
                    decoded[sample_id(out.ref)] = out
            yield step, table, decoded


class _PlanItems:
    """The sampler: work items ``((step, i), ref)`` of each plan, recording each step's item
    count in ``steps`` before its first item leaves (the consumer reads counts from there)."""

    def __init__(self, plans: PlanPrefetcher, steps: deque) -> None:
        self.plans, self.steps = plans, steps

    def __iter__(self):
        while True:
            try:
                got = self.plans.get()
            except BaseException as e:  # noqa: BLE001 -- the consumer raises it in order
                self.steps.append(e)
                return
            if got is END:
                self.steps.append(END)
                return
            step, table = got
            refs = unique_refs(table) or [None]
            self.steps.append((step, table, len(refs)))
            for i, ref in enumerate(refs):
                yield (step, i), ref
