"""What a loader worker hands the trainer: a chunk of decoded samples packed into one
buffer -- a slot of the loader's shared-memory ring, or a segment of its own -- and a message
small enough for the pipe to write at once, rebuilt on the trainer side equal to the decode."""

from __future__ import annotations

import copy
import io
import multiprocessing
import select
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401 -- registers its tensor reductions

from omniscale.dataplane.spec import load_spec
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.transfer import ShmRing, pack, unpack
from omniscale.loaders.worker import Decoded
from tests.loaders.decode_fixtures import demo_decoder, refs_of

FIELDS = ("input_ids_L", "labels_L", "position_ids_L", "mrope_3L")


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)  # what a worker's result pipe carries
    return buf.getvalue()


def test_a_chunk_of_samples_crosses_as_one_buffer_and_comes_back_equal(demo_root):
    spec = load_spec(demo_root / "mix.yaml")
    decoder = demo_decoder(spec)
    refs = [ref for source in ("interleaved", "video_caption", "audio_caption", "text",
                               "image_caption") for ref in refs_of(spec, source)[:4]]
    want = [decoder.decode(ref) for ref in refs]
    bad = CorruptSample(refs[0].source, "nope", "member 'nope.jpg': not a valid image")
    outs = [Decoded(ref, copy.deepcopy(w)) for ref, w in zip(refs, want)] + \
        [Decoded(refs[0], error=bad), Decoded(None)]
    packed = pack(outs)
    for out in outs:  # packing leaves the object as it was
        assert out.sample is None or isinstance(out.sample.input_ids_L, np.ndarray)
    assert packed.buffer.is_shared()  # filled in place: the pickler does not copy it again
    # the samples' arrays (numpy until collate) sit in the buffer, not in the pickled tail
    arrays = sum(getattr(w, name).nbytes for w in want for name in FIELDS) + \
        sum(m.array.nbytes for w in want for m in w.media)
    assert packed.buffer.numel() - packed.described_at < arrays // 4
    payload = _dumps(packed)
    # Written to the pipe in one piece: a worker killed while sending leaves no half message.
    assert len(payload) < select.PIPE_BUF, len(payload)
    got = unpack(ForkingPickler.loads(payload))
    assert len(got) == len(outs)
    assert got[-1].ref is None and got[-1].sample is None
    assert got[-2].sample is None and str(got[-2].error) == str(bad)
    for out, ref, w in zip(got, refs, want):
        assert out.ref == ref
        for name in FIELDS:
            a, b = getattr(out.sample, name), getattr(w, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), (ref.source, name)
        assert len(out.sample.media) == len(w.media)
        for a, b in zip(out.sample.media, w.media):
            assert a.array.dtype == b.array.dtype and np.array_equal(a.array, b.array)
            assert (a.grid_thw, a.frames, a.token_start) == (b.grid_thw, b.frames, b.token_start)


# -- the ring: slots mapped once, inherited by forked workers -----------------------------------
def _items(n: int, size: int) -> list[dict]:
    """``n`` distinct objects of about ``size`` bytes of tensors each (a hand-made oracle:
    item i's values are i + position)."""
    return [{"i": i, "ids": torch.arange(size // 8, dtype=torch.int64) + i,
             "half": torch.full((3, 5), float(i), dtype=torch.float16)} for i in range(n)]


def _worker(ring, worker: int, items: list[dict], out, go) -> None:
    """A forked 'worker': packs every item but the last before it sends any (so none of its
    slots is free again yet), sends them, then after ``go`` packs and sends the last."""
    for message in [pack(item, ring, worker) for item in items[:-1]]:
        out.put(message)
    go.wait(timeout=60)
    out.put(pack(items[-1], ring, worker))


def _equal(a: dict, b: dict) -> bool:
    return a["i"] == b["i"] and torch.equal(a["ids"], b["ids"]) and torch.equal(a["half"],
                                                                               b["half"])


def test_ring_items_cross_a_fork_as_copies_and_slots_are_reused_in_order():
    fork = multiprocessing.get_context("fork")
    ring = ShmRing(workers=2, slots=2, slot_bytes=1 << 16)
    items = _items(4, 20_000)
    out, go = fork.SimpleQueue(), fork.Event()
    child = fork.Process(target=_worker, args=(ring, 1, items, out, go))
    child.start()
    try:
        raw = [out.get() for _ in range(3)]  # unpickled here: slots copied out and freed
        go.set()
        raw.append(out.get())
    finally:
        child.join(timeout=60)
        ring.close()
    assert child.exitcode == 0
    # Two slots: the first two items went through the ring, the third found both unread
    # (the child packed it before this process took any) and got a segment of its own; the
    # fourth, packed after the others were taken, reused the first slot.
    assert [type(r).__name__ for r in raw] == ["Packed"] * 4
    assert [r.buffer.is_shared() for r in raw] == [False, False, True, False]
    got = [unpack(r) for r in raw]
    for g, want in zip(got, items):
        assert _equal(g, want), g["i"]
    # The fourth item overwrote slot 0 in the child; the first, taken from it before, is a
    # copy and did not change.
    assert _equal(got[0], items[0])


def test_ring_message_stays_small_and_an_item_over_a_slot_gets_a_segment():
    ring = ShmRing(workers=1, slots=4, slot_bytes=1 << 16)
    try:
        small, big = _items(2, 10_000)[0], _items(2, 200_000)[1]
        message = _dumps(pack(small, ring, 0))
        assert len(message) < select.PIPE_BUF, len(message)  # written to the pipe at once
        taken = ForkingPickler.loads(message)
        assert not taken.buffer.is_shared() and _equal(unpack(taken), small)
        over = pack(big, ring, 0)  # larger than a slot
        assert over.buffer.is_shared() and _equal(unpack(ForkingPickler.loads(_dumps(over))),
                                                  big)
    finally:
        ring.close()


def test_a_ring_message_after_its_ring_closed_is_refused_in_one_line():
    ring = ShmRing(workers=1, slots=1, slot_bytes=1 << 12)
    message = _dumps(pack({"x": torch.ones(4)}, ring, 0))
    ring.close()
    with pytest.raises(RuntimeError, match=r"ring \d+, closed in this process"):
        ForkingPickler.loads(message)
