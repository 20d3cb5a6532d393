"""What crosses from a loader worker process to the trainer: one buffer per work item.

Pickled the usual way (``multiprocessing``'s ForkingPickler, with torch's reductions), every
tensor would cross as a shared-memory segment of its own plus a file descriptor, fetched by
the trainer over a connection to the worker (a handful of system calls on both sides, many
tensors per micro-batch). Here a work item (a micro-batch of decoded
samples) is one ``uint8`` buffer: its tensors, 64-byte aligned, then the rest of the object
pickled with every tensor standing as (dtype, shape, offset) -- :class:`Packed`. The trainer
views every tensor out of the buffer (:func:`unpack`).

Where the buffer lives (:func:`pack`):

- in a slot of the loader's :class:`ShmRing` when one is free and the item fits: shared memory
  mapped once, before the workers fork, and reused for the whole run. The trainer copies the
  item out as it receives the message and frees the slot. A fresh segment per item costs
  more than the copy: the trainer unmaps it when the batch dies (a ``munmap`` that frees its
  pages, under the GIL: the largest single item of the trainer's profile on the text
  workload), and both sides fault every page in;
- otherwise in a shared-memory segment of its own, passed by file descriptor (an item larger
  than a slot, or every slot still unread).

Either way the message in the worker's result pipe (``loaders.worker_pool``) stays small
whatever the item: written at once, it is seldom cut short by the worker's death.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import mmap
import multiprocessing
import pickle
from dataclasses import dataclass

import numpy
import torch

_ALIGN = 64  # every tensor starts at a cache line within the buffer (as torch allocates)
# numpy dtypes a tensor can view (torch.from_numpy); anything else is pickled in-band
_NUMPY_DTYPES = {numpy.dtype(t) for t in (numpy.bool_, numpy.uint8, numpy.int8, numpy.int16,
                                         numpy.int32, numpy.int64, numpy.float16,
                                         numpy.float32, numpy.float64)}


@dataclass
class Packed:
    """An object in one uint8 buffer: its tensors, then the rest of it pickled (from byte
    ``described_at``), each tensor standing there as (dtype, shape, offset)."""

    buffer: torch.Tensor
    described_at: int


class _TensorsOut(pickle.Pickler):
    """Pickles an object with every tensor replaced by its place in the buffer to be."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[torch.Tensor, int]] = []
        self.size = 0
        # storage -> (storage offset, buffer offset, bytes) of a contiguous tensor placed: a
        # contiguous view into it (an encoder item's rows of a packed micro-batch) is not
        # copied again but points into the same bytes.
        self.placed: dict[int, tuple[int, int, int]] = {}

    def persistent_id(self, obj):
        # a decoded sample's arrays (numpy until collate) cross in the buffer like tensors
        # and come back as numpy views of it
        if isinstance(obj, numpy.ndarray) and obj.dtype in _NUMPY_DTYPES:
            return ("numpy", *self._place(torch.from_numpy(numpy.ascontiguousarray(obj))))
        if not isinstance(obj, torch.Tensor):
            return None
        return self._place(obj)

    def _place(self, obj: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], int]:
        nbytes = obj.numel() * obj.element_size()
        ptr = obj.untyped_storage().data_ptr() if obj.is_contiguous() else None
        if ptr in self.placed:
            offset, at, size = self.placed[ptr]
            start = at + (obj.storage_offset() - offset) * obj.element_size()
            if at <= start and start + nbytes <= at + size:
                return obj.dtype, tuple(obj.shape), start
        at = self.size
        self.tensors.append((obj, at))
        if ptr is not None and nbytes:
            self.placed[ptr] = (obj.storage_offset(), at, nbytes)
        self.size += nbytes
        self.size += -self.size % _ALIGN
        return obj.dtype, tuple(obj.shape), at


class _TensorsIn(pickle.Unpickler):
    def __init__(self, file, buffer: torch.Tensor) -> None:
        super().__init__(file)
        self.buffer = buffer

    def persistent_load(self, pid):
        as_numpy = pid[0] == "numpy"
        dtype, shape, at = pid[1:] if as_numpy else pid
        n = math.prod(shape) * dtype.itemsize
        tensor = self.buffer[at:at + n].view(dtype).view(shape)
        return tensor.numpy() if as_numpy else tensor


def pack(obj, ring: "ShmRing | None" = None, worker: int = 0) -> "Packed | _InRing":
    """``obj`` (any picklable object holding CPU tensors) in one shared buffer: a slot of
    ``ring`` (worker ``worker``'s) when one is free and the object fits, else a shared-memory
    segment of its own. The buffer is filled once, in place (a tensor the pickler met outside
    shared memory would be copied into it again)."""
    described = io.BytesIO()
    pickler = _TensorsOut(described)
    pickler.dump(obj)
    at, tail = pickler.size, described.getbuffer()
    size = at + len(tail)
    claimed = ring.claim(worker, size) if ring is not None else None
    buffer = claimed[1] if claimed else torch.empty(size, dtype=torch.uint8).share_memory_()
    for t, start in pickler.tensors:
        if t.numel():
            buffer[start:start + t.numel() * t.element_size()].view(t.dtype).view(
                t.shape).copy_(t)
    buffer[at:] = torch.frombuffer(tail, dtype=torch.uint8)
    if claimed:
        return _InRing(ring.id, worker, claimed[0], size, at)
    return Packed(buffer, at)


