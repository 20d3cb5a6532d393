"""The index slice of the shard a source's cursor is in, as arrays (catalog.SourceState's).

A shard is read once, put in the cursor's order, and kept as two things: numpy arrays of what
the mixer decides draws by (tokens, why a row is skipped), and the rows as an Arrow table in
:data:`omniscale.refs.REF_SCHEMA` (:attr:`ShardSlice.table`), from which a run of draws is one
``take`` (:meth:`ShardSlice.take`). The plane never builds a Python object per sample: a
window's samples go from these tables to its plan tables column by column (a SampleRef per
drawn sample, built and then turned back into Arrow, was over half of a 4,096-rank window).
Every value a row carries is what the row-at-a-time code gave (the same ``or 0`` / ``or ()``
defaults for nulls, the same truncation), so plans stay bit-identical.

Positions: ``X`` indexes the cursor's order (``sample_pos``: the shard's rows as the epoch's
seeded order visits them), ``K`` the servable positions in that order.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omniscale.refs import REF_SCHEMA, SampleRef, int_column, table_to_refs

OK, CORRUPT, QUARANTINED, TOO_LONG = 0, 1, 2, 3  # why the cursor skips a row (or not)


def _lists(column: pa.ChunkedArray, type_: pa.DataType) -> pa.ChunkedArray:
    """A list column with null lists as empty ones (the row-at-a-time ``value or ()``)."""
    column = column.cast(type_)
    return pc.fill_null(column, pa.scalar([], type_)) if column.null_count else column


class ShardSlice:
    """One shard's rows, opened at ``shard_pos`` of ``epoch`` with the row ``order`` seeded
    for it; ``max_tokens``: longer samples are truncated (text only) or skipped (media).

    ``source_id``/``source``: the source's, carried by every row. The rows are put in the
    cursor's order as they are read, so the servable rows a run of draws takes are mostly
    contiguous: a slice of :attr:`table`, no copy."""

    def __init__(self, epoch: int, shard_pos: int, shard: str, order: np.ndarray,
                 table: pa.Table, max_tokens: int | None, source_id: int = 0,
                 source: str = "") -> None:
        self.epoch, self.shard_pos, self.shard = epoch, shard_pos, shard
        self.num_rows = n = len(order)
        table = table.take(pa.array(np.asarray(order, np.int64)))
        field = REF_SCHEMA.field
        members = _lists(table.column("members"), field("members").type)
        media = [_lists(table.column(name), field(name).type)
                 for name in ("image_patches", "video_patches", "audio_frames")]
        has_media = np.zeros(n, bool)
        for column in media:
            has_media |= np.asarray(pc.list_value_length(column), np.int64) > 0
        llm, text = int_column(table.column("llm_tokens")), int_column(table.column("text_tokens"))
        # an index before version 4 has no target counts: its text tokens stand in
        if "target_tokens" in table.column_names:
            target = table.column("target_tokens")
            target = np.where(target.is_null().to_numpy(zero_copy_only=False), text,
                              int_column(target))
        else:
            target = text.copy()
        long = np.zeros(n, bool) if max_tokens is None else llm > max_tokens
        # Over max_tokens with media: cutting it would cut media, so it is skipped; text-only
        # samples are truncated instead.
        self.too_long_X = long & has_media
        if long.any():
            llm, text = np.where(long, max_tokens, llm), np.where(long, max_tokens, text)
            target = np.where(long, np.minimum(target, max_tokens), target)
        self.llm_X, self.text_X, self.target_X = llm, text, target
        self.error_X = table.column("error").is_valid().to_numpy(zero_copy_only=False)
        i32 = pa.int32()
        self.keys = table.column("key").cast(pa.string())
        self.table = pa.Table.from_arrays([
            pa.array(np.full(n, source_id, np.int32)), pa.array([source] * n, pa.string()),
            pa.array([shard] * n, pa.string()), self.keys,
            table.column("offset").cast(pa.int64()), table.column("size").cast(pa.int64()),
            members, pa.array(llm, i32), pa.array(text, i32), *media,
            pa.array(np.full(n, epoch, np.int32)), pa.array(target, i32)], schema=REF_SCHEMA)
        self._version: object = None  # the quarantine classify() last saw

    def classify(self, quarantined: set[tuple[str, str]], version: object) -> None:
        """Why the cursor skips each position, for the quarantine ``quarantined`` (identified
        by ``version``; a new version re-classifies). The checks and their precedence are the
        row-at-a-time cursor's: corrupt, then quarantined, then too long with media."""
        if version == self._version:
            return
        why_X = np.where(self.error_X, CORRUPT, np.where(self.too_long_X, TOO_LONG, OK))
        mine = {k for s, k in quarantined if s == self.shard}
        if mine:
            hit = np.asarray(pc.is_in(self.keys, value_set=pa.array(sorted(mine), pa.string())),
                             bool)
            why_X = np.where(~self.error_X & hit, QUARANTINED, why_X)
        self.ok_K = np.flatnonzero(why_X == OK)  # the servable positions, in cursor order
        self.llm_K, self.target_K = self.llm_X[self.ok_K], self.target_X[self.ok_K]
        # skipped_X[r][x]: positions before x skipped for reason r (corrupt, quarantined, long)
        self.skipped_X = [np.concatenate([[0], np.cumsum(why_X == r)]) for r in
                          (CORRUPT, QUARANTINED, TOO_LONG)]
        self._version = version

    def next_ok(self, pos: int) -> int:
        """Index into ``ok_K`` of the first servable position at or after ``pos``."""
        return int(np.searchsorted(self.ok_K, pos))

    def skipped(self, start: int, stop: int) -> tuple[int, int, int]:
        """Positions in [start, stop) skipped as corrupt, quarantined, too long."""
        return tuple(int(s[stop] - s[start]) for s in self.skipped_X)

    def refs(self, pos_X: np.ndarray) -> list[SampleRef]:
        """The refs of the rows at cursor positions ``pos_X``, in that order."""
        return table_to_refs(self.take(pos_X))

    def take(self, pos_X: np.ndarray) -> pa.Table:
        """The rows at cursor positions ``pos_X``, in that order (:data:`REF_SCHEMA`)."""
        if len(pos_X) and int(pos_X[-1]) - int(pos_X[0]) == len(pos_X) - 1:
            return self.table.slice(int(pos_X[0]), len(pos_X))  # a run of servable rows
        return self.table.take(pa.array(pos_X, pa.int64()))
