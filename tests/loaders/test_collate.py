"""Packing decoded demo samples into a PackedBatch: the packed tensors are the per-sample
decodes (numpy) laid end to end, and an SP-split sample's slices put back together give the
padded sample, with every media item on each slice whose block it overlaps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniscale.dataplane.spec import load_spec
from omniscale.layout import IGNORE_INDEX
from omniscale.loaders.collate import collate, sp_bounds
from tests.loaders.decode_fixtures import demo_decoder, refs_of


@pytest.fixture(scope="module")
def decoded(demo_root):
    spec = load_spec(demo_root / "mix.yaml")
    decoder = demo_decoder(spec)
    picks = {name: refs_of(spec, name)[:2] for name in
             ("text", "docs", "image_caption", "video_caption", "audio_caption", "interleaved")}
    return spec, decoder, {name: [decoder.decode(r) for r in refs] for name, refs in picks.items()}


def test_packed_tensors_are_the_samples_end_to_end(decoded):
    spec, _, samples = decoded
    batch_samples = [s for group in samples.values() for s in group]
    batch = collate([(s, 1, 0) for s in batch_samples], spec.media)
    lengths = [len(s) for s in batch_samples]
    assert batch.cu_seqlens_S1.dtype == torch.int32
    assert batch.cu_seqlens_S1.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert batch.max_seqlen == max(lengths) and batch.num_tokens == sum(lengths)
    assert batch.seq_len_full_S.tolist() == lengths
    assert batch.seq_sp_size_S.tolist() == [1] * len(lengths)
    vision, audio, m = [], [], 0
    for s, sample in enumerate(batch_samples):
        lo, hi = batch.cu_seqlens_S1[s].item(), batch.cu_seqlens_S1[s + 1].item()
        assert torch.equal(batch.input_ids_T[lo:hi], torch.from_numpy(sample.input_ids_L))
        assert torch.equal(batch.labels_T[lo:hi], torch.from_numpy(sample.labels_L))
        assert torch.equal(batch.position_ids_T[lo:hi], torch.from_numpy(sample.position_ids_L))
        assert torch.equal(batch.mrope_3T[:, lo:hi], torch.from_numpy(sample.mrope_3L))
        for item in sample.media:
            assert batch.media_sample_M[m] == s and batch.media_kind_M[m] == item.kind_id
            start, n = batch.media_token_start_M[m].item(), batch.media_num_tokens_M[m].item()
            assert (start, n) == (lo + item.token_start, item.num_tokens)
            assert batch.media_index_M[m] == (len(audio) if item.kind == "audio" else len(vision))
            (audio if item.kind == "audio" else vision).append(item)
            m += 1
    assert m == len(batch.media_kind_M) and {0, 1, 2} <= set(batch.media_kind_M.tolist())
    assert np.array_equal(batch.pixel_rows_RQ.numpy(), np.concatenate([it.array for it in vision]))
    assert batch.pixel_rows_RQ.dtype == torch.uint8 and batch.audio_mel_AF.dtype == torch.float16
    assert batch.vision_grid_thw_V3.tolist() == [list(it.grid_thw) for it in vision]
    assert batch.vision_kind_V.tolist() == [it.kind_id for it in vision]
    # rows per item: a row per patch of an image, temporal_patch_size per patch of a clip
    tp = spec.media.temporal_patch_size
    assert batch.vision_rows_V.tolist() == [
        (tp if it.kind == "video" else 1) * torch.tensor(it.grid_thw).prod().item()
        for it in vision]
    assert np.array_equal(batch.audio_mel_AF.numpy(), np.concatenate([it.array for it in audio]))
    # the batch is the samples' copy: packing never hands a sample's own memory on
    assert not np.shares_memory(batch.input_ids_T.numpy(), batch_samples[0].input_ids_L)
    assert batch.audio_frames_A.tolist() == [it.frames for it in audio]


@pytest.mark.parametrize("k", [2, 3, 5])
def test_sp_slices_put_back_together_give_the_padded_sample(decoded, k):
    spec, decoder, samples = decoded
    # An interleaved sample whose media block 3 slices cut through (the case worth checking).
    long_text = samples["text"][0]
    with_media = next((s for s in samples["interleaved"] if _split_items(s, 3)), None)
    assert with_media is not None, "no interleaved demo sample has a block cut by 3 slices"
    neighbour = samples["image_caption"][0]
    for sample in (long_text, with_media):
        n = len(sample)
        batches = [collate([(neighbour, 1, 0), (sample, k, i)], spec.media) for i in range(k)]
        chunk = -(-n // k)
        for i, b in enumerate(batches):
            assert b.cu_seqlens_S1.tolist() == [0, len(neighbour), len(neighbour) + chunk]
            assert (b.seq_sp_size_S.tolist(), b.seq_sp_index_S.tolist()) == ([1, k], [0, i])
            assert b.seq_len_full_S.tolist() == [len(neighbour), n]
        tail = slice(len(neighbour), None)
        ids = torch.cat([b.input_ids_T[tail] for b in batches])
        labels = torch.cat([b.labels_T[tail] for b in batches])
        positions = torch.cat([b.position_ids_T[tail] for b in batches])
        mrope = torch.cat([b.mrope_3T[:, tail] for b in batches], dim=1)
        pad = k * chunk - n
        assert torch.equal(ids[:n], torch.from_numpy(sample.input_ids_L))
        assert (ids[n:] == decoder.tokenizer.pad_id).all() and len(ids) == n + pad
        assert torch.equal(labels[:n], torch.from_numpy(sample.labels_L))
        assert (labels[n:] == IGNORE_INDEX).all()
        assert torch.equal(positions, torch.arange(n + pad))
        assert torch.equal(mrope[:, :n], torch.from_numpy(sample.mrope_3L))
        assert (mrope[:, n:] > int(sample.mrope_3L.max())).all()
        _check_slice_media(sample, batches, len(neighbour), k)


def _split_items(sample, k):
    """The sample's media items whose token block more than one of k SP slices overlaps."""
    n = len(sample)
    return [it for it in sample.media
            if sum(it.token_start < sp_bounds(n, k, i)[1]
                   and it.token_start + it.num_tokens > sp_bounds(n, k, i)[0]
                   for i in range(k)) > 1]


