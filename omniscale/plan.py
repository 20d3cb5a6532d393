"""A rank's plan for a step: its Arrow form on the wire and its typed form in the trainer.

The plane serves a rank's share of a step as one Arrow table (:data:`PLAN_SCHEMA`; built by
``dataplane.plan_table``). This is the one module that names its columns: the loader decodes
the table once (:func:`decode_plan`) into a :class:`RankPlan`, and everything after it --
the loader's chunks and assembly, ``parallel.reshard``, the trainer -- works from that.

A table has one row per thing the rank must do, with the SampleRef columns
(:data:`omniscale.refs.REF_SCHEMA`) saying which sample:

- ``role = "llm"``: a sample (or its SP slice) in this rank's LLM micro-batch ``micro_batch``;
  ``sp_size``/``sp_index``/``sp_first_rank`` say which slice of which aligned SP group,
  ``sp_slices`` the tokens of each of the group's slices when the plane sized them by the
  ranks' speeds (null: equal slices, the sequence padded to a multiple of ``sp_size``),
  ``sp_heads`` the query heads each rank of the group attends when the plane sized those by
  the ranks' speeds too (null: H/k each), and
  ``encode_ranks`` lists, per encoder item of the sample (:func:`item_kinds` order), the rank
  that encodes it (the reshard map seen from the consumer);
- ``role = "encode"``: an encoder item this rank encodes -- item ``item_index`` of kind
  ``item_kind`` of that sample -- whose embeddings go to ranks ``consume_rank`` ..
  ``consume_rank + consume_span - 1`` (the sample's SP group; one rank when it is not split):
  the reshard map seen from the producer.

Table metadata (key ``omniscale``, JSON): step, rank, dp, num_micro_batches, predicted cost of
this rank and of the step's slowest rank, lower bound, imbalance, whether the step reshards,
and what the best baseline would predict.

Shape suffixes: X plan rows, S a micro-batch's sequences, E encode rows, V encode-rank values
of all LLM rows (``encode_ranks`` flattened).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omniscale.media import MEDIA_KINDS
from omniscale.refs import REF_SCHEMA, SampleRef, table_to_refs

LLM, ENCODE = "llm", "encode"  # the values of the ``role`` column

PLAN_FIELDS = [
    ("role", pa.string()),
    ("step", pa.int64()),
    ("rank", pa.int32()),
    ("micro_batch", pa.int32()),
    ("sp_size", pa.int32()),
    ("sp_index", pa.int32()),
    ("sp_first_rank", pa.int32()),
    ("sp_slices", pa.list_(pa.int32())),
    ("sp_heads", pa.list_(pa.int32())),
    ("encode_ranks", pa.list_(pa.int32())),
    ("item_kind", pa.string()),
    ("item_index", pa.int32()),
    ("consume_rank", pa.int32()),
    ("consume_span", pa.int32()),
]
PLAN_SCHEMA = pa.schema(list(REF_SCHEMA) + [pa.field(n, t) for n, t in PLAN_FIELDS])
METADATA_KEY = b"omniscale"

# How the reshard names a media item: (source, shard, key, kind id, index within its kind).
ItemKey = tuple[str, str, str, int, int]


def item_kinds(ref: SampleRef) -> list[tuple[int, int]]:
    """(kind id, index within kind) of a sample's encoder items, in the plane's item order:
    images, then videos, then audio clips, each in member order."""
    return ([(0, i) for i in range(len(ref.image_patches))]
            + [(1, i) for i in range(len(ref.video_patches))]
            + [(2, i) for i in range(len(ref.audio_frames))])


def item_key(ref: SampleRef, kind_id: int, index: int) -> ItemKey:
    """The reshard's name for item ``index`` of kind ``kind_id`` of the sample ``ref``."""
    return (ref.source, ref.shard, ref.key, kind_id, index)


def item_keys(ref: SampleRef) -> list[ItemKey]:
    """Every encoder item of a sample, in :func:`item_kinds` order."""
    return [item_key(ref, kind, i) for kind, i in item_kinds(ref)]


def plan_metadata(table: pa.Table) -> dict:
    """The ``omniscale`` metadata of a served plan table."""
    return json.loads((table.schema.metadata or {}).get(METADATA_KEY, b"{}"))


