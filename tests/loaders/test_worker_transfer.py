"""What a DataLoader worker hands the trainer: a decoded sample's tensors packed into one
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
from omniscale.loaders.worker import Decoded, as_one_buffer, from_one_buffer
from tests.loaders.decode_fixtures import demo_decoder, refs_of

FIELDS = ("input_ids_L", "labels_L", "position_ids_L", "mrope_3L")


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)  # what the DataLoader's result queue does
    return buf.getvalue()


def test_a_decoded_sample_crosses_as_one_buffer_and_comes_back_equal(demo_root):
    spec = load_spec(demo_root / "mix.yaml")
    decoder = demo_decoder(spec)
    for source in ("interleaved", "video_caption", "audio_caption", "text"):
        ref = refs_of(spec, source)[0]
        want = decoder.decode(ref)
        out = as_one_buffer(Decoded(ref, copy.deepcopy(want)))
        tensors = [getattr(out.sample, n) for n in FIELDS] + [m.tensor for m in out.sample.media]
        assert not any(isinstance(t, torch.Tensor) for t in tensors)  # all in the one buffer
        payload = _dumps(out)
        # Written to the pipe in one piece: a worker killed while sending leaves no half message.
        assert len(payload) < select.PIPE_BUF, len(payload)
        got = from_one_buffer(ForkingPickler.loads(payload)).sample
        for name in FIELDS:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (source, name)
        assert len(got.media) == len(want.media)
        for a, b in zip(got.media, want.media):
            assert a.tensor.dtype == b.tensor.dtype and torch.equal(a.tensor, b.tensor)
            assert (a.grid_thw, a.frames, a.token_start) == (b.grid_thw, b.frames, b.token_start)
