"""Index rows of one shard, for each source format: the unit of work of ``omniscale data index``.

:func:`index_shard` runs in a worker process. It returns the shard's rows (in shard order) as
an Arrow table with :data:`loaders.index_schema.INDEX_SCHEMA`, plus problems that belong to no
sample. A corrupt member never raises: its sample's row carries the reason in ``error``
(``member 'x.jpg': not an image (…)``), and features stay null.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from omniscale.dataplane.errors import UserError
from omniscale.loaders.features import SampleFeatures, sample_features
from omniscale.loaders.geometry import MediaGeometry
from omniscale.loaders.index_schema import INDEX_SCHEMA
from omniscale.loaders.layout import (
    DEFAULT_SPECIAL_TOKENS,
    SpecialTokens,
    media_order,
    member_kind,
)
from omniscale.loaders.probe import Corrupt, decode_text, probe_audio, probe_image, probe_video
from omniscale.loaders.tar_scan import TarMember, TarSample, scan_tar
from omniscale.loaders.text_cost import TokenCounter

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


def index_shard(source_dir: str, shard: str, fmt: str, tokenizer_path: str,
                geometry: dict, shown_as: str,
                special: SpecialTokens = DEFAULT_SPECIAL_TOKENS) -> ShardResult:
    """Rows of ``source_dir/shard``; ``shown_as`` is how messages name the shard."""
    path = Path(source_dir) / shard
    g = MediaGeometry.from_dict(geometry)
    counter = token_counter(tokenizer_path, special)
    try:
        if fmt == "webdataset":
            rows, problems = _tar_rows(path, shard, counter, g)
        elif fmt == "parquet":
            rows, problems = _parquet_rows(path, shard, counter, g, shown_as)
        elif fmt == "jsonl":
            rows, problems = _jsonl_rows(path, shard, counter, g)
        else:
            raise UserError(f"{shown_as}: unknown source format {fmt!r}")
    except (OSError, pa.ArrowException) as e:
        rows, problems = [], [f"unreadable ({' '.join(str(e).split())})"]
    return ShardResult(shard, pa.Table.from_pylist(rows, schema=INDEX_SCHEMA), problems)


def _row(shard: str, key: str, offset: int, size: int, members: Sequence[TarMember] = (),
         features: SampleFeatures | None = None, error: str | None = None,
         text_ids: list[int] | None = None) -> dict:
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
    }


def _tar_rows(path: Path, shard: str, counter: TokenCounter, g: MediaGeometry
              ) -> tuple[list[dict], list[str]]:
    scan = scan_tar(path)
    rows = []
    with open(path, "rb") as f:
        for sample in scan.samples:
            features, error, ids = None, sample.error, None
            if error is None:
                try:
                    features, ids = _tar_sample_features(f, sample, counter, g)
                except Corrupt as e:
                    error = str(e)
            rows.append(_row(shard, sample.key, sample.offset, sample.size, sample.members,
                             features, error, ids))
    return rows, scan.problems


def _tar_sample_features(f, sample: TarSample, counter: TokenCounter, g: MediaGeometry
                         ) -> tuple[SampleFeatures, list[int]]:
    """Probe every member the sequence uses (features and the text's token ids); Corrupt
    names the member at fault."""
    text, text_member = "", None
    grids = {"image": [], "video": []}
    audio_frames: list[int] = []
    for member in sorted(sample.members, key=lambda m: media_order(m.suffix)):
        kind = member_kind(member.suffix)
        if kind in (None, "meta"):
            continue
        try:
            if member.size > MAX_MEMBER_BYTES:
                raise Corrupt(f"{member.size} bytes, above the {MAX_MEMBER_BYTES} the indexer "
                              "reads")
            f.seek(member.offset)
            data = f.read(member.size)
            if kind == "text":
                if text_member is not None:
                    raise Corrupt(f"a second text member (the first is {text_member.name!r})")
                text, text_member = decode_text(data), member
            elif kind == "image":
                grids["image"].append(probe_image(data, g))
            elif kind == "video":
                grids["video"].append(probe_video(data, g))
            else:
                audio_frames.append(probe_audio(data, g))
        except Corrupt as e:
            raise Corrupt(f"member {member.name!r}: {e}") from None
    ids = counter.encode_batch([text])[0]
    try:
        return sample_features(counter.count(ids), text, grids["image"], grids["video"],
                               audio_frames, g, counter.special), ids
    except Corrupt as e:
        # Only a text can hold markers, so a mismatch names the text member.
        raise Corrupt(f"member {text_member.name!r}: {e}") from None


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


def _text_rows(shard: str, records: list[_TextRecord], counter: TokenCounter,
               g: MediaGeometry) -> list[dict]:
    good = [r for r in records if r.error is None]
    for start in range(0, len(good), TEXT_BATCH):
        batch = good[start:start + TEXT_BATCH]
        for record, ids in zip(batch, counter.encode_batch([r.text for r in batch])):
            try:
                record.features = sample_features(counter.count(ids), record.text, [], [], [],
                                                  g, counter.special)
                record.ids = ids
            except Corrupt as e:
                record.error = f"{record.where}: {e}"
    return [_row(shard, r.key, r.offset, r.size, features=r.features,
                 error=r.error, text_ids=r.ids) for r in records]


def _parquet_rows(path: Path, shard: str, counter: TokenCounter, g: MediaGeometry,
                  shown_as: str) -> tuple[list[dict], list[str]]:
    """One row per Parquet row: ``offset`` = row group, ``size`` = row within the group."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
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
            key = str(key) if key is not None else f"{path.stem}-{row_number}"
            records.append(_TextRecord(key, group, row, f"row {row_number}", text,
                                       None if text is not None
                                       else f"row {row_number}: text is null"))
            row_number += 1
    return _text_rows(shard, records, counter, g), []


def _jsonl_rows(path: Path, shard: str, counter: TokenCounter, g: MediaGeometry
                ) -> tuple[list[dict], list[str]]:
    """One row per non-blank line: ``offset``/``size`` = the line's bytes, newline excluded."""
    records = []
    with open(path, "rb") as f:
        position, line_index = 0, 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            start = position
            content = raw.rstrip(b"\r\n")
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                rest, ending = _skip_line(f)
                where = f"line {line_index + 1}"
                records.append(_TextRecord(f"{path.stem}-{line_index}", start,
                                           len(raw) + rest - ending, where, None,
                                           f"{where}: longer than {MAX_LINE_BYTES} bytes"))
                position += rest
            elif content.strip():
                records.append(_jsonl_record(content, start, line_index, path.stem))
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


def _jsonl_record(content: bytes, start: int, line_index: int, stem: str) -> _TextRecord:
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
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        record.error = f"{where}: not an object with a string 'text' field"
        return record
    if obj.get("key") is not None:
        record.key = str(obj["key"])
    record.text = obj["text"]
    return record
