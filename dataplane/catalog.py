"""The catalog: every source's file state, held once for the whole job.

A source's file state is its seeded order and a cursor into it. Each epoch visits the source's
shards in a permutation seeded by ``(seed, source name, epoch)`` and each shard's rows in a
permutation seeded by ``(seed, source name, epoch, shard position)``; seeding by name, not by
position in the spec, keeps a source's order when other sources are added, removed or moved; both
are recomputed from
those numbers, never stored, so the state that a snapshot must carry is the cursor
``(epoch, shard position, sample position)``, the quarantined keys and a few counters: a small
JSON-able dict. Restoring it reproduces exactly the sequence an uninterrupted run would serve.

Memory is O(1) per source plus the index slice of the one shard the cursor is in: a shard's rows
are read (one Parquet row group, :func:`omniscale.index_schema.read_shard`) when the cursor enters
it and dropped when it leaves. Rows the indexer marked corrupt (``error`` column) and quarantined
``(shard, key)`` pairs are skipped wherever the cursor meets them.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from omniscale.dataplane.shard_slice import ShardSlice
from omniscale.errors import UserError
from omniscale.index_schema import (
    INDEX_VERSION,
    index_path,
    read_index_metadata,
    read_shard,
)
from omniscale.layout import SpecialTokens
from omniscale.location import Location
from omniscale.refs import REF_SCHEMA, SampleRef, table_to_refs

PLANE_READS = range(2, INDEX_VERSION + 1)  # index versions the plane can plan from

ON_EXHAUSTED = ("next_epoch", "stop", "drop_source")
_COLUMNS = ["key", "offset", "size", "members", "text_tokens", "image_patches",
            "video_patches", "audio_frames", "llm_tokens", "error"]
# Tags that keep the shard-order and row-order seed streams apart.
_SHARD_ORDER, _ROW_ORDER = 0, 1


class SourceState:
    """One source's seeded order, cursor, quarantine and counters.

    ``on_exhausted`` decides what happens when the cursor runs off the end of an epoch:
    ``next_epoch`` starts epoch + 1 (a new shard and row order) transparently; ``stop`` and
    ``drop_source`` mark the source exhausted, and the mixer removes it from the mix (dropping
    it from the catalog for ``drop_source``). A source with no servable sample in a whole epoch
    is exhausted whatever its policy, since rolling over would never yield one.
    """

    def __init__(self, name: str, source_id: int, path: "str | Path | Location", seed: int,
                 on_exhausted: str = "next_epoch", metadata: dict | None = None,
                 max_tokens: int | None = None) -> None:
        if on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"{name}: on_exhausted: unknown policy {on_exhausted!r} "
                             f"(expected {', '.join(ON_EXHAUSTED)})")
        # ``path``: where the source's index is (its directory, or its index_dir entry)
        self.name, self.source_id, self.path = name, int(source_id), Location.of(path)
        self.seed, self.on_exhausted = int(seed), on_exhausted
        self.max_tokens = max_tokens
        self._name_seed = zlib.crc32(name.encode())  # stable across spec edits and processes
        metadata = metadata if metadata is not None else read_index_metadata(self.path)
        if not metadata.get("shards"):
            raise UserError(f"{index_path(self.path)}: source {name!r} has no index (or no "
                            f"shards in it); run `omniscale data index` first")
        if metadata.get("version") not in PLANE_READS:
            # 2 to 4 differ only in columns the plane never reads (token ids, target tokens).
            raise UserError(f"{index_path(self.path)}: index version {metadata.get('version')}, "
                            f"the plane reads {min(PLANE_READS)} to {max(PLANE_READS)}; re-run "
                            f"`omniscale data index {self.path}`")
        self._targets = metadata.get("version") >= 4  # has the target_tokens column
        # The names the index counted tokens with (a media marker is no text token, so other
        # names give other counts): what this source is planned with. None: no tokenizer
        # made the index (hand-made refs).
        self.special_tokens = (SpecialTokens(**metadata.get("special_tokens", {}))
                               if metadata.get("tokenizer_sha256") else None)
        # Only the shard names, rows and row groups are kept (read_shard needs the latter).
        self._metadata = {"shards": {s: {"rows": int(e.get("rows", 0)),
                                         "row_group": e.get("row_group")}
                                     for s, e in metadata["shards"].items()}}
        self.shards: tuple[str, ...] = tuple(sorted(self._metadata["shards"]))
        self.samples_total = sum(e["rows"] for e in self._metadata["shards"].values())
        self._open: ShardSlice | None = None
        self._quarantine_version = 0  # bumped whenever the quarantine changes
        self._shard_order: tuple[int, np.ndarray] | None = None  # (epoch, permutation)
        self._peeked: tuple | None = None  # (sample_pos, shard_pos, epoch, ref) of peek()
        self.load_state_dict(self._initial_state())

    # --- the cursor --------------------------------------------------------------------------

    def peek(self) -> SampleRef | None:
        """The sample :meth:`next` would return, without consuming it; None once exhausted.

        It may move the cursor over skipped rows, into the next shard or (``next_epoch``) into
        the next epoch: none of that changes what later calls return.
        """
        peeked = self._peeked
        if peeked is not None and peeked[0] == self.sample_pos and peeked[1] == self.shard_pos \
                and peeked[2] == self.epoch:
            return peeked[3]
        pos = self._settle()
        if pos is None:
            return None
        ref = self._open.refs(np.array([pos]))[0]
        # The cursor now rests on a servable row: until it moves (or the quarantine or state
        # changes) _settle would return that same row, so the ref is reused.
        self._peeked = (self.sample_pos, self.shard_pos, self.epoch, ref)
        return ref

    def next(self) -> SampleRef | None:
        """The next sample, consuming it; None once the source is exhausted."""
        ref = self.peek()
        if ref is None:
            return None
        self._peeked = None
        self.sample_pos += 1
        self.served_samples += 1
        self.served_tokens += ref.llm_tokens
        return ref

    def settle(self) -> bool:
        """:meth:`peek`'s effect on the cursor without building the ref: True if a sample is
        servable (the cursor rests on it in the open shard), False once exhausted."""
        return self._settle() is not None

    def ahead(self) -> tuple[np.ndarray, np.ndarray]:
        """The LLM tokens and target tokens of the servable samples from the cursor to the end
        of the open shard, in order (call :meth:`settle` first): the mixer decides a batch's
        draws from these before any ref is built."""
        o = self._open
        k = o.next_ok(self.sample_pos)
        return o.llm_K[k:], o.target_K[k:]

    def take(self, n: int) -> list[SampleRef]:
        """The next ``n`` samples (fewer if the source runs out), consumed: exactly ``n`` calls
        of :meth:`next`, a shard's run of rows at a time."""
        return table_to_refs(self.take_table(n))

    def take_table(self, n: int) -> pa.Table:
        """:meth:`take`'s samples as one :data:`REF_SCHEMA` table (``ShardSlice.take``)."""
        runs = []
        while n > 0:
            pos = self._settle()
            if pos is None:
                break
            o = self._open
            k = o.next_ok(pos)
            pos_K = o.ok_K[k:k + n]
            last = int(pos_K[-1])
            self._skip(o, pos, last)  # the rows between the samples taken
            self.sample_pos = last + 1
            self.served_samples += len(pos_K)
            self.served_tokens += int(o.llm_K[k:k + n].sum())
            runs.append(o.take(pos_K))
            n -= len(pos_K)
        self._peeked = None
        if len(runs) == 1:
            return runs[0]
        return pa.concat_tables(runs) if runs else REF_SCHEMA.empty_table()

    def quarantine(self, shard: str, key: str) -> None:
        """Skip ``(shard, key)`` from now on, in this epoch and every later one."""
        self.quarantined.add((str(shard), str(key)))
        self._quarantine_version += 1
        self._peeked = None

    def shard_order(self, epoch: int) -> np.ndarray:
        """Shard positions -> indices into :attr:`shards`, for ``epoch``."""
        if self._shard_order is None or self._shard_order[0] != epoch:
            rng = np.random.default_rng([self.seed, self._name_seed, epoch, _SHARD_ORDER])
            self._shard_order = (epoch, rng.permutation(len(self.shards)))
        return self._shard_order[1]

    def row_order(self, epoch: int, shard_pos: int, rows: int) -> np.ndarray:
        """The order of a shard's ``rows`` index rows at ``shard_pos`` of ``epoch``."""
        rng = np.random.default_rng([self.seed, self._name_seed, epoch, _ROW_ORDER, shard_pos])
        return rng.permutation(rows)

    @property
    def open_shard(self) -> str | None:
        """The shard whose index slice is loaded, if any (at most one at a time)."""
        return None if self._open is None else self._open.shard

    @property
    def loaded_rows(self) -> int:
        return 0 if self._open is None else self._open.num_rows

    def _settle(self) -> int | None:
        """Move the cursor onto the next servable row and return its position in the open
        shard (``sample_pos``); None (and ``exhausted`` set) when there is none. Rows passed
        over are counted by why they were skipped, as they would be one at a time."""
        rolled = 0
        while not self.exhausted:
            if self.shard_pos >= len(self.shards):
                self._close()
                # Rolling twice in one call means a whole epoch had nothing to serve.
                if self.on_exhausted != "next_epoch" or rolled:
                    self.exhausted = True
                    break
                rolled += 1
                self.epoch, self.shard_pos, self.sample_pos = self.epoch + 1, 0, 0
                continue
            shard = self.shards[self.shard_order(self.epoch)[self.shard_pos]]
            opened = self._load(shard) if self._metadata["shards"][shard]["rows"] else None
            if opened is None or self.sample_pos >= opened.num_rows:
                self._close()
                self.shard_pos, self.sample_pos = self.shard_pos + 1, 0
                continue
            k = opened.next_ok(self.sample_pos)
            pos = int(opened.ok_K[k]) if k < len(opened.ok_K) else opened.num_rows
            self._skip(opened, self.sample_pos, pos)
            self.sample_pos = pos
            if pos < opened.num_rows:
                return pos
        return None

    def _skip(self, o: ShardSlice, start: int, stop: int) -> None:
        """Count the rows at positions [start, stop) of the open shard as skipped."""
        if stop > start:
            corrupt, quarantined, too_long = o.skipped(start, stop)
            self.skipped_corrupt += corrupt
            self.skipped_quarantined += quarantined
            self.skipped_too_long += too_long

    def _load(self, shard: str) -> ShardSlice:
        """The cursor's shard, read from the index unless it is already the open one, with
        its rows classified for the current quarantine."""
        o = self._open
        if o is None or (o.epoch, o.shard_pos, o.shard) != (self.epoch, self.shard_pos, shard):
            self._close()
            names = _COLUMNS + ["target_tokens"] * self._targets
            table = read_shard(self.path, shard, self._metadata, columns=names)
            order = self.row_order(self.epoch, self.shard_pos, table.num_rows)
            o = self._open = ShardSlice(self.epoch, self.shard_pos, shard, order, table,
                                        self.max_tokens, self.source_id, self.name)
        o.classify(self.quarantined, self._quarantine_version)
        return o

    def _close(self) -> None:
        self._open = None

    # --- state -------------------------------------------------------------------------------

    @staticmethod
    def _initial_state() -> dict:
        return {"epoch": 0, "shard_pos": 0, "sample_pos": 0, "exhausted": False,
                "quarantine": [], "served_samples": 0, "served_tokens": 0,
                "skipped_corrupt": 0, "skipped_quarantined": 0, "skipped_too_long": 0}

    def state_dict(self) -> dict:
        """The cursor, quarantine and counters: small, JSON-able, enough to resume exactly."""
        return {"epoch": self.epoch, "shard_pos": self.shard_pos, "sample_pos": self.sample_pos,
                "exhausted": self.exhausted,
                "quarantine": [list(q) for q in sorted(self.quarantined)],
                "served_samples": self.served_samples, "served_tokens": self.served_tokens,
                "skipped_corrupt": self.skipped_corrupt,
                "skipped_quarantined": self.skipped_quarantined,
                "skipped_too_long": self.skipped_too_long}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`'s output; later calls serve exactly what they would
        have served after it was taken."""
        self.epoch, self.shard_pos = int(state["epoch"]), int(state["shard_pos"])
        self.sample_pos, self.exhausted = int(state["sample_pos"]), bool(state["exhausted"])
        self.quarantined = {(str(s), str(k)) for s, k in state["quarantine"]}
        self._quarantine_version += 1
        for counter in ("served_samples", "served_tokens", "skipped_corrupt",
                        "skipped_quarantined", "skipped_too_long"):
            setattr(self, counter, int(state.get(counter, 0)))
        self._peeked = None
        self._close()

    def stats(self) -> dict:
        """What status reports for the source."""
        return {"id": self.source_id, "epoch": self.epoch, "shards": len(self.shards),
                "samples_total": self.samples_total, "served_samples": self.served_samples,
                "served_tokens": self.served_tokens, "skipped_corrupt": self.skipped_corrupt,
                "skipped_quarantined": self.skipped_quarantined,
                "skipped_too_long": self.skipped_too_long, "quarantined": len(self.quarantined),
                "exhausted": self.exhausted, "on_exhausted": self.on_exhausted}


class Catalog:
    """All sources' file states of one job, by name, iterated in source-id order.

    Sources can be added and removed (a mixture reload) and dropped (``on_exhausted:
    drop_source``); the state dict names every source with its id, path and policy, so
    :meth:`load_state_dict` rebuilds the same set of sources whatever the catalog held before.
    """

    def __init__(self, seed: int, sources: Iterable[SourceState] = (),
                 max_tokens: int | None = None) -> None:
        self.seed = int(seed)
        self.max_tokens = max_tokens  # longer samples: text truncated, media skipped
        self._sources: dict[str, SourceState] = {}
        self.dropped: dict[str, int] = {}  # name -> id of sources dropped when exhausted
        for s in sources:
            self._insert(s)

    @classmethod
    def from_spec(cls, spec, max_tokens: int | None = None) -> "Catalog":
        """One source state per source of a :class:`dataplane.spec.MixSpec`, ids in spec order."""
        return cls(spec.seed, [SourceState(s.name, i, s.index, spec.seed, s.on_exhausted,
                                           max_tokens=max_tokens)
                               for i, s in enumerate(spec.sources)], max_tokens=max_tokens)

    def add(self, name: str, path: "str | Path | Location", on_exhausted: str = "next_epoch",
            source_id: int | None = None) -> SourceState:
        """A new source at the start of its epoch 0; its id defaults to one past every id used
        so far (dropped sources included), so ids and hence seeded orders never collide."""
        if source_id is None:
            used = [s.source_id for s in self._sources.values()] + list(self.dropped.values())
            source_id = max(used, default=-1) + 1
        state = SourceState(name, source_id, path, self.seed, on_exhausted,
                            max_tokens=self.max_tokens)
        self._insert(state)
        return state

    def remove(self, name: str) -> None:
        """Forget a source (a reload took it out of the mixture)."""
        del self._sources[self._known(name)]

    def drop(self, name: str) -> None:
        """Remove an exhausted ``drop_source`` source, remembering that it was dropped."""
        self.dropped[name] = self._sources[self._known(name)].source_id
        self.remove(name)

    def _insert(self, state: SourceState) -> None:
        if state.name in self._sources:
            raise ValueError(f"source {state.name!r} is already in the catalog")
        if any(s.source_id == state.source_id for s in self._sources.values()):
            raise ValueError(f"source id {state.source_id} is already in the catalog")
        self._sources[state.name] = state
        self._sources = dict(sorted(self._sources.items(), key=lambda kv: kv[1].source_id))
        self.dropped.pop(state.name, None)

    def _known(self, name: str) -> str:
        if name not in self._sources:
            raise KeyError(f"no source {name!r} in the catalog (sources: {', '.join(self.names)})")
        return name

    def __getitem__(self, name: str) -> SourceState:
        try:
            return self._sources[name]
        except KeyError:
            return self._sources[self._known(name)]

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def __iter__(self) -> Iterator[SourceState]:
        return iter(self._sources.values())

    def __len__(self) -> int:
        return len(self._sources)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._sources)

    def state_dict(self) -> dict:
        """Every source's identity and state, plus the dropped ones: small and JSON-able."""
        return {"seed": self.seed, "dropped": dict(self.dropped),
                "sources": [{"name": s.name, "id": s.source_id, **_where(s.path),
                             "on_exhausted": s.on_exhausted, **s.state_dict()} for s in self]}

    def load_state_dict(self, state: dict) -> None:
        """Become the catalog the state describes: same sources (added or removed as needed),
        same seed, same cursors. Sources already present keep their loaded metadata."""
        if int(state["seed"]) != self.seed:
            self.seed = int(state["seed"])
            self._sources = {}
        wanted = {e["name"]: e for e in state["sources"]}
        for name, s in list(self._sources.items()):
            e = wanted.get(name)
            if e is None or (e["id"], _location(e), e["on_exhausted"]) != (
                    s.source_id, s.path, s.on_exhausted):
                del self._sources[name]
        for e in state["sources"]:
            if e["name"] not in self._sources:
                self._insert(SourceState(e["name"], e["id"], _location(e), self.seed,
                                         e["on_exhausted"], max_tokens=self.max_tokens))
            self._sources[e["name"]].load_state_dict(e)
        self.dropped = {str(k): int(v) for k, v in state.get("dropped", {}).items()}

    def stats(self) -> dict[str, dict]:
        """Per-source counters for status reports, in id order."""
        return {s.name: s.stats() for s in self}


def _where(loc: Location) -> dict:
    """A source's index location in a snapshot: the path (or URL), plus its storage options
    when it has any (checked free of credentials by the spec)."""
    out = {"path": loc.url}
    if loc.storage_options:
        out["storage_options"] = loc.storage_options
    return out


def _location(entry: dict) -> Location:
    return Location.of(entry["path"], entry.get("storage_options"))
