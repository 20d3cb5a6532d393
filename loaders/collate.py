"""Decoded samples -> one PackedBatch: a micro-batch of packed sequences and its media.

Samples are packed end to end (``cu_seqlens`` bounds attention to each sample, the
varlen-attention convention). A sample the plane split across a sequence-parallel group of
``k`` ranks contributes only this rank's slice: the sample padded to a multiple of ``k`` (pad
id, label IGNORE_INDEX) and cut into ``k`` equal parts, or, when the plan sized the slices by
the ranks' speeds (``sp_slices``), cut at those lengths with no padding. Labels were shifted on
the whole sample (``loaders.sequence``), so a target crossing a slice boundary is still right.

Media go whole: an item whose placeholder block overlaps the rank's slice is included with its
full array (an encoder needs the whole image), and its block start is given relative to the
batch, so it may be negative or past the end when the slice holds only part of the block.

This is where decoded numpy becomes torch: samples hold numpy arrays (decoding never imports
torch), each field of the batch is concatenated in numpy -- one copy, as ``torch.cat`` made
-- and wrapped by ``torch.from_numpy`` without another.

Legend: T tokens in the batch, S sequences (samples or slices), R pixel rows (``loaders.pixels``:
a frame of a vision patch each), Q row width, V vision items, A audio items, AF mel frames of
all audio items (rows) x mel bins, M media items.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from omniscale.geometry import MediaGeometry
from omniscale.layout import IGNORE_INDEX
from omniscale.loaders.pixels import row_width
from omniscale.loaders.sequence import DecodedSample, MediaItem
from omniscale.media import AUDIO
from omniscale.plan import rescale_lengths


@dataclass
class PackedBatch:
    """One micro-batch for the backbone and the encoders feeding it."""

    input_ids_T: torch.Tensor  # int64 [T]: token ids; media positions hold their marker's id
    labels_T: torch.Tensor  # int64 [T]: next-token targets, IGNORE_INDEX where none
    position_ids_T: torch.Tensor  # int64 [T]: position within the (unsliced) sample
    mrope_3T: torch.Tensor  # int64 [3, T]: (temporal, height, width) multimodal RoPE positions
    cu_seqlens_S1: torch.Tensor  # int32 [S + 1]: sequence boundaries in T (starts at 0)
    max_seqlen: int  # longest sequence in T (a slice's length for SP samples)
    seq_len_full_S: torch.Tensor  # int64 [S]: the whole sample's length, before SP padding
    seq_sp_size_S: torch.Tensor  # int64 [S]: ranks the sample is split over (1: not split)
    seq_sp_index_S: torch.Tensor  # int64 [S]: which slice this rank holds
    # uint8 [R, Q]: image + video pixel rows, in media order (the model's
    # ``encoders.vision_input.vision_patches`` makes float patches of them on its device)
    pixel_rows_RQ: torch.Tensor
    vision_grid_thw_V3: torch.Tensor  # int64 [V, 3]: each vision item's patch grid
    vision_kind_V: torch.Tensor  # int64 [V]: 0 image, 1 video
    # int64 [V]: each item's rows in pixel_rows_RQ (patches x frames per patch: 1 for an image,
    # temporal_patch_size for a clip)
    vision_rows_V: torch.Tensor
    audio_mel_AF: torch.Tensor  # float16 [sum(audio_frames_A), n_mels]: log-mel frames
    audio_frames_A: torch.Tensor  # int64 [A]: mel frames of each audio item
    media_token_start_M: torch.Tensor  # int64 [M]: block start in T (may lie outside [0, T))
    media_num_tokens_M: torch.Tensor  # int64 [M]: block length
    media_kind_M: torch.Tensor  # int64 [M]: 0 image, 1 video, 2 audio
    media_sample_M: torch.Tensor  # int64 [M]: the sequence (in S) holding the block
    # int64 [M]: the item's row in V (vision) or A (audio); -1 for an item whose pixels or
    # frames were not decoded here (another rank encodes it: ``loaders.decode.DecodeNeed``)
    media_index_M: torch.Tensor
    media_item_M: torch.Tensor  # int64 [M]: the item's index among its sample's items of its kind
    # [S]: the slice lengths of each sequence split by speed (this rank's is one of them; the
    # Ulysses exchange sends and receives that many rows per rank), None where equal or whole
    seq_sp_slices: list | None = None
    # [S]: the query heads each rank of the group attends of a sequence split with heads sized
    # by speed (``sp_heads``), None where H/k each or whole
    seq_sp_heads: list | None = None
    # The SampleRef trained in each sequence (set by loaders.assemble; None when collated
    # without a plan): with media_item_M it names every item as the plan's reshard map does.
    seq_refs: list | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])


def collate(samples: list[tuple], geometry: MediaGeometry | None = None) -> PackedBatch:
    """Pack ``(sample, sp_size, sp_index)`` triples, in order, into one batch; a fourth member,
    the plan's slice lengths of a sample split by speed (``omniscale.plan.RankPlan``), cuts
    the sample at those (scaled to its length when a replacement of another length took its
    place, so every rank of the group cuts it alike); a fifth, the plan's query heads per rank
    of the group (``sp_heads``), goes to the Ulysses exchange as it is.

    ``geometry`` only sets the width of empty media tensors (a batch without images still
    hands the vision encoder a ``[0, D]`` tensor, so every rank runs the same ops).
    """
    ids, labels, pos, mrope = [], [], [], []
    cu, full, sizes, indices, slices_S, heads_S = [0], [], [], [], [], []
    patches, grids, vkinds, mels, frames = [], [], [], [], []
    m_start, m_len, m_kind, m_seq, m_index, m_item = [], [], [], [], [], []
    for s, (sample, sp_size, sp_index, *planned) in enumerate(samples):
        if sp_size < 1 or not 0 <= sp_index < sp_size:
            raise ValueError(f"{sample.source}/{sample.key}: bad SP slice {sp_index} of {sp_size}")
        lengths = planned[0] if planned and sp_size > 1 else None
        if lengths is not None:
            if len(lengths) != sp_size or min(lengths) < 1:
                raise ValueError(f"{sample.source}/{sample.key}: SP slice lengths {lengths} do "
                                 f"not give {sp_size} slices of at least one token")
            lengths = tuple(rescale_lengths(list(lengths), len(sample)))
        slices_S.append(lengths)
        heads_S.append(tuple(planned[1]) if len(planned) > 1 and planned[1] is not None
                       and sp_size > 1 else None)
        lo, hi, parts = _slice(sample, sp_size, sp_index, lengths)
        ids.append(parts[0])
        labels.append(parts[1])
        pos.append(parts[2])
        mrope.append(parts[3])
        seen_of_kind: dict[str, int] = {}
        for item in sample.media:
            index_in_kind = seen_of_kind.get(item.kind, 0)
            seen_of_kind[item.kind] = index_in_kind + 1
            if item.token_start + item.num_tokens <= lo or item.token_start >= hi:
                continue  # its block is on another rank's slice
            m_item.append(index_in_kind)
            if item.array is None:  # not decoded here: another rank encodes it
                m_index.append(-1)
            elif item.kind == "audio":
                m_index.append(len(frames))
                mels.append(item.array)
                frames.append(item.frames)
            else:
                m_index.append(len(grids))
                patches.append(item.array)
                grids.append(item.grid_thw)
                vkinds.append(item.kind_id)
            m_start.append(cu[-1] + item.token_start - lo)
            m_len.append(item.num_tokens)
            m_kind.append(item.kind_id)
            m_seq.append(s)
        cu.append(cu[-1] + hi - lo)
        full.append(len(sample))
        sizes.append(sp_size)
        indices.append(sp_index)
    width = 0 if geometry is None else row_width(geometry)
    n_mels = 0 if geometry is None else geometry.n_mels
    long = torch.int64
    return PackedBatch(
        input_ids_T=_cat(ids, (0,), np.int64), labels_T=_cat(labels, (0,), np.int64),
        position_ids_T=_cat(pos, (0,), np.int64), mrope_3T=_cat(mrope, (3, 0), np.int64, axis=1),
        cu_seqlens_S1=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max((b - a for a, b in zip(cu, cu[1:])), default=0),
        seq_len_full_S=torch.tensor(full, dtype=long),
        seq_sp_size_S=torch.tensor(sizes, dtype=long),
        seq_sp_index_S=torch.tensor(indices, dtype=long),
        pixel_rows_RQ=_cat(patches, (0, width), np.uint8),
        vision_grid_thw_V3=torch.tensor(grids, dtype=long).reshape(-1, 3),
        vision_kind_V=torch.tensor(vkinds, dtype=long),
        vision_rows_V=torch.tensor([p.shape[0] for p in patches], dtype=long),
        audio_mel_AF=_cat(mels, (0, n_mels), np.float16),
        audio_frames_A=torch.tensor(frames, dtype=long),
        media_token_start_M=torch.tensor(m_start, dtype=long),
        media_num_tokens_M=torch.tensor(m_len, dtype=long),
        media_kind_M=torch.tensor(m_kind, dtype=long),
        media_sample_M=torch.tensor(m_seq, dtype=long),
        media_index_M=torch.tensor(m_index, dtype=long),
        media_item_M=torch.tensor(m_item, dtype=long),
        seq_sp_slices=slices_S if any(v is not None for v in slices_S) else None,
        seq_sp_heads=heads_S if any(v is not None for v in heads_S) else None)


def media_tensor(item: MediaItem) -> torch.Tensor | None:
    """A decoded item's array as a tensor over the same memory (None when not decoded here):
    what an encoder item handed to the trainer holds (``loaders.assemble``). A read-only array
    (Ray hands arrays out of its object store read-only) is copied first: a tensor cannot be
    read-only, so one over that memory would let the trainer write where numpy forbids it
    (torch warns so on every Ray-pool run)."""
    if item.array is None:
        return None
    return torch.from_numpy(item.array if item.array.flags.writeable else item.array.copy())


def media_items(batch: PackedBatch):
    """``(sequence, kind id, index within its kind, tensor, grid, frames)`` of every media item
    of a batch, in media order: its rows of ``pixel_rows_RQ`` / ``audio_mel_AF`` (views),
    its grid (vision) or mel frames (audio); tensor, grid and frames None for an item not
    decoded here."""
    vision_rows = batch.vision_rows_V.tolist()
    vision = [0, *itertools.accumulate(vision_rows)]
    audio_rows = batch.audio_frames_A.tolist()
    audio = [0, *itertools.accumulate(audio_rows)]
    for kind, seq, row, index in zip(batch.media_kind_M.tolist(), batch.media_sample_M.tolist(),
                                     batch.media_index_M.tolist(), batch.media_item_M.tolist()):
        if row < 0:
            yield seq, kind, index, None, None, None
        elif kind == AUDIO:
            yield (seq, kind, index, batch.audio_mel_AF[audio[row]:audio[row + 1]], None,
                   audio_rows[row])
        else:
            yield (seq, kind, index, batch.pixel_rows_RQ[vision[row]:vision[row + 1]],
                   batch.vision_grid_thw_V3[row].tolist(), None)


def sp_bounds(length: int, sp_size: int, sp_index: int) -> tuple[int, int]:
    """[lo, hi) of slice ``sp_index`` of a sample of ``length`` tokens padded to a multiple of
    ``sp_size``: every slice has ``ceil(length / sp_size)`` tokens."""
    chunk = -(-length // sp_size)
    return sp_index * chunk, (sp_index + 1) * chunk


def _slice(sample: DecodedSample, sp_size: int, sp_index: int,
           lengths: tuple[int, ...] | None = None):
    """(lo, hi, (ids, labels, positions, mrope)) of this rank's slice of the padded sample, or
    of the sample cut at ``lengths`` (numpy views; the padding, when there is any, a new
    array)."""
    n = len(sample)
    arrays = (sample.input_ids_L, sample.labels_L, sample.position_ids_L, sample.mrope_3L)
    if lengths is not None:
        lo = sum(lengths[:sp_index])
        hi = lo + lengths[sp_index]
        return lo, hi, tuple(a[..., lo:hi] for a in arrays)
    lo, hi = sp_bounds(n, sp_size, sp_index)
    if sp_size == 1:
        return lo, hi, arrays
    pad = sp_size * (hi - lo) - n
    if pad:
        # Padding continues the positions so RoPE stays monotone; its labels train nothing.
        last = int(sample.mrope_3L.max()) + 1 if n else 0
        arrays = (
            np.concatenate([sample.input_ids_L, np.full(pad, sample.pad_id, dtype=np.int64)]),
            np.concatenate([sample.labels_L, np.full(pad, IGNORE_INDEX, dtype=np.int64)]),
            np.concatenate([sample.position_ids_L, np.arange(n, n + pad, dtype=np.int64)]),
            np.concatenate([sample.mrope_3L, np.broadcast_to(
                np.arange(last, last + pad, dtype=np.int64), (3, pad))], axis=1))
    return lo, hi, tuple(a[..., lo:hi] for a in arrays)


def _cat(parts: list[np.ndarray], empty: tuple[int, ...], dtype: type[np.generic],
         axis: int = 0) -> torch.Tensor:
    """The parts concatenated (a new array, so the batch never shares memory with a sample)
    as a tensor of ``dtype`` over the same memory; ``empty``'s shape when there are none."""
    if not parts:
        return torch.from_numpy(np.zeros(empty, dtype=dtype))
    return torch.from_numpy(np.concatenate(parts, axis=axis).astype(dtype, copy=False))
