"""The per-source index file: its name, Arrow schema and metadata, and how to read it.

One Parquet file per source, ``<source dir>/_index.parquet`` (the leading underscore keeps
Parquet dataset readers from mistaking it for data), one row per sample. The data plane plans
from these files alone; it never opens a payload.

Columns:
- ``shard``: shard path relative to the source directory;
- ``key``: the sample's key;
- ``offset``, ``size``: for tar shards the byte range that holds all of the sample's members,
  headers included (a contiguous slice of the tar); for Parquet the row group and the row
  within it; for JSONL the byte range of the line;
- ``members``: tar only, each member's name and the byte range of its data;
- cost features: ``text_tokens`` (non-media tokens, ``<eos>`` included), ``image_patches``
  (patches per image), ``video_patches`` (t·h·w patches per clip), ``audio_frames`` (log-mel
  frames per clip), ``llm_tokens`` (the whole sequence after media expansion);
- ``text_ids``: the text's token ids as the tokenizer encodes them (media markers single
  tokens, no ``<eos>``): the loaders read them by ref instead of tokenizing again
  (``loaders.token_ids``); the plane never reads this column;
- ``target_tokens``: the sequence's tokens the model is trained to predict (labels that are
  not ignored: no media, no conversation prompt); ``text_targets``: a conversation's target
  text tokens as [start, end) ranges of ``text_ids``, flattened (null: every text token);
- ``error``: null for a good sample; for a corrupt one, why (the sample is kept in the index,
  marked, so that audits can account for it, and planners skip it).

File metadata (key ``omniscale``, JSON): index version, source format, the media geometry and
tokenizer fingerprint the features were computed with (a conversation source's chat template
too, ``chat``: the decoders render with it when a sample has no ids), and per shard its
fingerprint (so that a re-index skips unchanged shards), its row count and its row group: each
shard's rows are one row group, so a reader can load one shard's slice without the rest.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from omniscale.errors import UserError
from omniscale.location import Location

INDEX_FILENAME = "_index.parquet"
INDEX_VERSION = 4  # 2: one row group per shard; 3: text_ids; 4: target_tokens, text_targets
METADATA_KEY = b"omniscale"

MEMBER_TYPE = pa.struct([("name", pa.string()), ("offset", pa.int64()), ("size", pa.int64())])

INDEX_SCHEMA = pa.schema([
    ("shard", pa.string()),
    ("key", pa.string()),
    ("offset", pa.int64()),
    ("size", pa.int64()),
    ("members", pa.list_(MEMBER_TYPE)),
    ("text_tokens", pa.int32()),
    ("image_patches", pa.list_(pa.int32())),
    ("video_patches", pa.list_(pa.int32())),
    ("audio_frames", pa.list_(pa.int32())),
    ("llm_tokens", pa.int32()),
    ("text_ids", pa.list_(pa.int32())),
    ("error", pa.string()),
    ("target_tokens", pa.int32()),
    ("text_targets", pa.list_(pa.int32())),
])


def index_path(source_dir: "str | Path | Location") -> Path | str:
    """The index file of a source (or of an ``index_dir`` entry): a Path for local ones, the
    URL (credentials dropped) for remote ones -- what messages name."""
    loc = index_location(source_dir)
    return loc.local_path() if loc.is_local else loc.shown()


def index_location(source_dir: "str | Path | Location") -> Location:
    return Location.of(source_dir).join(INDEX_FILENAME)


def read_index(source_dir: "str | Path | Location", columns: list[str] | None = None
               ) -> pa.Table:
    """The source's index table; a UserError naming the directory if there is none."""
    loc = index_location(source_dir)
    shown = Location.of(source_dir).shown()
    if not loc.is_file():
        raise UserError(f"{shown}: no index ({INDEX_FILENAME}); run `omniscale data index "
                        f"{shown}` first")
    try:
        if loc.is_local:
            return pq.read_table(loc.url, columns=columns)
        with loc.open() as f:
            return pq.read_table(f, columns=columns)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{loc.shown()}: unreadable index ({e}); delete it and re-index"
                        ) from None


def read_index_metadata(source_dir: "str | Path | Location") -> dict:
    """The index's ``omniscale`` metadata, or {} when there is no readable index."""
    loc = index_location(source_dir)
    try:
        if loc.is_local:
            meta = pq.read_schema(loc.url).metadata or {}
        else:
            meta = _remote_index(loc, lambda pf: pf.schema_arrow.metadata) or {}
    except (FileNotFoundError, pa.ArrowInvalid, OSError):
        return {}
    raw = meta.get(METADATA_KEY)
    return json.loads(raw) if raw else {}


def read_shard(source_dir: "str | Path | Location", shard: str, metadata: dict | None = None,
               columns: list[str] | None = None) -> pa.Table:
    """One shard's rows (its row group), without reading the rest of the index."""
    metadata = metadata if metadata is not None else read_index_metadata(source_dir)
    try:
        entry = metadata["shards"][shard]
    except KeyError:
        raise UserError(f"{index_path(source_dir)}: no shard {shard!r} in the index") from None
    if entry.get("row_group") is None:
        return INDEX_SCHEMA.empty_table().select(columns) if columns else INDEX_SCHEMA.empty_table()
    loc = index_location(source_dir)
    try:
        if loc.is_local:
            return pq.ParquetFile(loc.url).read_row_group(entry["row_group"], columns=columns)
        return _remote_index(loc, lambda pf: pf.read_row_group(entry["row_group"],
                                                               columns=columns))
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{index_path(source_dir)}: unreadable index ({e}); delete it and "
                        "re-index") from None


# Remote indexes stay open per process (a bounded LRU): the plane loads a shard's rows and
# each worker its token ids at every shard it reaches, and re-opening costs a HEAD and a
# footer read each time. An index does not change under a running job (the plane keeps its
# metadata from the start anyway); a read that fails drops the handle and opens it afresh.
_MAX_REMOTE_OPEN = 64
_remote_open: "OrderedDict[tuple, tuple[threading.Lock, object, pq.ParquetFile]]" = \
    OrderedDict()
_remote_lock = threading.Lock()


def _remote_index(loc: Location, use):
    """``use(ParquetFile)`` on the cached open index at ``loc`` (one reader at a time: a
    file object's position is not thread-safe); retried once on a fresh handle. Handles are
    per process: a forked worker must not use its parent's (fsspec's async file systems are
    not fork-safe), so the key holds the pid."""
    key = (os.getpid(), loc)
    for attempt in (0, 1):
        with _remote_lock:
            entry = _remote_open.get(key)
            if entry is not None:
                _remote_open.move_to_end(key)
        if entry is None:
            handle = loc.open()
            entry = (threading.Lock(), handle, pq.ParquetFile(handle))
            with _remote_lock:
                _remote_open[key] = entry
                while len(_remote_open) > _MAX_REMOTE_OPEN:
                    (pid, _), old = _remote_open.popitem(last=False)
                    if pid == key[0]:
                        old[1].close()
        lock, _, parquet = entry
        try:
            with lock:
                return use(parquet)
        except (pa.ArrowInvalid, OSError):
            with _remote_lock:
                if _remote_open.get(key) is entry:
                    del _remote_open[key]
            if attempt:
                raise
