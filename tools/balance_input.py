"""Samples for ``omniscale balance simulate``: read from a lengths file or drawn from a generator.

A lengths file is Parquet or JSONL with an ``llm_tokens`` column and optionally
``encoder_patches`` (a list of image patch counts per sample). A source index
(``_index.parquet``) works too: its ``image_patches``, ``video_patches`` and ``audio_frames``
become encoder items, and rows whose ``error`` is set (corrupt samples) are skipped, as the
data plane skips them. ``row_N`` keeps each sample's row in the file so a plan can name it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omniscale.balancer.distributions import DISTRIBUTIONS, generate
from omniscale.balancer.stream import steps_by_count, steps_by_tokens, take
from omniscale.balancer.types import WindowSamples
from omniscale.errors import UserError
from omniscale.media import MEDIA_KINDS

PATCHES_PER_TOKEN = 4  # 2×2 spatial merge
FRAMES_PER_TOKEN = 4  # mel frames per audio token
# column -> (encoder kind, encoder input units per LLM token)
ITEM_COLUMNS = {
    "encoder_patches": ("image", PATCHES_PER_TOKEN),
    "image_patches": ("image", PATCHES_PER_TOKEN),
    "video_patches": ("video", PATCHES_PER_TOKEN),
    "audio_frames": ("audio", FRAMES_PER_TOKEN),
}


def read_table(path: Path) -> pa.Table:
    """The file as an Arrow table: Parquet by suffix, JSONL otherwise; UserError if unreadable."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        import pyarrow.json as pj

        return pj.read_json(path)
    except (pa.ArrowInvalid, OSError) as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path}: unreadable ({first_line})") from None


def load_lengths(path: Path) -> tuple[WindowSamples, np.ndarray]:
    """(samples in file order, the file row of each); corrupt index rows left out."""
    table = read_table(path)
    if "llm_tokens" not in table.column_names:
        raise UserError(f"{path}: no llm_tokens column")
    row_N = np.arange(table.num_rows, dtype=np.int64)
    if "error" in table.column_names:
        good = pc.is_null(table["error"])
        row_N = row_N[good.to_numpy(zero_copy_only=False)]
        table = table.filter(good)
    tokens = table["llm_tokens"]
    if tokens.null_count:
        bad = int(np.flatnonzero(pc.is_null(tokens).to_numpy(zero_copy_only=False))[0])
        raise UserError(f"{path}: row {row_N[bad]}: llm_tokens is missing")
    try:
        tokens_N = tokens.to_numpy(zero_copy_only=False).astype(np.int64)
    except (TypeError, ValueError, pa.ArrowInvalid):
        raise UserError(f"{path}: llm_tokens must be integers") from None
    if len(tokens_N) and tokens_N.min() <= 0:
        bad = int(np.argmin(tokens_N))
        raise UserError(f"{path}: row {row_N[bad]}: llm_tokens must be > 0, got {tokens_N[bad]}")
    columns = [c for c in ITEM_COLUMNS if c in table.column_names]
    if "encoder_patches" in columns and len(columns) > 1:
        columns.remove("encoder_patches")  # an index names its items by kind
    return _with_items(path, table, tokens_N, columns), row_N


def _with_items(path: Path, table: pa.Table, tokens_N: np.ndarray,
                columns: list[str]) -> WindowSamples:
    """Samples with the listed columns' lists as encoder items, in column order per sample."""
    n = len(tokens_N)
    count_CN, size_CM = [], []
    for column in columns:
        values = table[column]
        if not pa.types.is_list(values.type) and not pa.types.is_large_list(values.type):
            raise UserError(f"{path}: {column} must be a list of integers per row")
        count_CN.append(pc.fill_null(pc.list_value_length(values), 0)
                        .to_numpy(zero_copy_only=False).astype(np.int64))
        flat = pc.list_flatten(values).to_numpy(zero_copy_only=False)
        size_CM.append(np.asarray(flat, dtype=np.int64) if len(flat) else np.zeros(0, np.int64))
        if len(flat) and size_CM[-1].min() <= 0:
            raise UserError(f"{path}: {column}: sizes must be > 0")
    per_row_N = np.sum(count_CN, axis=0) if columns else np.zeros(n, np.int64)
    offsets_N1 = np.concatenate([[0], np.cumsum(per_row_N)]).astype(np.int64)
    m = int(offsets_N1[-1])
    size_M, kind_M, item_tokens_M = (np.zeros(m, np.int64), np.zeros(m, np.int8),
                                     np.zeros(m, np.int64))
    before_N = offsets_N1[:-1].copy()  # where this column's items start in each row
    for column, count_N, sizes in zip(columns, count_CN, size_CM):
        kind, per_token = ITEM_COLUMNS[column]
        within = np.arange(len(sizes)) - np.repeat(np.cumsum(count_N) - count_N, count_N)
        at = np.repeat(before_N, count_N) + within
        size_M[at] = sizes
        kind_M[at] = MEDIA_KINDS.index(kind)
        item_tokens_M[at] = np.maximum(1, sizes // per_token)
        before_N += count_N
    return WindowSamples(tokens_N=tokens_N, source_N=np.zeros(n, np.int32),
                         batch_N=np.zeros(n, np.int32), item_offsets_N1=offsets_N1,
                         item_size_M=size_M, item_kind_M=kind_M, item_tokens_M=item_tokens_M)


def step_offsets(tokens_N: np.ndarray, per_step: int | None, batch_tokens: int | None,
                 steps: int | None) -> np.ndarray:
    """Global batches of ``per_step`` samples, or greedy ones of ``batch_tokens`` tokens."""
    if batch_tokens is not None:
        return steps_by_tokens(tokens_N, batch_tokens, steps)
    return steps_by_count(len(tokens_N), per_step, steps)


def drawn_stream(dist: str, seed: int, per_step: int | None, batch_tokens: int | None,
                 steps: int) -> tuple[WindowSamples, np.ndarray]:
    """(samples, step offsets) for ``steps`` steps drawn from a built-in distribution.

    By token budget the number of samples a step takes is not known in advance: draw more
    (the same seed, twice as many) until the steps fill.
    """
    if dist not in DISTRIBUTIONS:
        raise UserError(f"--dist {dist}: expected one of {', '.join(DISTRIBUTIONS)}")
    n = steps * per_step if batch_tokens is None else steps * 64
    while True:
        stream = generate(dist, n, seed)
        offsets_S1 = step_offsets(stream.tokens_N, per_step, batch_tokens, steps)
        if len(offsets_S1) - 1 >= steps:
            return take(stream, 0, int(offsets_S1[-1])), offsets_S1
        n *= 2


def rank_speeds(text: str | None) -> tuple[float, ...] | None:
    """``--rank-speeds 1,1,0.5,0.5`` as numbers, one per data rank (the planner's config checks
    the count and that each is finite and > 0); None when not given."""
    if text is None:
        return None
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"--rank-speeds {text}: expected numbers separated by commas, one per "
                        "data rank") from None