def fingerprint(table: pa.Table) -> str:
    """What a rank received in a step, as a short hash of its sorted (source, shard, key,
    role, sp_index) rows: recorded at commit so an audit can check a replay reproduced it."""
    # A plane fingerprints every rank's table of every step (16,384 a window at 4,096 ranks,
    # a few rows each), so the Arrow calls per table are what it costs: the five columns in
    # one select, and a table's one chunk read directly (a rank's table is a slice).
    return _fingerprint(*(c.chunk(0).to_pylist() if c.num_chunks == 1 else c.to_pylist()
                          for c in table.select(_FINGERPRINTED).columns))


_FINGERPRINTED = ["source", "shard", "key", "role", "sp_index"]


# Rows from which the Arrow path pays: its dozen compute calls cost ~0.4 ms whatever the size,
# so below a few hundred rows (a small job's window) reading the columns as lists is faster
# (16 rows: 0.06 against 0.44 ms; 512 rows: 1.06 against 0.75 ms; 32,768: 72 against 21 ms).
ARROW_FROM_ROWS = 256


def slice_fingerprints(table: pa.Table, starts: np.ndarray, counts: np.ndarray,
                       arrow_from_rows: int = ARROW_FROM_ROWS) -> list[str]:
    """:func:`fingerprint` of each slice ``starts[i]`` .. ``+counts[i]`` of ``table`` (a
    window's ranks' tables are slices of one table, 16,384 of them at 4,096 ranks): the same
    text hashed, built for every row at once where it can be and pays (:func:`_row_texts`,
    from ``arrow_from_rows`` rows), else each slice's rows read from the table's columns
    read once."""
    starts, counts = np.asarray(starts, np.int64), np.asarray(counts, np.int64)
    texts = _row_texts(table, starts, counts) if int(counts.sum()) >= arrow_from_rows else None
    if texts is None:
        columns = [table.column(n).to_pylist() for n in _FINGERPRINTED]
        return [_fingerprint(*(c[at:at + n] for c in columns))
                for at, n in zip(starts.tolist(), counts.tolist())]
    ends = np.cumsum(counts).tolist()
    return [hashlib.sha256(f"[{', '.join(texts[end - n:end])}]".encode()).hexdigest()[:16]
            for n, end in zip(counts.tolist(), ends)]


def _plain(column: pa.ChunkedArray) -> bool:
    """Whether every string of ``column`` is printable ASCII without quotes or backslashes --
    its repr and its JSON text are then the string between quotes. Read from the chunks'
    character buffers as bytes (a slice's buffer may hold more: then a False can be wrong,
    which only costs the row-by-row path)."""
    if column.type != pa.string():
        return False
    for chunk in column.chunks:
        data = chunk.buffers()[2]
        if data is not None:
            b = np.frombuffer(data, np.uint8)
            if ((b < 0x20) | (b > 0x7E) | (b == 0x22) | (b == 0x27) | (b == 0x5C)).any():
                return False
    return True


def _row_texts(table: pa.Table, starts: np.ndarray, counts: np.ndarray) -> list[str] | None:
    """Every slice's rows as :func:`_fingerprint` writes them (the row's JSON), slice after
    slice, each slice's rows in :func:`_fingerprint`'s order (by the row's ``str``), built
    by Arrow for all rows at once; None when a string is not :func:`_plain` (its repr and
    JSON text are not the plain concatenations here)."""
    columns = [table.column(n) for n in _FINGERPRINTED[:4]]
    if not all(map(_plain, columns)):
        return None
    # each slice's row numbers, slice after slice
    ends = np.cumsum(counts)
    rows_S = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(starts - ends + counts,
                                                                      counts)
    rows_S = pa.array(rows_S.astype(np.int64))
    sp = pc.cast(table.column("sp_index"), pa.string())
    slice_S = np.repeat(np.arange(len(starts)), counts)
    taken = [pc.take(c, rows_S) for c in (*columns, sp)]
    source, shard, key, role, sp = taken
    # str(row) is "('source', 'shard', 'key', 'role', 0)" (None where null); its JSON
    # '["source", "shard", "key", "role", 0]' (null): the same strings joined apart.
    by = pc.binary_join_element_wise("('", source, "', '", shard, "', '", key, "', '", role,
                                     "', ", pc.fill_null(sp, "None"), ")", "")
    text = pc.binary_join_element_wise('["', source, '", "', shard, '", "', key, '", "', role,
                                       '", ', pc.fill_null(sp, "null"), "]", "")
    order = pc.sort_indices(pa.table({"slice": slice_S, "by": by}),
                            sort_keys=[("slice", "ascending"), ("by", "ascending")])
    return pc.take(text, order).to_pylist()


