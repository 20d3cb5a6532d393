"""SampleRef -> DecodedSample: read the bytes, decode the members, lay out the sequence.

A :class:`DecodeNeed` narrows the work to what one rank uses of a sample (the encoder plan
moves media between ranks): the media items it encodes are decoded, the items another rank
encodes only probed from their headers (``loaders.probe``: the grid or frame count the layout
needs), and the text only when the rank trains the sample. Whatever is decoded equals a whole
decode's; an item left undecoded has ``array`` None.

The decoded sample must be what the plane planned with: its media features (patches per image,
t·h·w per clip, mel frames per clip) and its length equal the ref's, which came from the
index. A mismatch means the shard or the index changed under the plan, and the sample is
refused like any corrupt one rather than silently breaking a token budget or an encoder plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omniscale.geometry import MediaGeometry, audio_tokens, vision_tokens
from omniscale.layout import (
    DEFAULT_SPECIAL_TOKENS,
    SpecialTokens,
    media_order,
    member_kind,
    split_member_name,
)
from omniscale.loaders.chat import ChatFormat, render_member, targets_mask, token_targets
from omniscale.loaders.decode_audio import decode_audio
from omniscale.loaders.decode_image import decode_image
from omniscale.loaders.decode_text import load_tokenizer, tokenize
from omniscale.loaders.decode_video import decode_video
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.probe import Corrupt, probe_audio, probe_image, probe_video
from omniscale.loaders.readers import RawSample, SampleReader
from omniscale.loaders.sequence import (
    KINDS,
    DecodedSample,
    ItemSlot,
    LayoutError,
    MediaItem,
    build_sequence,
)
from omniscale.loaders.token_ids import TokenIds
from omniscale.refs import SampleRef

_DECODERS = {"image": decode_image, "video": decode_video}
_PROBES = {"image": probe_image, "video": probe_video}


@dataclass(frozen=True)
class DecodeNeed:
    """What a rank uses of one sample: its sequence (``text``: it trains the sample) and the
    media ``items`` it encodes, as (kind, index within the kind). None instead of a need: all."""

    text: bool
    items: frozenset[tuple[str, int]]


class SampleDecoder:
    """Decodes refs of one dataset (one tokenizer, one media geometry); one per worker."""

    def __init__(self, reader: SampleReader, tokenizer: str | Path, geometry: MediaGeometry,
                 token_ids: TokenIds | None = None,
                 special: SpecialTokens = DEFAULT_SPECIAL_TOKENS) -> None:
        self.reader = reader
        self.tokenizer = load_tokenizer(tokenizer, special)
        self.geometry = geometry
        self.token_ids = token_ids  # the index's ids by ref (None: tokenize every text)
        # which sources hold conversations, and their templates: the index metadata says
        self._indexes = token_ids if token_ids is not None else TokenIds(reader.sources)
        self._ready: dict[SampleRef, RawSample | CorruptSample] = {}  # read ahead, not decoded

    def read_ahead(self, refs: list[SampleRef]) -> None:
        """Read a work item's remote refs together (``SampleReader.read_many``: a shard's
        samples in few requests) for the :meth:`decode` calls that follow; what an earlier
        call read and no decode took is dropped. Local refs are read as they are decoded:
        reading them ahead saves nothing and would hold a whole item's bytes at once."""
        ahead = [ref for ref in refs if self.reader.fetches_together(ref)]
        self._ready = dict(zip(ahead, self.reader.read_many(ahead))) if ahead else {}

    def decode(self, ref: SampleRef, need: DecodeNeed | None = None) -> DecodedSample:
        """The ref's sample (what ``need`` asks of it); CorruptSample (``source/key:
        reason``) for anything wrong. Its bytes come from :meth:`read_ahead` when that read
        them, else from the reader now."""
        raw = self._ready.pop(ref, None)
        if isinstance(raw, CorruptSample):
            raise raw
        return self.decode_raw(ref, raw if raw is not None else self.reader.read(ref), need)

    def decode_raw(self, ref: SampleRef, raw: RawSample, need: DecodeNeed | None = None
                   ) -> DecodedSample:
        g, tok = self.geometry, self.tokenizer
        chat = self._indexes.chat(ref.source)
        text_data, text_name, found = b"", None, {kind: [] for kind in KINDS}
        for name, data in raw.members:
            suffix = split_member_name(name)[1]
            kind = member_kind(suffix)
            if chat is not None and kind in ("text", "meta"):  # the messages are the text
                if kind == "text":
                    raise CorruptSample(ref.source, ref.key, f"member {name!r}: a text member "
                                        "in a conversation source")
                text_data, text_name = data, name
            elif kind == "text":
                if text_name is not None:
                    raise CorruptSample(ref.source, ref.key, f"member {name!r}: a second text "
                                        f"member (the first is {text_name!r})")
                text_data, text_name = data, name
            elif kind in found:
                found[kind].append((media_order(suffix), name, data))
        items: list[MediaItem] = []
        for kind in KINDS:
            for index, (_, name, data) in enumerate(sorted(found[kind])):
                if need is None or (kind, index) in need.items:
                    items.append(self._decode_item(ref, kind, name, data))
                elif need.text:  # another rank encodes it; its block still needs a length
                    items.append(self._probe_item(ref, kind, name, data))
                else:
                    items.append(MediaItem(kind, None, None, None, -1, 0))
        _check_features(ref, items)
        if need is not None and not need.text:  # only encoding here: no sequence
            empty = np.zeros(0, dtype=np.int64)
            return DecodedSample(ref.source, ref.key, empty, empty, empty,
                                 np.zeros((3, 0), dtype=np.int64), tok.pad_id, items)
        text_ids = self.token_ids.get(ref) if self.token_ids is not None else None
        targets = None  # every text token
        if chat is not None and text_ids is not None:
            ranges = self.token_ids.targets(ref)
            targets = targets_mask(ranges, len(text_ids)) if ranges is not None else None
        elif chat is not None:  # no ids in the index: render as the index did
            text_ids, targets = self._render(ref, ChatFormat.from_dict(chat), text_data,
                                             text_name)
        elif text_ids is None:
            try:
                _, text_ids = tokenize(text_data, tok)
            except Corrupt as e:
                raise CorruptSample(ref.source, ref.key, f"member {text_name!r}: {e}") from None
        slots = [ItemSlot(it.kind, it.num_tokens, _llm_grid(it.grid_thw, g)) for it in items]
        cap = ref.llm_tokens if ref.llm_tokens > 0 and not items else None
        try:
            seq = build_sequence(text_ids, slots, tok, max_tokens=cap, text_targets=targets)
        except LayoutError as e:
            raise CorruptSample(ref.source, ref.key, f"member {text_name!r}: {e}") from None
        if ref.llm_tokens > 0 and len(seq.input_ids_L) != ref.llm_tokens:
            raise CorruptSample(ref.source, ref.key, f"decodes to {len(seq.input_ids_L)} tokens "
                                f"but the index says {ref.llm_tokens} (stale index?)")
        for item, start in zip(items, seq.token_starts):
            item.token_start = start
        return DecodedSample(ref.source, ref.key, seq.input_ids_L, seq.labels_L,
                             seq.position_ids_L, seq.mrope_3L, tok.pad_id, items)

    def _render(self, ref: SampleRef, chat: ChatFormat, data: bytes, name: str | None):
        """A conversation's (token ids, target mask), as ``shard_index`` makes them."""
        if name is None:
            raise CorruptSample(ref.source, ref.key, "no KEY.json member: a conversation "
                                "sample's text is its messages")
        try:
            rendered = render_member(data, chat, self.tokenizer.special)
        except Corrupt as e:
            raise CorruptSample(ref.source, ref.key, f"member {name!r}: {e}") from None
        encoding = self.tokenizer.tokenizer.encode(rendered.text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        return ids, targets_mask(token_targets(encoding.offsets, rendered.spans), len(ids))

    def _decode_item(self, ref: SampleRef, kind: str, name: str, data: bytes) -> MediaItem:
        g = self.geometry
        try:
            if kind == "audio":
                mel_FM = decode_audio(data, g)
                frames = int(mel_FM.shape[0])
                return MediaItem(kind, mel_FM, None, frames, -1, audio_tokens(frames))
            vision = _DECODERS[kind](data, g)
            return MediaItem(kind, vision.rows_RQ, vision.grid_thw, None, -1,
                             vision_tokens(vision.grid_thw, g))
        except Corrupt as e:
            raise CorruptSample(ref.source, ref.key, f"member {name!r}: {e}") from None

    def _probe_item(self, ref: SampleRef, kind: str, name: str, data: bytes) -> MediaItem:
        """An item's block length (and vision grid) from its headers, as the index had them."""
        g = self.geometry
        try:
            if kind == "audio":
                frames = probe_audio(data, g)
                return MediaItem(kind, None, None, frames, -1, audio_tokens(frames))
            grid = _PROBES[kind](data, g)
            return MediaItem(kind, None, grid, None, -1, vision_tokens(grid, g))
        except Corrupt as e:
            raise CorruptSample(ref.source, ref.key, f"member {name!r}: {e}") from None


def _llm_grid(grid_thw: tuple[int, int, int] | None, g: MediaGeometry):
    if grid_thw is None:
        return None
    t, h, w = grid_thw
    return t, h // g.merge_size, w // g.merge_size


def _check_features(ref: SampleRef, items: list[MediaItem]) -> None:
    """The decoded media must be the media the ref was planned with (item for item; an item
    neither decoded nor probed counts as planned)."""
    if ref.llm_tokens <= 0:
        return  # a hand-made ref without features: nothing to hold it to
    decoded = {"image_patches": [], "video_patches": [], "audio_frames": []}
    seen = {"image": 0, "video": 0, "audio": 0}
    for it in items:
        column = "audio_frames" if it.kind == "audio" else f"{it.kind}_patches"
        index, seen[it.kind] = seen[it.kind], seen[it.kind] + 1
        if it.grid_thw is None and it.frames is None:  # neither decoded nor probed
            planned = getattr(ref, column)
            value = planned[index] if index < len(planned) else None
        else:
            value = it.frames if it.kind == "audio" else math.prod(it.grid_thw)
        decoded[column].append(value)
    for column, values in decoded.items():
        planned = list(getattr(ref, column))
        if values != planned:
            raise CorruptSample(ref.source, ref.key, f"decoded {column} {values} but the index "
                                f"says {planned} (stale index or a missing member?)")

