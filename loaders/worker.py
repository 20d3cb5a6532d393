"""What a stateless loader worker does: decode one SampleRef, bounded in time, never raising.

A worker (a ``torch.utils.data`` worker process or a Ray actor) holds one
:class:`TimedDecoder`: a SampleDecoder (its reader keeps a bounded LRU of open shards, so its
memory does not grow with the number of sources) run under a watchdog. Decoding happens on a
helper thread the worker waits on for at most ``timeout`` seconds; on a timeout the thread and
its decoder are abandoned (a hung C call cannot be interrupted, and the reader it holds is not
thread-safe) and a fresh decoder takes over, so one pathological file costs one timeout, not a
worker.

Failures come back as data (:class:`Decoded` with ``error``), not exceptions: a worker that
raised would take the whole DataLoader down with it, and the trainer side decides the policy.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from omniscale.dataplane.refs import SampleRef
from omniscale.loaders.decode import DecodeNeed, SampleDecoder
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.geometry import MediaGeometry
from omniscale.loaders.readers import SampleReader
from omniscale.loaders.sequence import DecodedSample


@dataclass
class Decoded:
    """One ref's outcome: the sample, or ``error`` (a CorruptSample naming source and key)."""

    ref: SampleRef | None
    sample: DecodedSample | None = None
    error: CorruptSample | None = None
    seconds: float = 0.0
    buffer: torch.Tensor | None = None  # the sample's tensors, packed (as_one_buffer)


@dataclass(frozen=True)
class DecoderSpec:
    """Everything a worker needs to build its decoder: small and picklable."""

    sources: dict[str, str]
    tokenizer: str
    geometry: MediaGeometry
    max_open: int = 16

    def build(self) -> SampleDecoder:
        return SampleDecoder(SampleReader(self.sources, max_open=self.max_open),
                             self.tokenizer, self.geometry)


def decoder_spec(sources: dict, tokenizer: str | Path, geometry: MediaGeometry,
                 max_open: int = 16) -> DecoderSpec:
    return DecoderSpec({str(k): str(v) for k, v in sources.items()}, str(tokenizer), geometry,
                       max_open)


class TimedDecoder:
    """Decodes refs with a per-sample deadline; a timeout is a CorruptSample like any other."""

    def __init__(self, spec: DecoderSpec, timeout: float | None = 30.0) -> None:
        self.spec, self.timeout = spec, timeout
        self._decoder: SampleDecoder | None = None
        self._jobs: queue.Queue | None = None
        self.timeouts = 0

    def decode(self, ref: SampleRef | None, need: DecodeNeed | None = None) -> Decoded:
        if ref is None:  # a step with nothing to decode still sends one item through
            return Decoded(None)
        start = time.perf_counter()
        if self.timeout is None:
            out = _run(self._current(), ref, need)
        else:
            out = self._watched(ref, need)
        out.seconds = time.perf_counter() - start
        return out

    def _current(self) -> SampleDecoder:
        if self._decoder is None:
            self._decoder = self.spec.build()
        return self._decoder

    def _watched(self, ref: SampleRef, need: DecodeNeed | None) -> Decoded:
        if self._jobs is None:
            self._jobs = queue.Queue()
            decoder = self._current()
            threading.Thread(target=_serve, args=(decoder, self._jobs), daemon=True,
                             name="omniscale-decode").start()
        reply: queue.Queue = queue.Queue(maxsize=1)
        self._jobs.put((ref, need, reply))
        try:
            return reply.get(timeout=self.timeout)
        except queue.Empty:
            # Abandon the stuck thread with its decoder; the next sample gets fresh ones.
            self._jobs.put(None)  # it exits once (if ever) the stuck decode returns
            self._jobs, self._decoder = None, None
            self.timeouts += 1
            return Decoded(ref, error=CorruptSample(
                ref.source, ref.key, f"decode timed out after {self.timeout:g} s"))

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
        if self._decoder is not None:
            self._decoder.reader.close()
        self._jobs, self._decoder = None, None