def _fingerprint(sources, shards, keys, roles, sp_indices) -> str:
    rows = sorted(zip(sources, shards, keys, roles, sp_indices), key=str)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def step_fingerprint(prints: list[str]) -> str:
    """A whole step's fingerprint: every rank's :func:`fingerprint`, in rank order. A commit
    of the whole step at once carries it, proving the committer holds every rank's plan."""
    return hashlib.sha256("\n".join(prints).encode()).hexdigest()[:16]


def rescale_lengths(lengths: list[int], tokens: int) -> list[int]:
    """Slice lengths planned for one sample (``sp_slices``) applied to a sample of ``tokens``
    tokens (a replacement for a corrupt one): the same cut points, in proportion, each slice kept at
    one token or more where the sample has a token per slice. Every rank of the group
    computes the same cuts, so their all-to-alls agree."""
    planned = sum(lengths)
    if planned == tokens:
        return list(lengths)
    k = len(lengths)
    cuts = [(c * tokens + planned // 2) // planned for c in np.cumsum(lengths[:-1]).tolist()]
    if tokens >= k:
        for j in range(k - 1):  # at least j + 1 tokens before cut j, k - 1 - j after it
            cuts[j] = min(max(cuts[j], j + 1, cuts[j - 1] + 1 if j else 0), tokens - (k - 1 - j))
    return np.diff([0, *cuts, tokens]).astype(np.int64).tolist()


@dataclass(frozen=True, eq=False)
class MicroBatchPlan:
    """The sequences one LLM micro-batch trains, in plan order: a sample each, or its slice
    ``sp_index`` of ``sp_size`` when the plane split it over an SP group."""

    index: int
    refs: tuple[SampleRef, ...]  # [S]
    sp_size_S: np.ndarray  # int64 [S]
    sp_index_S: np.ndarray  # int64 [S]
    # [S]: the group's slice lengths of a sequence split by speed (``RankPlan.sp_slices_X``)
    sp_slices_S: tuple[tuple[int, ...] | None, ...]
    # [S]: the group's query heads per rank of a sequence split with heads by speed
    # (``RankPlan.sp_heads_X``), None where H/k each
    sp_heads_S: tuple[tuple[int, ...] | None, ...]

    def sequences(self) -> Iterator[tuple[SampleRef, int, int, tuple[int, ...] | None,
                                          tuple[int, ...] | None]]:
        """(ref, sp_size, sp_index, sp_slices, sp_heads) of each sequence: what
        ``loaders.collate`` takes."""
        return zip(self.refs, self.sp_size_S.tolist(), self.sp_index_S.tolist(),
                   self.sp_slices_S, self.sp_heads_S)


@dataclass(frozen=True, eq=False)
class EncodePlan:
    """The media items this rank encodes (its share of the encoder plan) and the ranks each
    item's embeddings go to: ``consume_rank`` .. ``consume_rank + consume_span - 1``."""

    rows_E: np.ndarray  # int64 [E]: the item's row in the rank's plan
    refs: tuple[SampleRef, ...]  # [E]
    kind_E: np.ndarray  # int64 [E]: MEDIA_KINDS id
    index_E: np.ndarray  # int64 [E]: index among the sample's items of its kind
    consume_rank_E: np.ndarray  # int64 [E]
    consume_span_E: np.ndarray  # int64 [E], >= 1

    def __len__(self) -> int:
        return len(self.refs)

    def items(self) -> Iterator[tuple[int, SampleRef, str, int, int]]:
        """(row, ref, kind name, index within kind, first consuming rank) of each item."""
        return zip(self.rows_E.tolist(), self.refs,
                   [MEDIA_KINDS[k] for k in self.kind_E.tolist()], self.index_E.tolist(),
                   self.consume_rank_E.tolist())


@dataclass(frozen=True)
class ReshardPlan:
    """One rank's side of the encoder→LLM exchange: items sent (grouped by destination rank,
    ``send_counts`` per rank) and received (grouped by source rank, ``recv_counts`` per rank),
    in the order both sides derive from their plans ((rank, item) order), so the two sides
    agree without sending any identifiers."""

    send_items: list[ItemKey]
    send_counts: list[int]
    recv_items: list[ItemKey]
    recv_counts: list[int]


@dataclass(frozen=True, eq=False)
class RankPlan:
    """A rank's plan for one step, decoded from its table (:func:`decode_plan`).

    Row-wise arrays keep the table's row order (the order the loader resolves and reports
    samples in); :attr:`micro_batches` and :attr:`encodes` are the same rows grouped. Arrays
    are read-only. LLM-only fields hold -1 on encode rows and encode-only fields -1 on LLM
    rows.
    """

    step: int
    rank: int
    metadata: Mapping  # the table's metadata (read-only): dp, costs, imbalance, baseline, …
    fingerprint: str  # :func:`fingerprint` of the table: what a commit sends back
    refs: tuple[SampleRef, ...]  # [X]: each row's sample
    is_llm_X: np.ndarray  # bool [X]: an ``llm`` row (else an ``encode`` row)
    micro_batch_X: np.ndarray  # int64 [X]
    sp_size_X: np.ndarray  # int64 [X]
    sp_index_X: np.ndarray  # int64 [X]
    sp_first_rank_X: np.ndarray  # int64 [X]
    # int64 [X + 1]: offsets of each row's encode_ranks in encode_rank_V (none on encode rows)
    encode_ranks_X1: np.ndarray
    encode_rank_V: np.ndarray  # int64 [V]
    kind_X: np.ndarray  # int64 [X]: MEDIA_KINDS id of the item an encode row encodes
    item_index_X: np.ndarray  # int64 [X]
    consume_rank_X: np.ndarray  # int64 [X]
    consume_span_X: np.ndarray  # int64 [X], >= 1 on encode rows
    # [X]: on an LLM row split by speed, the tokens of each slice of its SP group in slice
    # order (every rank of the group needs them all: the Ulysses all-to-alls send and receive
    # that many rows per rank); None on other rows (equal slices)
    sp_slices_X: tuple[tuple[int, ...] | None, ...]
    # [X]: on an LLM row split with heads sized by speed, the query heads each rank of its SP
    # group attends, in slice order (every rank of the group needs them all); None elsewhere
    sp_heads_X: tuple[tuple[int, ...] | None, ...]
    micro_batches: tuple[MicroBatchPlan, ...]  # by index, empty ones included
    encodes: EncodePlan
    # The loader's count of the plane's re-plans of steps it had fetched when this plan was
    # fetched (``loaders.prefetch.PlanPrefetcher.restart``): what it decoded of an older count
    # for a re-planned step is dropped, never trained. Not part of the plane's table.
    generation: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.refs)

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    def encode_ranks(self) -> list[list[int]]:
        """Per row, the rank encoding each of its sample's items (empty on encode rows and
        on LLM rows of a plan without an encoder plan)."""
        ranks, ends = self.encode_rank_V.tolist(), self.encode_ranks_X1.tolist()
        return [ranks[a:b] for a, b in zip(ends, ends[1:])]

    def consumed_items(self) -> list[tuple[ItemKey, int]]:
        """(item, encoding rank) of every encoder item of the samples this rank trains (one
        pair per LLM row and item: an SP slice's items too), from the LLM rows' encode_ranks."""
        pairs = []
        for ref, llm, encoders in zip(self.refs, self.is_llm_X.tolist(), self.encode_ranks()):
            if not llm:
                continue
            items = item_keys(ref)
            if len(items) != len(encoders):
                raise ValueError(f"plan of rank {self.rank}: sample {ref.key!r} has "
                                 f"{len(items)} encoder items but {len(encoders)} encode_ranks")
            pairs.extend(zip(items, encoders))
        return pairs

    def encoded_items(self) -> list[tuple[ItemKey, int, int]]:
        """(item, first consuming rank, consuming ranks) of each encode row. A sample drawn
        twice in a step (two epochs) names the same items twice, maybe for other ranks."""
        enc = self.encodes
        return [(item_key(ref, kind, index), first, span) for ref, kind, index, first, span
                in zip(enc.refs, enc.kind_E.tolist(), enc.index_E.tolist(),
                       enc.consume_rank_E.tolist(), enc.consume_span_E.tolist())]

    def reshard_plan(self, world: int) -> ReshardPlan:
        """This rank's side of the exchange among ``world`` ranks, from its own plan alone:
        what it sends from its encode rows (each item to every consuming rank), what it
        receives from its LLM rows' encode_ranks."""
        send = {(c, item) for item, first, span in self.encoded_items()
                for c in range(first, first + span)}
        recv = {(e, item) for item, e in self.consumed_items()}
        for what, pairs in (("sends to", send), ("receives from", recv)):
            bad = sorted({r for r, _ in pairs if not 0 <= r < world})
            if bad:
                raise ValueError(f"plan of rank {self.rank}: {what} rank(s) {bad[:3]}, "
                                 f"outside the {world} ranks")
        send_counts, recv_counts = Counter(c for c, _ in send), Counter(e for e, _ in recv)
        return ReshardPlan(
            send_items=[item for _, item in sorted(send)],
            send_counts=[send_counts[r] for r in range(world)],
            recv_items=[item for _, item in sorted(recv)],
            recv_counts=[recv_counts[r] for r in range(world)])


def decode_plan(source: pa.Table | bytes | pa.Buffer) -> RankPlan:
    """The typed plan of a served plan table (or of its Arrow IPC stream). A table without a
    column of :data:`PLAN_SCHEMA`, with one of another type, or with a role, kind or
    micro-batch the plan cannot have raises ValueError in one line naming the column."""
    table = source if isinstance(source, pa.Table) else pa.ipc.open_stream(source).read_all()
    _check_columns(table)
    refs = tuple(table_to_refs(table))
    role = table.column("role")
    is_llm_X = _flags(pc.equal(role, LLM))
    encode_X = _flags(pc.equal(role, ENCODE))
    if not (is_llm_X | encode_X).all():
        bad = role[int(np.flatnonzero(~(is_llm_X | encode_X))[0])].as_py()
        raise ValueError(f"plan table: column 'role' holds {bad!r}, not {LLM!r} or {ENCODE!r}")
    kind_X = np.full(len(refs), -1, np.int64)
    for kind, name in enumerate(MEDIA_KINDS):
        kind_X[_flags(pc.equal(table.column("item_kind"), name))] = kind
    if (kind_X[encode_X] < 0).any():
        bad = table.column("item_kind")[int(np.flatnonzero(encode_X & (kind_X < 0))[0])]
        raise ValueError(f"plan table: column 'item_kind' holds {bad.as_py()!r} on an encode "
                         f"row, not one of {', '.join(MEDIA_KINDS)}")
    kind_X[is_llm_X] = -1
    micro_batch_X = _ints(table, "micro_batch", is_llm_X)
    if (micro_batch_X[is_llm_X] < 0).any():
        raise ValueError("plan table: column 'micro_batch' is null or negative on an llm row")
    encode_ranks = table.column("encode_ranks")
    # Encode rows name no encoding ranks, whatever the table holds there.
    lengths_X = np.where(is_llm_X, _ints_or(pc.list_value_length(encode_ranks), 0), 0)
    encode_ranks_X1 = np.concatenate([[0], np.cumsum(lengths_X)]).astype(np.int64)
    encode_rank_V = _ints_or(pc.list_flatten(pc.filter(encode_ranks, pa.array(is_llm_X))), -1)
    # consume_span: a null or zero span is the one consuming rank
    span_X = _ints_or(table.column("consume_span"), 0)
    span_X = np.where(encode_X, np.where(span_X == 0, 1, span_X), -1)
    metadata = plan_metadata(table)
    step, rank = _step_and_rank(table, metadata)
    sp_size_X, sp_index_X = _ints(table, "sp_size", is_llm_X), _ints(table, "sp_index", is_llm_X)
    fp = _fingerprint([r.source for r in refs], [r.shard for r in refs],
                      [r.key for r in refs], role.to_pylist(),
                      table.column("sp_index").to_pylist())
    n_micro = max(int(metadata.get("num_micro_batches", 0)),
                  int(micro_batch_X.max(initial=-1)) + 1)
    sp_slices_X, sp_heads_X = (
        tuple(tuple(v) if v and llm else None for v, llm in
              zip(table.column(name).to_pylist(), is_llm_X.tolist()))
        for name in ("sp_slices", "sp_heads"))
    encode_rows_E = np.flatnonzero(encode_X)
    consume_rank_X = _ints(table, "consume_rank", encode_X)
    item_index_X = _ints(table, "item_index", encode_X)
    arrays = dict(
        is_llm_X=is_llm_X, micro_batch_X=micro_batch_X, sp_size_X=sp_size_X,
        sp_index_X=sp_index_X, sp_first_rank_X=_ints(table, "sp_first_rank", is_llm_X),
        encode_ranks_X1=encode_ranks_X1, encode_rank_V=encode_rank_V, kind_X=kind_X,
        item_index_X=item_index_X, consume_rank_X=consume_rank_X, consume_span_X=span_X)
    encodes = EncodePlan(encode_rows_E, tuple(refs[i] for i in encode_rows_E.tolist()),
                         *_read_only(kind_X[encode_rows_E], item_index_X[encode_rows_E],
                                     consume_rank_X[encode_rows_E], span_X[encode_rows_E]))
    _read_only(encode_rows_E, *arrays.values())
    return RankPlan(step, rank, MappingProxyType(metadata), fp, refs, **arrays,
                    sp_slices_X=sp_slices_X, sp_heads_X=sp_heads_X,
                    micro_batches=_micro_batches(refs, is_llm_X, micro_batch_X, sp_size_X,
                                                 sp_index_X, sp_slices_X, sp_heads_X, n_micro),
                    encodes=encodes)


def _micro_batches(refs, is_llm_X, micro_batch_X, sp_size_X, sp_index_X, sp_slices_X,
                   sp_heads_X, count) -> tuple[MicroBatchPlan, ...]:
    """The LLM rows grouped by micro-batch (a stable sort keeps plan order within each)."""
    rows = np.flatnonzero(is_llm_X)
    rows = rows[np.argsort(micro_batch_X[rows], kind="stable")]
    ends = np.cumsum(np.bincount(micro_batch_X[rows], minlength=count)).tolist()
    out = []
    for mb, (start, end) in enumerate(zip([0, *ends], ends)):
        taken = rows[start:end]
        out.append(MicroBatchPlan(mb, tuple(refs[i] for i in taken.tolist()),
                                  *_read_only(sp_size_X[taken], sp_index_X[taken]),
                                  tuple(sp_slices_X[i] for i in taken.tolist()),
                                  tuple(sp_heads_X[i] for i in taken.tolist())))
    return tuple(out)


def _check_columns(table: pa.Table) -> None:
    have = {field.name: field.type for field in table.schema}
    for field in PLAN_SCHEMA:
        if field.name not in have:
            raise ValueError(f"plan table: no column {field.name!r}")
        if not have[field.name].equals(field.type):
            raise ValueError(f"plan table: column {field.name!r} is {have[field.name]}, "
                             f"expected {field.type}")


def _step_and_rank(table: pa.Table, metadata: dict) -> tuple[int, int]:
    """From the metadata the plane writes, else from the rows (a hand-built table)."""
    if "step" in metadata and "rank" in metadata:
        return int(metadata["step"]), int(metadata["rank"])
    if table.num_rows == 0:
        raise ValueError("plan table: no rows and no step/rank metadata")
    return int(table.column("step")[0].as_py()), int(table.column("rank")[0].as_py())


def _read_only(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The arrays, made read-only (a plan is decoded once and shared by the loader's
    stages and the trainer)."""
    for array in arrays:
        array.flags.writeable = False
    return arrays


def _flags(mask) -> np.ndarray:
    """A boolean Arrow array as numpy, null as False."""
    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), bool)


def _ints_or(array, fill: int) -> np.ndarray:
    return np.asarray(pc.fill_null(array, fill).to_numpy(zero_copy_only=False), np.int64)


def _ints(table: pa.Table, name: str, used_X: np.ndarray) -> np.ndarray:
    """Column ``name`` as int64 on the rows it belongs to (``used_X``), -1 elsewhere and
    where null."""
    return np.where(used_X, _ints_or(table.column(name), -1), -1)


def rows_to_table(ref_table: pa.Table, order_X: np.ndarray, *, pos_X, is_llm_X, step_X, rank_X,
                  micro_batch_X, sp_size_X, sp_index_X, sp_first_rank_X, encode_count_X,
                  encode_rank_V, kind_X, item_index_X, consume_rank_X, consume_span_X,
                  sp_slice_count_X=None, sp_slice_V=None, sp_head_count_X=None,
                  sp_head_V=None) -> pa.Table:
    """Plan rows given as arrays (the encoder side of :func:`decode_plan`), written in the
    order ``order_X`` as one :data:`PLAN_SCHEMA` table (the plane slices it into the ranks'
    tables). Row X's sample is row ``pos_X`` of ``ref_table``; ``encode_count_X`` and
    ``encode_rank_V`` are the LLM rows' encode_ranks lists (lengths, then values flat, in
    row order before ``order_X``); ``sp_slice_count_X`` and ``sp_slice_V`` the same for the
    ``sp_slices`` lists (a count of 0: null; both None: no row split by speed), and
    ``sp_head_count_X``/``sp_head_V`` for the ``sp_heads`` lists; ``kind_X``
    is -1 on LLM rows. Columns that do not apply to a row's role are null."""
    llm_X, enc_X = is_llm_X[order_X], ~is_llm_X[order_X]

    def ints(values_X, null_X):
        return pa.array(values_X[order_X], type=pa.int32(), mask=null_X)

    encode_ranks = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(encode_count_X)]).astype(np.int32)),
        pa.array(encode_rank_V, type=pa.int32()),
        type=pa.list_(pa.int32()), mask=pa.array(~is_llm_X))

    def lists(count_X, values_V):  # a count of 0: null
        if count_X is None:
            count_X, values_V = np.zeros(len(is_llm_X), np.int64), np.zeros(0, np.int64)
        return pa.ListArray.from_arrays(
            pa.array(np.concatenate([[0], np.cumsum(count_X)]).astype(np.int32)),
            pa.array(values_V, type=pa.int32()),
            type=pa.list_(pa.int32()), mask=pa.array(np.asarray(count_X) == 0))

    kinds = np.array(list(MEDIA_KINDS) + [None], object)  # -1: an LLM row, no kind
    plan_columns = {
        "role": pa.array(np.where(llm_X, LLM, ENCODE).astype(object), type=pa.string()),
        "step": pa.array(step_X[order_X], type=pa.int64()),
        "rank": pa.array(rank_X[order_X], type=pa.int32()),
        "micro_batch": ints(micro_batch_X, enc_X),
        "sp_size": ints(sp_size_X, enc_X),
        "sp_index": ints(sp_index_X, enc_X),
        "sp_first_rank": ints(sp_first_rank_X, enc_X),
        "sp_slices": lists(sp_slice_count_X, sp_slice_V).take(pa.array(order_X)),
        "sp_heads": lists(sp_head_count_X, sp_head_V).take(pa.array(order_X)),
        "encode_ranks": encode_ranks.take(pa.array(order_X)),
        "item_kind": pa.array(kinds[kind_X[order_X]], type=pa.string()),
        "item_index": ints(item_index_X, llm_X),
        "consume_rank": ints(consume_rank_X, llm_X),
        "consume_span": ints(consume_span_X, llm_X),
    }
    taken = ref_table.take(pa.array(pos_X[order_X]))
    columns = taken.columns + [plan_columns[name] for name, _ in PLAN_FIELDS]
    return pa.Table.from_arrays(columns, schema=PLAN_SCHEMA).combine_chunks()


def with_metadata(table: pa.Table, metadata: dict) -> pa.Table:
    """``table`` carrying ``metadata`` as its plan metadata (:func:`plan_metadata` reads it)."""
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(metadata)})
