"""A plan cut into worker chunks (``loaders.chunks``): which samples go together, by hand; and
a step assembled from worker-built micro-batches equals the same step assembled from samples
decoded one by one (the trainer-side path), with and without a sample that fails to decode."""

from __future__ import annotations

import numpy as np
import torch

from omniscale.geometry import MediaGeometry
from omniscale.loaders.assemble import DecodedStep, StepAssembler, sample_id
from omniscale.loaders.chunks import decode_chunk, plan_chunks
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.sequence import DecodedSample, MediaItem
from omniscale.loaders.transfer import pack, unpack
from omniscale.loaders.worker import Decoded
from tests.loaders.pipeline_fixtures import assert_same_batch
from tests.loaders.test_decode_work import _row, _table

G = MediaGeometry(patch_size=2, merge_size=2, temporal_patch_size=2)
WIDTH = 3 * 2 * 2 * 2

ROWS = [
    _row("a", "llm", images=(4, 4), encode_ranks=(0, 1), micro_batch=0),
    _row("b", "encode", videos=(8,), item=("video", 0), consume_rank=1),
    _row("c", "llm", micro_batch=1),
    _row("d", "llm", images=(4,), micro_batch=0),
    _row("f", "llm", images=(4,), audio=(100,), encode_ranks=(1, 0), micro_batch=1),
    _row("f", "encode", images=(4,), audio=(100,), item=("audio", 0), consume_rank=0),
    _row("g", "encode", images=(4,), item=("image", 0), consume_rank=1),
    _row("h", "llm", micro_batch=2),
]


def test_one_chunk_per_micro_batch_then_the_samples_only_encoded_here():
    chunks = plan_chunks(_table(ROWS), rank=0, encode_parts=2)
    assert [[ref.key for ref, _ in c.work] for c in chunks] == [
        ["a", "d"], ["c", "f"], ["h"], ["b"], ["g"]]
    assert [c.micro for c in chunks[:3]] == [
        {0: [(0, 1, 0, None, None), (1, 1, 0, None, None)]},
        {1: [(0, 1, 0, None, None), (1, 1, 0, None, None)]}, {2: [(0, 1, 0, None, None)]}]
    # encode rows travel with their sample: f's in its micro-batch's chunk, b's and g's alone
    assert [c.encode for c in chunks] == [[], [(5, 1, "audio", 0, 0)], [],
                                         [(1, 0, "video", 0, 1)], [(6, 0, "image", 0, 1)]]
    assert sorted(ref.key for c in chunks for ref, _ in c.work) == list("abcdfgh")  # once each


def test_micro_batches_sharing_a_sample_go_to_one_worker():
    rows = [_row("a", "llm", micro_batch=0), _row("b", "llm", micro_batch=1),
            _row("a", "llm", micro_batch=2), _row("c", "llm", micro_batch=3)]
    chunks = plan_chunks(_table(rows), rank=None)
    assert [sorted(c.micro) for c in chunks] == [[0, 2], [1], [3]]
    assert [[ref.key for ref, _ in c.work] for c in chunks] == [["a"], ["b"], ["c"]]