def _check_slice_media(sample, batches, offset, k):
    """Each slice carries exactly the items whose block overlaps it, whole and placed."""
    for i, b in enumerate(batches):
        lo, hi = sp_bounds(len(sample), k, i)
        expected = [it for it in sample.media
                    if it.token_start < hi and it.token_start + it.num_tokens > lo]
        mine = (b.media_sample_M == 1).nonzero().flatten().tolist()
        assert len(mine) == len(expected)
        for m, item in zip(mine, expected):
            start = b.media_token_start_M[m].item()
            assert start == offset + item.token_start - lo
            vision_row = b.media_index_M[m].item()
            grid = b.vision_grid_thw_V3[vision_row].tolist()
            assert grid == list(item.grid_thw)
            inside = range(max(start, offset), min(start + item.num_tokens, b.num_tokens))
            assert all(b.input_ids_T[t] == sample.input_ids_L[item.token_start] for t in inside)
        vision = [torch.from_numpy(it.array) for it in expected if it.kind != "audio"]
        if vision:  # the neighbour's image comes first in the batch
            assert torch.equal(b.pixel_rows_RQ[-sum(len(v) for v in vision):], torch.cat(vision))


def test_empty_media_tensors_keep_their_width(decoded):
    spec, _, samples = decoded
    batch = collate([(samples["text"][1], 1, 0)], spec.media)
    g = spec.media
    assert batch.pixel_rows_RQ.shape == (0, 3 * g.patch_size ** 2)
    assert batch.vision_rows_V.shape == (0,)
    assert batch.audio_mel_AF.shape == (0, g.n_mels)
    assert batch.vision_grid_thw_V3.shape == (0, 3) and batch.media_kind_M.numel() == 0
    with pytest.raises(ValueError, match="bad SP slice"):
        collate([(samples["text"][1], 2, 2)])


def test_a_media_tensor_shares_a_writable_array_and_copies_a_read_only_one():
    """Ray's object store hands arrays out read-only: the tensor over one would be writable
    (torch warns); it gets a copy. A writable array (the worker pool's) is shared, not copied."""
    import warnings

    from omniscale.loaders.collate import media_tensor
    from omniscale.loaders.sequence import MediaItem

    writable = np.arange(12, dtype=np.uint8).reshape(3, 4)
    shared = media_tensor(MediaItem("image", writable, (1, 1, 3), None, 0, 1))
    assert np.shares_memory(shared.numpy(), writable)
    read_only = writable.copy()
    read_only.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning fails the test
        copied = media_tensor(MediaItem("image", read_only, (1, 1, 3), None, 0, 1))
    assert not np.shares_memory(copied.numpy(), read_only)
    assert torch.equal(copied, torch.from_numpy(writable))
    assert media_tensor(MediaItem("audio", None, None, 4, 0, 1)) is None
