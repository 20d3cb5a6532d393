"""Index rows of one shard, for each source format: the unit of work of ``omniscale data index``.

:func:`index_shard` runs in a worker process. It returns the shard's rows (in shard order) as
an Arrow table with :data:`omniscale.index_schema.INDEX_SCHEMA`, plus problems that belong to no
sample. A corrupt member never raises: its sample's row carries the reason in ``error``
(``member 'x.jpg': not an image (…)``), and features stay null.

The shard may be local or in an object store (a :class:`omniscale.location.Location`): a tar
shard is then read in place with ranged reads (``loaders.ranged_file``) -- its headers, its
text members and the header bytes of its images and audio; a video member whole (its index
atom may sit at its end), never the whole shard.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from omniscale.errors import UserError
from omniscale.geometry import MediaGeometry, audio_tokens, vision_tokens
from omniscale.index_schema import INDEX_SCHEMA
from omniscale.layout import (
    DEFAULT_SPECIAL_TOKENS,
    IGNORE_INDEX,
    SpecialTokens,
    media_order,
    member_kind,
)
from omniscale.loaders.chat import ChatFormat, render, render_member, targets_mask, token_targets
from omniscale.loaders.features import SampleFeatures, sample_features
from omniscale.loaders.probe import Corrupt, decode_text, probe_audio, probe_image, probe_video
from omniscale.loaders.ranged_file import MemberFile, open_shard
from omniscale.loaders.sequence import ItemSlot, LayoutError, build_sequence
from omniscale.loaders.tar_scan import TarMember, TarSample, scan_tar_file
from omniscale.loaders.text_cost import TokenCounter
from omniscale.location import Location

# Members are probed from memory; anything larger is no single training item.
MAX_MEMBER_BYTES = 1 << 30
MAX_LINE_BYTES = 64 << 20
TEXT_BATCH = 1024


@dataclass
class ShardResult:
    """One shard's index rows and the problems that have no row (e.g. "not a tar")."""

    shard: str
    table: pa.Table
    problems: list[str]


@functools.lru_cache(maxsize=4)
def token_counter(tokenizer_path: str, special: SpecialTokens) -> TokenCounter:
    """The tokenizer, loaded once per worker process (a real one takes a while to parse)."""
    return TokenCounter.from_file(tokenizer_path, special)


def index_shard(source_dir: str | Location, shard: str, fmt: str, tokenizer_path: str,
                geometry: dict, shown_as: str,
                special: SpecialTokens = DEFAULT_SPECIAL_TOKENS,
                chat: dict | None = None, size: int | None = None) -> ShardResult:
    """Rows of ``source_dir/shard``; ``shown_as`` is how messages name the shard; ``chat``
    (a ``ChatFormat.to_dict()``): a conversation source's samples; ``size``: the shard's
    size when the listing said it (a remote shard then costs no request to learn it)."""
    loc = Location.of(source_dir).join(shard)
    g = MediaGeometry.from_dict(geometry)
    counter = token_counter(tokenizer_path, special)
    conversation = ChatFormat.from_dict(chat) if chat is not None else None
    if fmt not in ("webdataset", "parquet", "jsonl"):
        raise UserError(f"{shown_as}: unknown source format {fmt!r}")
    try:
        with open_shard(loc, size) as (f, file_size):
            if fmt == "webdataset":
                rows, problems = _tar_rows(f, file_size, shard, counter, g, conversation)
            elif fmt == "parquet":
                rows, problems = _parquet_rows(loc.url if loc.is_local else f, loc.name,
                                               shard, counter, g, shown_as)
            else:
                rows, problems = _jsonl_rows(f, loc.name, shard, counter, g, conversation)
    except (OSError, pa.ArrowException) as e:
        rows, problems = [], [f"unreadable ({' '.join(str(e).split())})"]
    return ShardResult(shard, pa.Table.from_pylist(rows, schema=INDEX_SCHEMA), problems)


def _row(shard: str, key: str, offset: int, size: int, members: Sequence[TarMember] = (),
         features: SampleFeatures | None = None, error: str | None = None,
         text_ids: list[int] | None = None, targets: list[tuple[int, int]] | None = None
         ) -> dict:
    f = features
    return {
        "shard": shard, "key": key, "offset": offset, "size": size,
        "members": [{"name": m.name, "offset": m.offset, "size": m.size} for m in members],
        "text_tokens": f.text_tokens if f else None,
        "image_patches": f.image_patches if f else [],
        "video_patches": f.video_patches if f else [],
        "audio_frames": f.audio_frames if f else [],
        "llm_tokens": f.llm_tokens if f else None,
        "text_ids": text_ids if f else None,
        "error": error,
        "target_tokens": f.target_tokens if f else None,
        "text_targets": [i for r in targets for i in r] if f and targets is not None else None,
    }


