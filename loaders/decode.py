"""SampleRef -> DecodedSample: read the bytes, decode every member, lay out the sequence.

The decoded sample must be what the plane planned with: its media features (patches per image,
t·h·w per clip, mel frames per clip) and its length equal the ref's, which came from the
index. A mismatch means the shard or the index changed under the plan, and the sample is
refused like any corrupt one rather than silently breaking a token budget or an encoder plan.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from omniscale.dataplane.refs import SampleRef
from omniscale.loaders.decode_audio import decode_audio
from omniscale.loaders.decode_image import decode_image
from omniscale.loaders.decode_text import load_tokenizer, tokenize
from omniscale.loaders.decode_video import decode_video
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.geometry import MediaGeometry, audio_tokens, vision_tokens
from omniscale.loaders.layout import media_order, member_kind, split_member_name
from omniscale.loaders.probe import Corrupt
from omniscale.loaders.readers import RawSample, SampleReader
from omniscale.loaders.sequence import (
    KINDS,
    DecodedSample,
    ItemSlot,
    LayoutError,
    MediaItem,
    build_sequence,
)

_DECODERS = {"image": decode_image, "video": decode_video}


class SampleDecoder:
    """Decodes refs of one dataset (one tokenizer, one media geometry); one per worker."""

    def __init__(self, reader: SampleReader, tokenizer: str | Path, geometry: MediaGeometry
                 ) -> None:
        self.reader = reader
        self.tokenizer = load_tokenizer(tokenizer)
        self.geometry = geometry

    def decode(self, ref: SampleRef) -> DecodedSample:
        """The ref's sample; CorruptSample (``source/key: reason``) for anything wrong."""
        return self.decode_raw(ref, self.reader.read(ref))

    def decode_raw(self, ref: SampleRef, raw: RawSample) -> DecodedSample:
        g, tok = self.geometry, self.tokenizer
        text_data, text_name, found = b"", None, {kind: [] for kind in KINDS}
        for name, data in raw.members:
            suffix = split_member_name(name)[1]
            kind = member_kind(suffix)
            if kind == "text":
                if text_name is not None:
                    raise CorruptSample(ref.source, ref.key, f"member {name!r}: a second text "
                                        f"member (the first is {text_name!r})")
                text_data, text_name = data, name
            elif kind in found:
                found[kind].append((media_order(suffix), name, data))
        items: list[MediaItem] = []
        for kind in KINDS:
            for _, name, data in sorted(found[kind]):
                items.append(self._decode_item(ref, kind, name, data))
        _check_features(ref, items)
        try:
            _, text_ids = tokenize(text_data, tok)
        except Corrupt as e:
            raise CorruptSample(ref.source, ref.key, f"member {text_name!r}: {e}") from None
        slots = [ItemSlot(it.kind, it.num_tokens, _llm_grid(it.grid_thw, g)) for it in items]
        cap = ref.llm_tokens if ref.llm_tokens > 0 and not items else None
        try:
            seq = build_sequence(text_ids, slots, tok, max_tokens=cap)
        except LayoutError as e:
            raise CorruptSample(ref.source, ref.key, f"member {text_name!r}: {e}") from None
        if ref.llm_tokens > 0 and len(seq.input_ids_L) != ref.llm_tokens:
            raise CorruptSample(ref.source, ref.key, f"decodes to {len(seq.input_ids_L)} tokens "
                                f"but the index says {ref.llm_tokens} (stale index?)")
        for item, start in zip(items, seq.token_starts):
            item.token_start = start
        return DecodedSample(ref.source, ref.key, torch.from_numpy(seq.input_ids_L),
                             torch.from_numpy(seq.labels_L), torch.from_numpy(seq.position_ids_L),
                             torch.from_numpy(seq.mrope_3L), tok.pad_id, items)

    def _decode_item(self, ref: SampleRef, kind: str, name: str, data: bytes) -> MediaItem:
        g = self.geometry
        try:
            if kind == "audio":
                mel_FM = decode_audio(data, g)
                frames = int(mel_FM.shape[0])
                return MediaItem(kind, mel_FM, None, frames, -1, audio_tokens(frames))
            vision = _DECODERS[kind](data, g)
            return MediaItem(kind, vision.patches_PD, vision.grid_thw, None, -1,
                             vision_tokens(vision.grid_thw, g))
        except Corrupt as e:
            raise CorruptSample(ref.source, ref.key, f"member {name!r}: {e}") from None


def _llm_grid(grid_thw: tuple[int, int, int] | None, g: MediaGeometry):
    if grid_thw is None:
        return None
    t, h, w = grid_thw
    return t, h // g.merge_size, w // g.merge_size


def _check_features(ref: SampleRef, items: list[MediaItem]) -> None:
    """The decoded media must be the media the ref was planned with (item for item)."""
    if ref.llm_tokens <= 0:
        return  # a hand-made ref without features: nothing to hold it to
    decoded = {"image_patches": [], "video_patches": [], "audio_frames": []}
    for it in items:
        if it.kind == "audio":
            decoded["audio_frames"].append(it.frames)
        else:
            decoded[f"{it.kind}_patches"].append(math.prod(it.grid_thw))
    for column, values in decoded.items():
        planned = list(getattr(ref, column))
        if values != planned:
            raise CorruptSample(ref.source, ref.key, f"decoded {column} {values} but the index "
                                f"says {planned} (stale index or a missing member?)")

