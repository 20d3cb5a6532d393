"""What a stateless loader worker does: decode one SampleRef, bounded in time, never raising.

A worker (a process of the loader's pool, ``loaders.worker_pool``, or a Ray actor) holds one
:class:`TimedDecoder`: a SampleDecoder (its reader keeps a bounded LRU of open shards, so its
memory does not grow with the number of sources) run under a watchdog. Decoding happens on a
helper thread, handed a work item's samples at once; the worker watches, allowing each sample
``timeout`` seconds. On a timeout the thread and its decoder are abandoned (a hung C call
cannot be interrupted, and the reader it holds is not thread-safe) and a fresh decoder takes
over, so one pathological file costs one timeout, not a worker.

A work item's samples are read together first (``SampleReader.read_many``: a remote
source's ranges coalesced and fetched at once), then decoded one by one. The read is watched
too, allowed a sample's timeout per sample it reads.

Failures come back as data (:class:`Decoded` with ``error``), not exceptions: a worker's
exception would end the loader, and the trainer side decides the policy.

What the reader did for a call -- requests to the store, bytes, retries, cache hits and
misses (``remote_io.READ_STATS``) -- comes back with it: ``decode_all`` returns a
:class:`DecodedList` whose ``io`` holds the counts of that call, and a worker's
``DecodedStep`` carries the sum over its chunk as ``io``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from omniscale.geometry import MediaGeometry
from omniscale.layout import DEFAULT_SPECIAL_TOKENS, SpecialTokens
from omniscale.loaders.block_cache import CacheConfig
from omniscale.loaders.decode import DecodeNeed, SampleDecoder
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.readers import SampleReader
from omniscale.loaders.remote_io import RemoteSettings, add_stats, stats_delta
from omniscale.loaders.sequence import DecodedSample
from omniscale.loaders.token_ids import TokenIds
from omniscale.location import Location
from omniscale.refs import SampleRef


@dataclass
class Decoded:
    """One ref's outcome: the sample, or ``error`` (a CorruptSample naming source and key)."""

    ref: SampleRef | None
    sample: DecodedSample | None = None
    error: CorruptSample | None = None


class DecodedList(list):
    """What :meth:`TimedDecoder.decode_all` returns: a list of :class:`Decoded`, plus ``io``,
    the reader's counters for the call (``remote_io.READ_STATS``; empty when nothing was
    counted)."""

    def __init__(self, items=(), io: dict[str, int] | None = None) -> None:
        super().__init__(items)
        self.io = dict(io or {})


@dataclass(frozen=True)
class DecoderSpec:
    """Everything a worker needs to build its decoder: small and picklable.

    ``sources``: where each source's shards are; ``indexes``: where its index is (for the
    token ids; None: beside the shards); ``cache``: the node's block cache for remote shards;
    ``remote``: how remote reads are batched and retried (None: the defaults).
    """

    sources: dict[str, Location]
    tokenizer: str
    geometry: MediaGeometry
    max_open: int = 16
    special: SpecialTokens = DEFAULT_SPECIAL_TOKENS  # the tokenizer's pad, eos and markers
    indexes: dict[str, Location] | None = None
    cache: CacheConfig | None = None
    remote: RemoteSettings | None = None

    def build(self) -> SampleDecoder:
        reader = SampleReader(self.sources, max_open=self.max_open, remote=self.remote,
                              cache=self.cache)
        return SampleDecoder(reader, self.tokenizer, self.geometry,
                             TokenIds(self.indexes or self.sources), self.special)


def decoder_spec(sources: dict, tokenizer: str | Path, geometry: MediaGeometry,
                 max_open: int = 16, special: SpecialTokens = DEFAULT_SPECIAL_TOKENS, *,
                 indexes: dict | None = None, cache: CacheConfig | None = None,
                 remote: RemoteSettings | None = None) -> DecoderSpec:
    """A DecoderSpec; sources and indexes may be paths, URLs or Locations."""
    return DecoderSpec({str(k): Location.of(v) for k, v in sources.items()}, str(tokenizer),
                       geometry, max_open, special,
                       {str(k): Location.of(v) for k, v in indexes.items()}
                       if indexes is not None else None, cache, remote)


