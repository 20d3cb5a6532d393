"""One sample's LLM sequence: placeholder expansion, shifted labels, 1-D and 3-axis positions.

The layout rule is ``omniscale.layout``'s: a placeholder block for every media item the text
does not mark (in item order), the text with every marker expanded to its item's block, then
``<eos>``. A block is as long as its encoder's output (``geometry.vision_tokens`` /
``geometry.audio_tokens``) and filled with the marker's own id, so the backbone finds where to
scatter embeddings by id alone.

Labels are shifted here, per sample, before any packing or sequence-parallel slicing: the
target of the last token of a slice is the first token of the next slice, which only the
whole sample knows.

A decoded sample holds numpy arrays: decoding never imports torch, and the micro-batch becomes
tensors where it is packed (``loaders.collate``).

Legend: L tokens of the sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from omniscale.layout import IGNORE_INDEX
from omniscale.loaders.decode_text import TextTokenizer
from omniscale.media import MEDIA_KINDS as KINDS
from omniscale.media import kind_id

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class ItemSlot:
    """What the layout needs of one media item: its kind, block length and LLM grid.

    ``llm_grid`` is the vision grid after merging (``(t, h/merge, w/merge)``), None for audio.
    """

    kind: str
    num_tokens: int
    llm_grid: tuple[int, int, int] | None = None


@dataclass
class MediaItem:
    """A decoded media item and where its placeholder block sits in the sample."""

    kind: str  # "image" | "video" | "audio"
    # vision: uint8 pixel rows [R, Q] (``loaders.pixels``); audio: float16 log-mel
    # [frames, n_mels]; None when not decoded here (``loaders.decode.DecodeNeed``: another
    # rank encodes it)
    array: np.ndarray | None
    grid_thw: tuple[int, int, int] | None  # vision patch grid; None for audio
    frames: int | None  # audio mel frames; None for vision
    token_start: int  # first position of the block in the sample
    num_tokens: int  # block length

    @property
    def kind_id(self) -> int:
        return kind_id(self.kind)


@dataclass
class DecodedSample:
    """A sample ready to pack: its sequence and its media items in item order
    (``omniscale.plan.item_kinds``: images, then videos, then audio clips)."""

    source: str
    key: str
    input_ids_L: np.ndarray  # int64
    labels_L: np.ndarray  # int64, pre-shifted, IGNORE_INDEX on media, their targets, the end
    position_ids_L: np.ndarray  # int64, 0..L-1
    mrope_3L: np.ndarray  # int64, (temporal, height, width) positions for multimodal RoPE
    pad_id: int
    media: list[MediaItem] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.input_ids_L.shape[0])


@dataclass(frozen=True)
class Sequence:
    """The arrays of one laid-out sample; ``token_starts[i]`` is item i's block start."""

    input_ids_L: np.ndarray
    labels_L: np.ndarray
    position_ids_L: np.ndarray
    mrope_3L: np.ndarray
    token_starts: list[int]
    full_length: int  # before truncation


class LayoutError(ValueError):
    """The text's markers do not fit the media items, or a cap would cut a media block."""


def build_sequence(text_ids: np.ndarray, items: list[ItemSlot], tok: TextTokenizer,
                   max_tokens: int | None = None, text_targets: np.ndarray | None = None
                   ) -> Sequence:
    """Lay out one sample (see the module docstring); truncate to ``max_tokens`` if given.

    ``text_targets`` (bool per text id; None: all) says which text tokens the model is trained
    to predict (a conversation's assistant turns, ``loaders.chat``); ``<eos>`` is a target when
    the text's last token is.

    Truncation exists for long text-only documents the plane capped; cutting into or past a
    media block raises LayoutError, because the encoder's output would no longer fit.
    """
    text_ids = np.asarray(text_ids, dtype=np.int64)
    every = text_targets is None
    text_targets = np.ones(len(text_ids), bool) if every else np.asarray(text_targets, bool)
    if len(text_targets) != len(text_ids):
        raise LayoutError(f"{len(text_targets)} target flags for {len(text_ids)} text tokens")
    eos_target = bool(text_targets[-1]) if len(text_targets) else every
    pieces = _pieces(text_ids, text_targets, eos_target, items, tok)
    input_ids, is_media, is_target, mrope_3L, token_starts = _lay_out(pieces, items, tok)
    full = len(input_ids)
    if max_tokens is not None and max_tokens < full:
        if any(s + it.num_tokens > max_tokens for s, it in zip(token_starts, items)):
            raise LayoutError(f"a cap of {max_tokens} tokens would cut a media block "
                              f"(the sample has {full})")
        input_ids, is_media, is_target, mrope_3L = (
            input_ids[:max_tokens], is_media[:max_tokens], is_target[:max_tokens],
            mrope_3L[:, :max_tokens])
    return Sequence(input_ids, shifted_labels(input_ids, is_media, is_target),
                    np.arange(len(input_ids), dtype=np.int64), np.ascontiguousarray(mrope_3L),
                    token_starts, full)


