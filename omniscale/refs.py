"""SampleRef: what the data plane hands out for one sample, and its Arrow encoding.

A SampleRef names a sample well enough for a stateless loader worker to fetch it (source
directory by name, shard, byte range, members) and carries the cost features the balancer
plans with, so nothing downstream ever reopens an index. Refs cross the wire as Arrow tables
(:data:`REF_SCHEMA`); nothing is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omniscale.index_schema import MEMBER_TYPE

Member = tuple[str, int, int]  # (member name, data offset, data size)

REF_SCHEMA = pa.schema([
    ("source_id", pa.int32()),
    ("source", pa.string()),
    ("shard", pa.string()),
    ("key", pa.string()),
    ("offset", pa.int64()),
    ("size", pa.int64()),
    ("members", pa.list_(MEMBER_TYPE)),
    ("llm_tokens", pa.int32()),
    ("text_tokens", pa.int32()),
    ("image_patches", pa.list_(pa.int32())),
    ("video_patches", pa.list_(pa.int32())),
    ("audio_frames", pa.list_(pa.int32())),
    ("epoch", pa.int32()),
    ("target_tokens", pa.int32()),
])


@dataclass(frozen=True, slots=True)
class SampleRef:
    """One sample of one source, as the plane planned it.

    ``offset``/``size`` mean what the index's columns mean for the source's format (a tar byte
    range, a Parquet row group and row, a JSONL line's byte range). ``epoch`` is the source's
    epoch the sample was drawn in, so audits can count per epoch.
    """

    source_id: int
    source: str
    shard: str
    key: str
    offset: int
    size: int
    members: tuple[Member, ...] = ()
    llm_tokens: int = 0
    text_tokens: int = 0
    image_patches: tuple[int, ...] = ()
    video_patches: tuple[int, ...] = ()
    audio_frames: tuple[int, ...] = ()
    epoch: int = 0
    target_tokens: int = 0  # labels the loss counts (index ``target_tokens``)

    @property
    def uid(self) -> tuple[str, str, str]:
        """(source, shard, key): the sample's identity, independent of epoch."""
        return (self.source, self.shard, self.key)

    def __reduce__(self):
        # Refs cross to loader workers by pickle: the fields positionally, not the slotted
        # dataclass's default state (a fields() walk per ref, a third of a plan's hand-off).
        return SampleRef, _values(self)


_NAMES = tuple(f.name for f in fields(SampleRef))  # REF_SCHEMA's columns, in order
SAMPLE_FIELDS = _NAMES  # SampleRef's fields in order (its positional arguments)
_values = attrgetter(*_NAMES)
_MEMBERS, _LISTS = _NAMES.index("members"), [_NAMES.index(n) for n in (
    "image_patches", "video_patches", "audio_frames")]


def _ref_maker():
    """``make_ref(*fields)``: ``SampleRef(*fields)`` with every field given, without the frozen
    dataclass's ``__init__``, which sets each slot through ``object.__setattr__`` (a name lookup
    per field, half a ref's cost): the slots are set through their descriptors directly. Built
    the way dataclasses builds ``__init__``; the ref is the same object in every respect."""
    names = ", ".join(_NAMES)
    body = "".join(f"    _set_{n}(ref, {n})\n" for n in _NAMES)
    space = {"_new": object.__new__, "SampleRef": SampleRef,
             **{f"_set_{n}": SampleRef.__dict__[n].__set__ for n in _NAMES}}
    exec(f"def make_ref({names}):\n    ref = _new(SampleRef)\n{body}    return ref\n", space)
    return space["make_ref"]


make_ref = _ref_maker()


def refs_to_table(refs: list[SampleRef]) -> pa.Table:
    """An Arrow table with :data:`REF_SCHEMA`, one row per ref, in order.

    A column at a time, the members as they are (a tuple is a struct to Arrow): a plane builds
    its window's table of a hundred thousand refs or more at once, and a dict per member and
    a tuple per ref (garbage the collector then walked) were a fifth of a 4,096-rank window."""
    return pa.Table.from_arrays([pa.array(list(map(attrgetter(f.name), refs)), f.type)
                                 for f in REF_SCHEMA], schema=REF_SCHEMA)


def table_to_refs(table: pa.Table) -> list[SampleRef]:
    """The refs of a :data:`REF_SCHEMA` table; the exact inverse of :func:`refs_to_table`.

    Raises ValueError when a column is missing, so a peer speaking another schema version fails
    loudly rather than with shifted fields.
    """
    have = set(table.column_names)  # a list built afresh on every access: once, not per name
    missing = [n for n in _NAMES if n not in have]
    if missing:
        raise ValueError(f"not a SampleRef table: missing column(s) {', '.join(missing)}")
    cols = [table.column(n).to_pylist() for n in _NAMES]
    cols[_MEMBERS] = [tuple((m["name"], m["offset"], m["size"]) for m in ms) if ms else ()
                      for ms in cols[_MEMBERS]]
    for i in _LISTS:
        cols[i] = [tuple(v) if v else () for v in cols[i]]
    return list(map(make_ref, *cols))


class RefTable:
    """Samples as the plane holds them: a :data:`REF_SCHEMA` table, read column by column.
    ``refs[i]`` builds the SampleRefs only when a cold path asks for one (an audit, a corrupt
    sample's report): all at once, then kept."""

    __slots__ = ("table", "_refs")

    def __init__(self, table: pa.Table) -> None:
        self.table, self._refs = table, None

    @classmethod
    def of(cls, refs: "RefTable | pa.Table | list[SampleRef]") -> "RefTable":
        if isinstance(refs, RefTable):
            return refs
        return cls(refs if isinstance(refs, pa.Table) else refs_to_table(list(refs)))

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> SampleRef:
        return self._all()[i]

    def __iter__(self):
        return iter(self._all())

    def _all(self) -> list[SampleRef]:
        if self._refs is None:
            self._refs = table_to_refs(self.table)
        return self._refs


def int_column(column: "pa.Array | pa.ChunkedArray") -> np.ndarray:
    """An integer column (of a ref or index table) as int64, nulls as 0 (a ref's ``or 0``)."""
    return np.asarray(pc.fill_null(column, 0), np.int64)