def _fake_decode(fail: set[str]):
    """Decoded samples shaped by their ref (the decoder itself is tested elsewhere): tokens
    from the key, a patch tensor per image and video, mel frames per clip."""
    def decode(ref, need=None):
        if ref.key in fail:
            return Decoded(ref, error=CorruptSample(ref.source, ref.key, "member 'x': bad"))
        seed = sum(map(ord, ref.key))
        n = 6 + seed % 5
        media, at = [], n
        for kind, column in (("image", "image_patches"), ("video", "video_patches"),
                             ("audio", "audio_frames")):
            for size in getattr(ref, column):
                if kind == "audio":
                    mel = np.full((size, G.n_mels), float(seed), np.float16)
                    media.append(MediaItem(kind, mel, None, size, at, 2))
                else:
                    rows = np.arange(size * WIDTH, dtype=np.float32).reshape(size, WIDTH)
                    grid = (1, 2, size // 2) if kind == "image" else (2, 2, size // 4)
                    media.append(MediaItem(kind, rows + seed, grid, None, at, size // 4))
                at += media[-1].num_tokens
        ids = np.arange(at, dtype=np.int64) + seed
        sample = DecodedSample(ref.source, ref.key, ids, ids + 1, np.arange(at, dtype=np.int64),
                               np.broadcast_to(ids, (3, at)).copy(), 0, media)
        return Decoded(ref, sample)
    return decode


def _all(decode):
    return lambda work: [decode(ref, need) for ref, need in work]


def _assemble(decoded: DecodedStep, fail: set[str], table):
    reports = []

    def report(step, source, shard, key, reason, epoch):
        reports.append(key)
        return None  # no replacement: the sample is dropped

    assembler = StepAssembler(0, G, "skip", report, _fake_decode(fail))
    return assembler.assemble(0, table, decoded), reports


def _by_chunks(table, fail: set[str]) -> DecodedStep:
    step = DecodedStep({})
    for chunk in plan_chunks(table, rank=None, encode_parts=2):
        step.update(unpack(pack(decode_chunk(chunk, _all(_fake_decode(fail)), G))))
    return step


def _one_by_one(table, fail: set[str]) -> DecodedStep:
    decode = _fake_decode(fail)
    from omniscale.loaders.assemble import decode_work
    return DecodedStep({sample_id(ref): decode(ref) for ref, _ in decode_work(table)})


def test_worker_built_micro_batches_equal_the_trainer_side_ones():
    table = _table(ROWS)
    for fail in (set(), {"c"}, {"g", "a"}):
        got, got_reports = _assemble(_by_chunks(table, fail), fail, table)
        want, want_reports = _assemble(_one_by_one(table, fail), fail, table)
        assert got_reports == want_reports == sorted(fail, key="abcdfgh".index)
        assert len(got.micro_batches) == len(want.micro_batches) == 3
        for a, b in zip(got.micro_batches, want.micro_batches):
            assert_same_batch(a, b)
            assert [r.key for r in a.seq_refs] == [r.key for r in b.seq_refs]
        assert [(i.ref.key, i.kind, i.index, i.consume_rank) for i in got.encode_items] == \
            [(i.ref.key, i.kind, i.index, i.consume_rank) for i in want.encode_items]
        for a, b in zip(got.encode_items, want.encode_items):
            assert torch.equal(a.tensor, b.tensor) and a.grid_thw == b.grid_thw
        assert [str(e) for e in got.skipped] == [str(e) for e in want.skipped]


def test_a_failed_sample_leaves_its_micro_batch_to_the_trainer_side():
    table = _table(ROWS)
    step = _by_chunks(table, {"c"})
    assert sorted(step.micro_batches) == [0, 2]  # c's micro-batch (1) is not built
    assert sorted(k[2] for k in step.samples) == ["c", "f"]  # it comes back sample by sample
    assert sorted(step.encode_items) == [1, 6]  # f's encode row goes with f


def test_an_item_encoded_from_a_packed_micro_batch_crosses_once():
    table = _table(ROWS)
    chunk = plan_chunks(table, rank=None, encode_parts=2)[1]  # c and f, and f's audio encode row
    assert chunk.encode == [(5, 1, "audio", 0, 0)]
    out = decode_chunk(chunk, _all(_fake_decode(set())), G)
    tensors_with_item = pack(out).described_at
    item = unpack(pack(out)).encode_items[5]
    assert torch.equal(item.tensor, torch.from_numpy(
        _fake_decode(set())(chunk.work[1][0]).sample.media[1].array))
    out.encode_items.clear()
    assert pack(out).described_at == tensors_with_item  # its rows are the micro-batch's own