def _pieces(text_ids: np.ndarray, text_targets: np.ndarray, eos_target: bool,
            items: list[ItemSlot], tok: TextTokenizer) -> list[tuple[str, object]]:
    """The sample in order: ``("text", (ids, target flags))`` runs and ``("item", index)``
    blocks -- unmarked items first, then the text with each marker replaced by its item,
    ``<eos>`` last. A marker count that differs from the items of its kind raises."""
    by_kind = {kind: [i for i, it in enumerate(items) if it.kind == kind] for kind in KINDS}
    marked = {}
    for kind in KINDS:
        markers = int((text_ids == tok.marker_ids[kind]).sum())
        if markers and markers != len(by_kind[kind]):
            raise LayoutError(f"text has {markers} {kind} marker(s) but the sample has "
                              f"{len(by_kind[kind])} {kind} item(s)")
        marked[kind] = markers > 0
    pieces: list[tuple[str, object]] = [("item", i) for i, it in enumerate(items)
                                        if not marked[it.kind]]
    marker_kind = {tok.marker_ids[k]: k for k in KINDS if marked[k]}
    next_of = {kind: iter(by_kind[kind]) for kind in KINDS}
    at = np.flatnonzero(np.isin(text_ids, list(marker_kind))) if marker_kind else []
    start = 0
    for pos in at:
        pieces.append(("text", (text_ids[start:pos], text_targets[start:pos])))
        pieces.append(("item", next(next_of[marker_kind[int(text_ids[pos])]])))
        start = pos + 1
    pieces.append(("text", (np.append(text_ids[start:], tok.eos_id),
                            np.append(text_targets[start:], eos_target))))
    return pieces


def _lay_out(pieces: list[tuple[str, object]], items: list[ItemSlot], tok: TextTokenizer):
    """The pieces as arrays: ids, media and target flags, multimodal RoPE positions [3, L],
    and each item's first position."""
    ids, media, mrope, targets = [], [], [], []
    token_starts = [0] * len(items)
    length, running = 0, 0  # tokens so far; next multimodal RoPE position
    for what, value in pieces:
        if what == "text":
            value, wanted = value
            n = len(value)
            ids.append(value)
            targets.append(wanted)
            media.append(np.zeros(n, bool))
            mrope.append(np.broadcast_to(np.arange(running, running + n), (3, n)))
            running += n
        else:
            item = items[value]
            n = item.num_tokens
            token_starts[value] = length
            ids.append(np.full(n, tok.marker_ids[item.kind], np.int64))
            targets.append(np.zeros(n, bool))
            media.append(np.ones(n, bool))
            block = _block_positions(item, running)
            mrope.append(block)
            running = int(block.max()) + 1 if n else running
        length += n
    return (np.concatenate(ids), np.concatenate(media), np.concatenate(targets),
            np.concatenate(mrope, axis=1).astype(np.int64), token_starts)


def shifted_labels(input_ids_L: np.ndarray, is_media_L: np.ndarray,
                   is_target_L: np.ndarray | None = None) -> np.ndarray:
    """``labels[t] = input_ids[t+1]``; IGNORE_INDEX at the end, on media, on targets that are
    media (placeholders are inputs the model cannot predict), and on tokens that are no
    target (``is_target_L`` False: a conversation's prompt)."""
    labels = np.full(len(input_ids_L), IGNORE_INDEX, np.int64)
    wanted = ~is_media_L[1:] if is_target_L is None else ~is_media_L[1:] & is_target_L[1:]
    labels[:-1] = np.where(wanted, input_ids_L[1:], IGNORE_INDEX)
    labels[is_media_L] = IGNORE_INDEX
    return labels


def _block_positions(item: ItemSlot, start: int) -> np.ndarray:
    """Multimodal RoPE positions [3, n] of one block starting at position ``start``.

    Qwen2-VL: a vision block's tokens get (t, row, col) indices of the merged grid, offset by
    the running position; audio advances like text.
    """
    n = item.num_tokens
    if item.llm_grid is None:
        return np.broadcast_to(np.arange(start, start + n), (3, n))
    t, h, w = item.llm_grid
    if t * h * w != n:
        raise LayoutError(f"{item.kind} grid {item.llm_grid} has {t * h * w} tokens, not {n}")
    t_idx, h_idx, w_idx = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([t_idx.ravel(), h_idx.ravel(), w_idx.ravel()]) + start
