"""Hand-made source indexes for the catalog and mixer tests: exactly the rows a test needs
(sizes, corrupt rows, empty shards), written the way ``omniscale data index`` writes them: one
row group per shard and per-shard ``rows`` / ``row_group`` in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omniscale.index_schema import INDEX_SCHEMA, INDEX_VERSION, METADATA_KEY, index_path


def rows(shard: str, tokens: list[int], corrupt: frozenset[int] = frozenset()) -> list[dict]:
    """Index rows of one shard: sample ``j`` has key ``<shard>-<j>`` and ``tokens[j]`` LLM
    tokens, a third of them targets (as if a prompt took the rest); rows whose position is in
    ``corrupt`` carry an error."""
    stem = shard.split(".")[0]
    return [{"shard": shard, "key": f"{stem}-{j}", "offset": 512 * j, "size": 512,
             "members": [{"name": f"{stem}-{j}.txt", "offset": 512 * j + 512, "size": 10}],
             "text_tokens": t, "image_patches": [], "video_patches": [], "audio_frames": [],
             "llm_tokens": t, "error": "bad header" if j in corrupt else None,
             "target_tokens": t // 3}
            for j, t in enumerate(tokens)]


def write_index(source_dir: Path, shards: dict[str, list[dict]]) -> Path:
    """Write ``source_dir/_index.parquet`` holding ``shards`` (name -> rows; [] for a shard
    whose samples were all unreadable)."""
    source_dir.mkdir(parents=True, exist_ok=True)
    meta: dict = {"version": INDEX_VERSION, "format": "webdataset", "shards": {}}
    group = 0
    for shard, shard_rows in sorted(shards.items()):
        meta["shards"][shard] = {"rows": len(shard_rows),
                                 "row_group": group if shard_rows else None}
        group += bool(shard_rows)
    schema = INDEX_SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta)})
    with pq.ParquetWriter(index_path(source_dir), schema) as writer:
        for shard, shard_rows in sorted(shards.items()):
            if shard_rows:
                table = pa.Table.from_pylist(shard_rows, schema=schema)
                writer.write_table(table, row_group_size=len(shard_rows))
    return source_dir


def random_source(source_dir: Path, seed: int, shards: int, per_shard: int,
                  max_tokens: int) -> Path:
    """A source of ``shards`` shards of ``per_shard`` samples with random sizes in
    ``[1, max_tokens]`` (no corrupt rows)."""
    rng = np.random.default_rng(seed)
    return write_index(source_dir, {
        f"{source_dir.name}-{s:06d}.tar":
            rows(f"{source_dir.name}-{s:06d}.tar",
                 rng.integers(1, max_tokens + 1, per_shard).tolist())
        for s in range(shards)})