def target_tokens(counter: TokenCounter, ids: list[int], targets, grids: dict[str, list],
                  audio_frames: list[int], g: MediaGeometry) -> int:
    """How many of the sample's labels are targets: the sequence laid out as the decoders lay
    it out (``loaders.sequence``), its labels counted. ``targets``: a conversation's target
    token ranges, None for every text token."""
    if targets is None and not audio_frames and not grids["image"] and not grids["video"]:
        return len(ids)  # plain text: every token after the first, then <eos>
    slots = [ItemSlot(kind, vision_tokens(grid, g),
                      (grid[0], grid[1] // g.merge_size, grid[2] // g.merge_size))
             for kind in ("image", "video") for grid in grids[kind]]
    slots += [ItemSlot("audio", audio_tokens(frames)) for frames in audio_frames]
    mask = None if targets is None else targets_mask(targets, len(ids))
    try:
        seq = build_sequence(ids, slots, counter.loaded, text_targets=mask)
    except LayoutError as e:
        raise Corrupt(str(e)) from None
    return int((seq.labels_L != IGNORE_INDEX).sum())


def _tar_rows(f, file_size: int, shard: str, counter: TokenCounter, g: MediaGeometry,
              chat: ChatFormat | None = None) -> tuple[list[dict], list[str]]:
    scan = scan_tar_file(f, file_size)
    rows = []
    for sample in scan.samples:
        features, error, ids, targets = None, sample.error, None, None
        if error is None:
            try:
                features, ids, targets = _tar_sample_features(f, sample, counter, g, chat)
            except Corrupt as e:
                error = str(e)
        rows.append(_row(shard, sample.key, sample.offset, sample.size, sample.members,
                         features, error, ids, targets))
    return rows, scan.problems


def _tar_sample_features(f, sample: TarSample, counter: TokenCounter, g: MediaGeometry,
                         chat: ChatFormat | None = None):
    """Probe every member the sequence uses: (features, the text's token ids, a
    conversation's target token ranges or None); Corrupt names the member at fault."""
    text, text_member, rendered = "", None, None
    grids = {"image": [], "video": []}
    audio_frames: list[int] = []
    for member in sorted(sample.members, key=lambda m: media_order(m.suffix)):
        kind = member_kind(member.suffix)
        if kind is None or (kind == "meta" and chat is None):
            continue
        try:
            if member.size > MAX_MEMBER_BYTES:
                raise Corrupt(f"{member.size} bytes, above the {MAX_MEMBER_BYTES} the indexer "
                              "reads")
            member_file = MemberFile(f, member.offset, member.size)
            if kind in ("text", "meta"):
                data = member_file.read()
                if text_member is not None:
                    raise Corrupt(f"a second text member (the first is {text_member.name!r})")
                if chat is not None and kind == "text":
                    raise Corrupt("a text member in a conversation source (the sample's text "
                                  "is its KEY.json messages)")
                if chat is not None:
                    rendered = render_member(data, chat, counter.special)
                    text = rendered.text
                else:
                    text = decode_text(data)
                text_member = member
            elif kind == "image":  # PIL and soundfile read the header they parse
                grids["image"].append(probe_image(member_file, g))
            elif kind == "video":
                grids["video"].append(probe_video(member_file.read(), g))
            else:
                audio_frames.append(probe_audio(member_file, g))
        except Corrupt as e:
            raise Corrupt(f"member {member.name!r}: {e}") from None
    if chat is not None and rendered is None:
        raise Corrupt("no KEY.json member: a conversation sample's text is its messages")
    encoding = counter.encodings([text])[0]
    ids = encoding.ids
    targets = token_targets(encoding.offsets, rendered.spans) if rendered else None
    try:
        features = sample_features(counter.count(ids), text, grids["image"], grids["video"],
                                   audio_frames, g, counter.special)
        features.target_tokens = target_tokens(counter, ids, targets, grids, audio_frames, g)
        return features, ids, targets
    except Corrupt as e:
        # Only a text can hold markers, so a mismatch names the text member.
        raise Corrupt(f"member {text_member.name if text_member else sample.key!r}: {e}"
                      ) from None


@dataclass
class _TextRecord:
    """A text-only sample awaiting its token count (tokenized in batches)."""

    key: str
    offset: int
    size: int
    where: str  # "row 12" / "line 5": how messages name it
    text: str | None
    error: str | None = None
    features: SampleFeatures | None = None
    ids: list[int] | None = None
    spans: tuple | None = None  # a conversation's target character spans
    targets: list[tuple[int, int]] | None = None


def _text_rows(shard: str, records: list[_TextRecord], counter: TokenCounter,
               g: MediaGeometry) -> list[dict]:
    good = [r for r in records if r.error is None]
    for start in range(0, len(good), TEXT_BATCH):
        batch = good[start:start + TEXT_BATCH]
        for record, encoding in zip(batch, counter.encodings([r.text for r in batch])):
            ids = encoding.ids
            try:
                if record.spans is not None:
                    record.targets = token_targets(encoding.offsets, record.spans)
                record.features = sample_features(counter.count(ids), record.text, [], [], [],
                                                  g, counter.special)
                record.features.target_tokens = target_tokens(
                    counter, ids, record.targets, {"image": [], "video": []}, [], g)
                record.ids = ids
            except Corrupt as e:
                record.error = f"{record.where}: {e}"
    return [_row(shard, r.key, r.offset, r.size, features=r.features,
                 error=r.error, text_ids=r.ids, targets=r.targets) for r in records]


def _parquet_rows(source, filename: str, shard: str, counter: TokenCounter, g: MediaGeometry,
                  shown_as: str) -> tuple[list[dict], list[str]]:
    """One row per Parquet row: ``offset`` = row group, ``size`` = row within the group.
    ``source``: a local path, or a file over the object (only the footer and the text and key
    columns are read)."""
    import pyarrow.parquet as pq

    stem = Path(filename).stem
    try:
        parquet = pq.ParquetFile(source)
    except pa.ArrowException as e:
        return [], [f"not a Parquet file ({' '.join(str(e).split())})"]
    schema = parquet.schema_arrow
    field = schema.field("text") if "text" in schema.names else None
    if field is None or not (pa.types.is_string(field.type)
                             or pa.types.is_large_string(field.type)):
        what = "no 'text' column" if field is None else f"column 'text' is {field.type}"
        raise UserError(f"{shown_as}: {what}; a Parquet source needs a string column 'text'")
    columns = ["text"] + (["key"] if "key" in schema.names else [])
    records, row_number = [], 0
    for group in range(parquet.num_row_groups):
        table = parquet.read_row_group(group, columns=columns)
        texts = table.column("text").to_pylist()
        keys = table.column("key").to_pylist() if "key" in columns else [None] * len(texts)
        for row, (text, key) in enumerate(zip(texts, keys)):
            key = str(key) if key is not None else f"{stem}-{row_number}"
            records.append(_TextRecord(key, group, row, f"row {row_number}", text,
                                       None if text is not None
                                       else f"row {row_number}: text is null"))
            row_number += 1
    return _text_rows(shard, records, counter, g), []


def _jsonl_rows(raw, filename: str, shard: str, counter: TokenCounter, g: MediaGeometry,
                chat: ChatFormat | None = None) -> tuple[list[dict], list[str]]:
    """One row per non-blank line: ``offset``/``size`` = the line's bytes, newline excluded."""
    stem = Path(filename).stem
    records = []
    # Buffered, for readline; on a remote shard the reads carry on, so the ranges widen.
    with io.BufferedReader(raw, 1 << 20) if isinstance(raw, io.RawIOBase) else \
            contextlib.nullcontext(raw) as f:
        position, line_index = 0, 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            start = position
            content = raw.rstrip(b"\r\n")
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                rest, ending = _skip_line(f)
                where = f"line {line_index + 1}"
                records.append(_TextRecord(f"{stem}-{line_index}", start,
                                           len(raw) + rest - ending, where, None,
                                           f"{where}: longer than {MAX_LINE_BYTES} bytes"))
                position += rest
            elif content.strip():
                records.append(_jsonl_record(content, start, line_index, stem, chat,
                                             counter.special))
            position += len(raw)
            line_index += 1
    return _text_rows(shard, records, counter, g), []


def _skip_line(f) -> tuple[int, int]:
    """Consume the rest of an over-long line: (bytes consumed, bytes of its line ending)."""
    consumed, tail = 0, b""
    while chunk := f.readline(1 << 20):
        consumed += len(chunk)
        tail = (tail + chunk)[-2:]
        if chunk.endswith(b"\n"):
            break
    return consumed, len(tail) - len(tail.rstrip(b"\r\n"))


def _jsonl_record(content: bytes, start: int, line_index: int, stem: str,
                  chat: ChatFormat | None = None,
                  special: SpecialTokens = DEFAULT_SPECIAL_TOKENS) -> _TextRecord:
    where = f"line {line_index + 1}"
    record = _TextRecord(f"{stem}-{line_index}", start, len(content), where, None)
    try:
        obj = json.loads(decode_text(content))
    except Corrupt as e:
        record.error = f"{where}: {e}"
        return record
    except ValueError as e:
        record.error = f"{where}: not JSON ({e})"
        return record
    if chat is not None and isinstance(obj, dict) and "messages" in obj:
        try:
            rendered = render(obj["messages"], chat, special)
        except Corrupt as e:
            record.error = f"{where}: {e}"
            return record
        if any(rendered.media.values()):
            record.error = f"{where}: media parts in a JSONL conversation (media need a " \
                           "webdataset source, where they are members beside the messages)"
            return record
        record.text, record.spans = rendered.text, rendered.spans
    elif chat is not None:
        record.error = f"{where}: not an object with 'messages'"
        return record
    elif not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        record.error = f"{where}: not an object with a string 'text' field"
        return record
    else:
        record.text = obj["text"]
    if obj.get("key") is not None:
        record.key = str(obj["key"])
    return record
