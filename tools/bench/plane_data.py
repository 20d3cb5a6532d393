"""Synthetic sources for the plane benchmark: many source indexes written fast, no payloads.

Each source gets ``_index.parquet`` as ``omniscale data index`` writes it
(``omniscale/index_schema.py``, version 4: the index schema, one row group per shard,
per-shard ``rows``/``row_group`` in the metadata) with random but valid text rows: one tar
member per sample, ``llm_tokens`` in ``[1, max_tokens]``, every token a target, no media, no
corrupt rows. The columns are built as Arrow arrays directly, so a thousand sources of
100 x 1,000 samples take minutes, not hours. The plane reads only these files, so nothing
else needs to exist.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from omniscale.index_schema import (
    INDEX_SCHEMA,
    INDEX_VERSION,
    MEMBER_TYPE,
    METADATA_KEY,
    index_path,
)


def _empty_lists(n: int) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)),
                                    pa.array([], pa.int32()))


def write_source(source_dir: Path, shards: int, per_shard: int, max_tokens: int,
                 rng: np.random.Generator) -> None:
    """One source of ``shards`` shards of ``per_shard`` text samples."""
    source_dir.mkdir(parents=True, exist_ok=True)
    n = shards * per_shard
    stems = np.array([f"{source_dir.name}-{s:06d}" for s in range(shards)])
    shard_N = np.repeat(np.char.add(stems, ".tar"), per_shard)
    j_N = np.tile(np.arange(per_shard), shards)
    key_N = np.char.add(np.char.add(np.repeat(stems, per_shard), "-"), j_N.astype(str))
    offset_N = (512 * j_N).astype(np.int64)
    tokens_N = rng.integers(1, max_tokens + 1, n).astype(np.int32)
    members = pa.StructArray.from_arrays(
        [pa.array(np.char.add(key_N, ".txt")), pa.array(offset_N + 512),
         pa.array(np.full(n, 10, np.int64))], fields=list(MEMBER_TYPE))
    columns = {
        "shard": pa.array(shard_N), "key": pa.array(key_N), "offset": pa.array(offset_N),
        "size": pa.array(np.full(n, 512, np.int64)),
        "members": pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), members),
        "text_tokens": pa.array(tokens_N), "image_patches": _empty_lists(n),
        "video_patches": _empty_lists(n), "audio_frames": _empty_lists(n),
        "llm_tokens": pa.array(tokens_N), "text_ids": pa.nulls(n, pa.list_(pa.int32())),
        "error": pa.nulls(n, pa.string()),
        # index v4: plain text trains on every token; null text_targets means "all of them"
        "target_tokens": pa.array(tokens_N), "text_targets": pa.nulls(n, pa.list_(pa.int32()))}
    meta = {"version": INDEX_VERSION, "format": "webdataset",
            "shards": {f"{stem}.tar": {"rows": per_shard, "row_group": i}
                       for i, stem in enumerate(stems)}}
    schema = INDEX_SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta)})
    table = pa.Table.from_arrays([columns[f.name].cast(f.type) for f in INDEX_SCHEMA],
                                 schema=schema)
    pq.write_table(table, index_path(source_dir), row_group_size=per_shard)


def write_sources(root: Path, sources: int, shards: int, per_shard: int,
                  max_tokens: int = 4096, seed: int = 0) -> list[str]:
    """``sources`` sources under ``root/src-XXXX`` (reused if already there); their names."""
    rng = np.random.default_rng(seed)
    names = [f"src-{i:04d}" for i in range(sources)]
    for name in names:
        if not index_path(root / name).is_file():
            write_source(root / name, shards, per_shard, max_tokens, rng)
    (root / "tokenizer.json").touch()
    return names


RAMP_TOKENS = 10**15  # a ramp longer than any run of a bench: every step drawn inside it


def write_spec(path: Path, names: list[str], seed: int = 0, ramp: bool = False) -> Path:
    """A spec over ``names`` (directories beside it) at equal weight, counted in samples --
    or, with ``ramp``, a curriculum: a linear schedule over tokens from equal weights to
    weights 1, 2, 3, 4, 1, ... over :data:`RAMP_TOKENS` (every draw moves the mixture)."""
    spec = {"seed": seed, "tokenizer": "tokenizer.json", "accounting": "samples",
            "on_exhausted": "next_epoch",
            "sources": [{"name": n, "path": n, "format": "webdataset", "template": "text",
                         **({} if ramp else {"weight": 1})} for n in names]}
    if ramp:
        spec["schedule"] = {"unit": "tokens", "segments": [
            {"kind": "linear", "start": 0, "end": RAMP_TOKENS, "from": dict.fromkeys(names, 1),
             "to": {n: 1 + i % 4 for i, n in enumerate(names)}},
            {"kind": "const", "start": RAMP_TOKENS, "end": None,
             "weights": {n: 1 + i % 4 for i, n in enumerate(names)}}]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