def _serve(decoder: SampleDecoder, jobs: queue.Queue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            decoder.reader.close()
            return
        ref, need, reply = job
        reply.put(_run(decoder, ref, need))


def _run(decoder: SampleDecoder, ref: SampleRef, need: DecodeNeed | None) -> Decoded:
    try:
        return Decoded(ref, decoder.decode(ref, need))
    except CorruptSample as e:
        return Decoded(ref, error=e)
    except Exception as e:  # noqa: BLE001 -- a decoder bug on one file must not kill a worker
        return Decoded(ref, error=CorruptSample(ref.source, ref.key,
                                                f"{type(e).__name__}: {e}"))


class RefDataset(torch.utils.data.Dataset):
    """A map-style dataset whose "indices" are work items ``(tag, (ref, need))`` or
    ``(tag, None)``: the sampler hands each worker refs, the worker decodes them. Stateless
    apart from its decoder, built lazily in the worker process (after the fork) so no open
    file crosses processes."""

    def __init__(self, spec: DecoderSpec, timeout: float | None) -> None:
        self.spec, self.timeout = spec, timeout
        self._decoder: TimedDecoder | None = None

    def __getitem__(self, item: tuple[object, tuple | None]) -> tuple[object, Decoded]:
        if self._decoder is None:
            self._decoder = TimedDecoder(self.spec, self.timeout)
        tag, work = item
        out = self._decoder.decode(*(work or (None,)))
        # Packed only to leave a worker process (num_workers=0 decodes in the trainer's).
        return tag, as_one_buffer(out) if torch.utils.data.get_worker_info() else out


# What crosses from a worker process to the trainer: one buffer per sample. The DataLoader
# hands every tensor over as a shared-memory segment of its own plus a file descriptor (a
# handful of system calls on both sides, several tensors per sample); packed into one uint8
# buffer a sample costs one. The trainer side views its tensors out of the buffer without a
# copy. The message itself stays small (the descriptor and shapes): a worker killed while
# sending cannot leave a half-written payload in the result pipe that others still write to.
_SAMPLE_TENSORS = ("input_ids_L", "labels_L", "position_ids_L", "mrope_3L")
_ALIGN = 16  # every tensor starts at a multiple of this within the buffer (any dtype's size)


def as_one_buffer(out: Decoded) -> Decoded:
    """``out`` with its sample's tensors packed into one uint8 buffer (in place: each tensor
    field holds its (dtype, shape, offset) until :func:`from_one_buffer`)."""
    if out.sample is None or out.buffer is not None:
        return out
    parts, at = [], 0
    for obj, name in _tensor_slots(out.sample):
        t = getattr(obj, name).contiguous()
        raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        pad = -raw.numel() % _ALIGN
        parts += [raw, torch.zeros(pad, dtype=torch.uint8)]
        setattr(obj, name, (t.dtype, tuple(t.shape), at))
        at += raw.numel() + pad
    out.buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return out


def from_one_buffer(out: Decoded) -> Decoded:
    """Undo :func:`as_one_buffer`: every tensor a view into the buffer."""
    buffer = out.buffer
    if out.sample is None or buffer is None:
        return out
    for obj, name in _tensor_slots(out.sample):
        dtype, shape, at = getattr(obj, name)
        n = math.prod(shape) * dtype.itemsize
        setattr(obj, name, buffer[at:at + n].view(dtype).view(shape))
    out.buffer = None
    return out


def _tensor_slots(sample: DecodedSample) -> list[tuple[object, str]]:
    """(object, attribute) of every tensor a decoded sample holds, in a fixed order."""
    slots = [(sample, name) for name in _SAMPLE_TENSORS]
    return slots + [(item, "tensor") for item in sample.media if item.tensor is not None]


def identity(x):
    """The DataLoader's collate_fn: items stay as the worker returned them."""
    return x
