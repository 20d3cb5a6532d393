"""What a DataLoader worker hands the trainer: a chunk of decoded samples packed into one
buffer (one shared-memory segment instead of one per tensor) and a message small enough for
the pipe to write at once, rebuilt on the trainer side equal to the decode."""

from __future__ import annotations

import copy
import io
import select
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 -- registers its tensor reductions

from omniscale.dataplane.spec import load_spec
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.worker import Decoded, pack, unpack
from tests.loaders.decode_fixtures import demo_decoder, refs_of

FIELDS = ("input_ids_L", "labels_L", "position_ids_L", "mrope_3L")


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)  # what the DataLoader's result queue does
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
        assert out.sample is None or isinstance(out.sample.input_ids_L, torch.Tensor)
    assert packed.buffer.is_shared()  # filled in place: the pickler does not copy it again
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
            assert a.dtype == b.dtype and torch.equal(a, b), (ref.source, name)
        assert len(out.sample.media) == len(w.media)
        for a, b in zip(out.sample.media, w.media):
            assert a.tensor.dtype == b.tensor.dtype and torch.equal(a.tensor, b.tensor)
            assert (a.grid_thw, a.frames, a.token_start) == (b.grid_thw, b.frames, b.token_start)
