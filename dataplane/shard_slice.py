"""The index slice of the shard a source's cursor is in, as arrays (catalog.SourceState's).

The catalog used to hold a shard's rows as Python lists (``to_pylist`` of every column, a dict
per tar member) and walk them a row at a time: about 27 µs a drawn sample with the mixer, most
of a 4,096-rank plane's window. Here a shard is read into arrays once, the cursor's skip rules
are decided for the whole shard at once (:meth:`ShardSlice.classify`), and refs are built for
a run of rows at a time (:meth:`ShardSlice.fields`). Every value a ref carries is exactly what
the row-at-a-time code gave (the same ``or 0`` / ``or ()`` defaults for nulls, the same
truncation), so plans stay bit-identical.

Positions: ``X`` indexes the cursor's order (``sample_pos``: the shard's rows as the epoch's
seeded order visits them), ``K`` the servable positions in that order.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omniscale.refs import SampleRef, make_ref

OK, CORRUPT, QUARANTINED, TOO_LONG = 0, 1, 2, 3  # why the cursor skips a row (or not)
_NO_LIST = ()


def _ints(column: pa.ChunkedArray) -> np.ndarray:
    """An integer column with nulls as 0 (the row-at-a-time ``value or 0``)."""
    return pc.fill_null(column, 0).to_numpy().astype(np.int64)


def _lists(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """A list column as (start_X, end_X, values): row X's list is values[start:end]; a null
    list is empty (the row-at-a-time ``value or ()``)."""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    offsets = arr.offsets.to_numpy().astype(np.int64)  # into arr.values, the array's offset applied
    start, end = offsets[:-1], offsets[1:].copy()
    if arr.null_count:
        null = arr.is_null().to_numpy(zero_copy_only=False)
        end[null] = start[null]
    return start, end, arr.values


class ShardSlice:
    """One shard's rows, opened at ``shard_pos`` of ``epoch`` with the row ``order`` seeded
    for it; ``max_tokens``: longer samples are truncated (text only) or skipped (media).

    The rows are put in the cursor's order as they are read, so the Python values a run of
    draws takes (keys, offsets, members) lie side by side in memory in the order the refs
    are built -- which is also the order the garbage collector later walks those refs in."""

    def __init__(self, epoch: int, shard_pos: int, shard: str, order: np.ndarray,
                 table: pa.Table, max_tokens: int | None) -> None:
        self.epoch, self.shard_pos, self.shard = epoch, shard_pos, shard
        self.num_rows = len(order)
        table = table.take(pa.array(np.asarray(order, np.int64)))
        self.keys = table.column("key").to_pylist()
        self.offset = table.column("offset").to_pylist()
        self.size = table.column("size").to_pylist()
        m_start, m_end, members = _lists(table.column("members"))
        fields = [f.to_pylist() for f in members.flatten()] if len(members) else [[], [], []]
        self.members = (m_start, m_end, *fields)  # name, offset, size of every member
        self.media = []  # image_patches, video_patches, audio_frames: (start_X, end_X, values)
        has_media = np.zeros(self.num_rows, bool)
        for name in ("image_patches", "video_patches", "audio_frames"):
            start, end, values = _lists(table.column(name))
            self.media.append((start, end, values.to_pylist()))
            has_media |= end > start
        llm, text = _ints(table.column("llm_tokens")), _ints(table.column("text_tokens"))
        # an index before version 4 has no target counts: its text tokens stand in
        if "target_tokens" in table.column_names:
            target = table.column("target_tokens")
            target = np.where(target.is_null().to_numpy(zero_copy_only=False), text,
                              _ints(target))
        else:
            target = text.copy()
        long = np.zeros(self.num_rows, bool) if max_tokens is None else llm > max_tokens
        # Over max_tokens with media: cutting it would cut media, so it is skipped; text-only
        # samples are truncated instead.
        self.too_long_X = long & has_media
        if long.any():
            llm, text = np.where(long, max_tokens, llm), np.where(long, max_tokens, text)
            target = np.where(long, np.minimum(target, max_tokens), target)
        self.llm_X, self.text_X, self.target_X = llm, text, target
        self.error_X = table.column("error").is_valid().to_numpy(zero_copy_only=False)
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
            hit = np.fromiter((k in mine for k in self.keys), bool, len(self.keys))
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

    def refs(self, pos_X: np.ndarray, source_id: int, source: str) -> list[SampleRef]:
        """The refs of the rows at cursor positions ``pos_X``, in that order."""
        return list(map(make_ref, *self.fields(pos_X, source_id, source)))

    def fields(self, pos_X: np.ndarray, source_id: int, source: str) -> list[list]:
        """The SampleRef fields of the rows at cursor positions ``pos_X``: a list per field,
        in field order (the mixer builds a batch's refs from these at once)."""
        r = pos_X.tolist()
        n = len(r)
        m_start, m_end, names, offs, sizes = self.members
        a_X, b_X = m_start[pos_X], m_end[pos_X]
        if n and ((b_X - a_X) == 1).all():  # one member each (a tar sample's one file)
            members = [((names[a], offs[a], sizes[a]),) for a in a_X.tolist()]
        else:
            members = [tuple(zip(names[a:b], offs[a:b], sizes[a:b]))
                       for a, b in zip(a_X.tolist(), b_X.tolist())]
        media = []
        for start, end, values in self.media:
            if not values:
                media.append([_NO_LIST] * n)
            else:
                media.append([tuple(values[a:b]) for a, b in
                              zip(start[pos_X].tolist(), end[pos_X].tolist())])
        return [[source_id] * n, [source] * n, [self.shard] * n,
                list(map(self.keys.__getitem__, r)), list(map(self.offset.__getitem__, r)),
                list(map(self.size.__getitem__, r)), members, self.llm_X[pos_X].tolist(),
                self.text_X[pos_X].tolist(), *media, [self.epoch] * n,
                self.target_X[pos_X].tolist()]
