"""What a DataLoader worker hands the trainer: a decoded sample as numpy arrays inside one
pickled payload (no shared-memory segment and file descriptor per tensor), rebuilt on the
trainer side equal to the decode."""

from __future__ import annotations

import copy
import io
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 -- registers its tensor reductions

from omniscale.dataplane.spec import load_spec
from omniscale.loaders.worker import Decoded, as_arrays, as_tensors
from tests.loaders.decode_fixtures import demo_decoder, refs_of


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)  # what the DataLoader's result queue does
    return buf.getvalue()


def test_a_decoded_sample_crosses_as_one_payload_and_comes_back_equal(demo_root):
    spec = load_spec(demo_root / "mix.yaml")
    ref = next(r for r in refs_of(spec, "interleaved") if r.image_patches)
    sample = demo_decoder(spec).decode(ref)
    want = copy.deepcopy(sample)
    assert b"rebuild_storage" in _dumps(Decoded(ref, copy.deepcopy(sample)))  # tensors: fds

    payload = _dumps(as_arrays(Decoded(ref, sample)))
    assert b"rebuild_storage" not in payload and b"torch" not in payload
    got = as_tensors(ForkingPickler.loads(payload)).sample
    for name in ("input_ids_L", "labels_L", "position_ids_L", "mrope_3L"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert len(got.media) == len(want.media) > 0
    for a, b in zip(got.media, want.media):
        assert torch.equal(a.tensor, b.tensor) and a.grid_thw == b.grid_thw