def transfer_bytes(packed) -> int:
    """Bytes a worker handed over in ``packed`` (0 for an object that never left its process)."""
    return packed.buffer.numel() if isinstance(packed, Packed) else 0


def unpack(packed):
    """Undo :func:`pack`: the object, every tensor a view into the buffer (an object that
    never left its process comes back as it is)."""
    if not isinstance(packed, Packed):
        return packed
    described = packed.buffer[packed.described_at:].numpy().tobytes()
    return _TensorsIn(io.BytesIO(described), packed.buffer).load()


# -- the ring ---------------------------------------------------------------------------------
_RINGS: dict[int, "ShmRing"] = {}  # this process's open rings, by id (what a message names)
_RING_IDS = itertools.count()


class ShmRing:
    """``slots`` slots of ``slot_bytes`` per worker in anonymous shared memory
    (``mmap(-1, n)``: no name, no file descriptor, not bounded by ``/dev/shm``), made by the
    trainer before it forks the workers, which inherit it.

    A worker fills its slots in turn (:meth:`claim`, never blocking: with no slot free it
    packs into a segment of its own); the trainer copies an item out the moment its message
    is unpickled -- whatever order the pool then hands results on in -- and frees the slot
    (:func:`_take`). A worker's messages arrive in the order it sent them, so its slots free
    in the order it claimed them, and a count of free slots (a semaphore per worker) is all
    the bookkeeping. A worker that dies may take a slot it claimed with it: once every
    message it sent is read, the pool resets its slots for the process that replaces it
    (:meth:`reset`). Memory: the pages of a slot, once an item touched them, stay resident
    while the pool lives (at most ``slots * slot_bytes`` per worker, 64 MiB by default; the
    demo's image micro-batches touch 9 MiB a slot)."""

    def __init__(self, workers: int, slots: int = 4, slot_bytes: int = 16 << 20) -> None:
        if workers < 1 or slots < 1 or slot_bytes < 1:
            raise ValueError(f"ShmRing: workers, slots and slot_bytes must be >= 1, got "
                             f"{workers}, {slots}, {slot_bytes}")
        fork = multiprocessing.get_context("fork")
        self.id = next(_RING_IDS)
        self.slots, self.slot_bytes = int(slots), int(slot_bytes)
        self._maps = [mmap.mmap(-1, self.slots * self.slot_bytes) for _ in range(workers)]
        self._free = [fork.Semaphore(self.slots) for _ in range(workers)]
        self._next = [0] * workers  # the slot each worker fills next (in its own process)
        _RINGS[self.id] = self

    def claim(self, worker: int, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """In worker ``worker``: its next slot and a uint8 view of its first ``nbytes``, or
        None when the item does not fit or every slot still waits for the trainer."""
        if not 0 < nbytes <= self.slot_bytes or not self._free[worker].acquire(block=False):
            return None
        slot = self._next[worker]
        self._next[worker] = (slot + 1) % self.slots
        return slot, self._view(worker, slot, nbytes)

    def _view(self, worker: int, slot: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(self._maps[worker], dtype=torch.uint8, count=nbytes,
                                offset=slot * self.slot_bytes)

    def reset(self, worker: int) -> None:
        """In the trainer, before a dead worker's replacement forks and once every message
        the dead one sent is read (so none of its slots still holds an item to copy out):
        all of ``worker``'s slots free, filled from the first again. A slot it claimed and
        never announced would otherwise stay taken for good."""
        self._free[worker] = multiprocessing.get_context("fork").Semaphore(self.slots)
        self._next[worker] = 0

    def close(self) -> None:
        """In the trainer, once the workers are gone: unmap the slots (a mapping a view still
        holds is left to the collector)."""
        _RINGS.pop(self.id, None)
        for m in self._maps:
            with contextlib.suppress(BufferError):  # still viewed: the collector unmaps it
                m.close()

    def __reduce__(self):
        raise TypeError("ShmRing crosses to workers by fork only (a pickled copy would not "
                        "share the memory)")


class _InRing:
    """A worker's message for an item in its ring: unpickled in the trainer as the item,
    copied out of the slot (:func:`_take`)."""

    __slots__ = ("where",)

    def __init__(self, *where) -> None:
        self.where = where

    def __reduce__(self):
        return _take, self.where


def _take(ring_id: int, worker: int, slot: int, nbytes: int, described_at: int) -> Packed:
    """In the trainer, as the message is unpickled: the item copied out of its slot, and the
    slot freed for the worker."""
    ring = _RINGS.get(ring_id)
    if ring is None:
        raise RuntimeError(f"a loader worker's item names shared-memory ring {ring_id}, "
                           "closed in this process (its worker pool was closed)")
    # numpy's copy: one thread, and the GIL released (torch's copy_ would wake its intra-op
    # threads, which then spin for the trainer's cores)
    buffer = numpy.empty(nbytes, dtype=numpy.uint8)
    buffer[:] = numpy.frombuffer(ring._maps[worker], numpy.uint8, nbytes,
                                 slot * ring.slot_bytes)
    ring._free[worker].release()
    return Packed(torch.from_numpy(buffer), described_at)