class TimedDecoder:
    """Decodes refs with a per-sample deadline; a timeout is a CorruptSample like any other.

    One hand-off per call, not per sample: :meth:`decode_all` gives a whole list to the decode
    thread, which reads it at once, then decodes it in order and stamps when each sample
    started; the calling thread is the watchdog, asleep until the list is done or the current
    deadline passes (the read's: a sample's timeout per sample read; then each sample's).
    """

    def __init__(self, spec: DecoderSpec, timeout: float | None = 30.0) -> None:
        self.spec, self.timeout = spec, timeout
        self._decoder: SampleDecoder | None = None
        self._jobs: queue.Queue | None = None
        self.timeouts = 0
        self.io: dict[str, int] = {}  # the reader counters of every call so far, summed

    def decode(self, ref: SampleRef | None, need: DecodeNeed | None = None) -> Decoded:
        if ref is None:  # a step with nothing to decode still sends one item through
            return Decoded(None)
        return self.decode_all([(ref, need)])[0]

    def decode_all(self, work: list[tuple[SampleRef, DecodeNeed | None]]) -> DecodedList:
        """Every ``(ref, need)`` of ``work`` decoded, in order; a sample past its deadline
        comes back timed out and the rest go on with a fresh decoder. ``io`` on the result:
        what the reads cost."""
        if self.timeout is None:
            decoder = self._current()
            before = _reader_stats(decoder)
            outs = _decode_list(decoder, work)
            io = stats_delta(_reader_stats(decoder), before)
        else:
            outs, io = [], {}
            while len(outs) < len(work):
                got, used = self._watched(work[len(outs):])
                outs += got
                add_stats(io, used)
        add_stats(self.io, io)
        return DecodedList(outs, io)

    def _current(self) -> SampleDecoder:
        if self._decoder is None:
            self._decoder = self.spec.build()
        return self._decoder

    def _watched(self, work: list) -> tuple[list[Decoded], dict[str, int]]:
        """What the decode thread finished of ``work`` -- all of it, or the samples before
        the one that ran past its deadline and that one timed out -- and the reader's
        counters meanwhile."""
        if self._jobs is None:
            self._jobs = queue.Queue()
            threading.Thread(target=_serve, args=(self._current(), self._jobs), daemon=True,
                             name="omniscale-decode").start()
        decoder = self._current()
        job = _Job(work, self.timeout)
        before = _reader_stats(decoder)
        self._jobs.put(job)
        with job.lock:
            while len(job.outs) < len(work):
                left = job.started + job.allowed - time.monotonic()
                if left <= 0:
                    break
                job.lock.wait(left)  # woken when the read is done, and when the list is
            else:
                return job.outs, stats_delta(_reader_stats(decoder), before)
            # Abandon the stuck thread with its decoder; the rest get fresh ones.
            job.abandoned = True
            outs, reading = list(job.outs), job.reading
        io = stats_delta(_reader_stats(decoder), before)
        self._jobs.put(None)  # it exits once (if ever) the stuck decode returns
        self._jobs, self._decoder = None, None
        self.timeouts += 1
        ref = work[len(outs)][0]
        what = (f"read timed out after {job.allowed:g} s ({len(work)} samples read together)"
                if reading else f"decode timed out after {self.timeout:g} s")
        return outs + [Decoded(ref, error=CorruptSample(ref.source, ref.key, what))], io

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
        if self._decoder is not None:
            self._decoder.reader.close()
        self._jobs, self._decoder = None, None


class _Job:
    """A list handed to the decode thread: its results so far, and the deadline of what it
    does now (``started`` + ``allowed``: the read of the list, then each sample's decode)."""

    def __init__(self, work: list, timeout: float) -> None:
        self.work, self.outs, self.abandoned = work, [], False
        self.lock = threading.Condition()
        self.timeout = timeout
        self.started, self.allowed, self.reading = time.monotonic(), timeout * len(work), True


def _serve(decoder: SampleDecoder, jobs: queue.Queue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            decoder.reader.close()
            return
        with job.lock:
            job.started = time.monotonic()
        _read_ahead(decoder, [ref for ref, _ in job.work])
        with job.lock:
            job.started, job.allowed, job.reading = time.monotonic(), job.timeout, False
            job.lock.notify()  # the watchdog's deadline is now each sample's, not the read's
        for ref, need in job.work:
            with job.lock:
                if job.abandoned:
                    break
                job.started, job.allowed = time.monotonic(), job.timeout
            out = _run(decoder, ref, need)
            with job.lock:
                if job.abandoned:
                    break
                job.outs.append(out)
                if len(job.outs) == len(job.work):
                    job.lock.notify()
        _read_ahead(decoder, [])  # nothing read ahead outlives its work item


def _decode_list(decoder: SampleDecoder, work: list) -> list[Decoded]:
    _read_ahead(decoder, [ref for ref, _ in work])
    try:
        return [_run(decoder, ref, need) for ref, need in work]
    finally:
        _read_ahead(decoder, [])


def _read_ahead(decoder: SampleDecoder, refs: list[SampleRef]) -> None:
    """The refs read together before they are decoded one by one (a decoder without
    ``read_ahead``, a stand-in in tests, reads each as it decodes it). A read that fails as a
    whole (an unknown source) is left to each decode, which names its own sample."""
    read_ahead = getattr(decoder, "read_ahead", None)
    if read_ahead is None:
        return
    try:
        read_ahead(refs)
    except Exception:  # noqa: BLE001 -- each sample's decode reports it
        read_ahead([])


def _reader_stats(decoder: SampleDecoder) -> dict[str, int]:
    stats = getattr(decoder.reader, "stats", None)  # stand-ins in tests count nothing
    return stats() if stats is not None else {}


def _run(decoder: SampleDecoder, ref: SampleRef, need: DecodeNeed | None) -> Decoded:
    try:
        return Decoded(ref, decoder.decode(ref, need))
    except CorruptSample as e:
        return Decoded(ref, error=e)
    except Exception as e:  # noqa: BLE001 -- a decoder bug on one file must not kill a worker
        return Decoded(ref, error=CorruptSample(ref.source, ref.key,
                                                f"{type(e).__name__}: {e}"))
