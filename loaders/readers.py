"""Read a sample's bytes by reference: what a stateless loader worker does with a SampleRef.

A ref names its source (by name), shard, byte range and members (``omniscale.refs``), so a
worker needs no index: it opens the shard, reads one range and slices it. The shard's format
follows from its suffix (``loaders.index.SHARD_SUFFIX``):

- ``.tar`` (WebDataset): ``offset``/``size`` is the sample's contiguous slice of the tar, read
  in one call; each member's data range is checked against the tar header in front of it, so a
  shard rewritten since indexing is caught instead of decoding someone else's bytes;
- ``.parquet``: ``offset`` is the row group and ``size`` the row within it (column ``text``);
- ``.jsonl``: ``offset``/``size`` is the line's byte range (newline excluded).

A source is a local directory or a :class:`~omniscale.location.Location` in an object store
(``s3://…``). Local shards are read through open files, as always. Remote tar and JSONL
shards are read a work item at a time (:meth:`SampleReader.read_many`): the ranges of a
shard coalesced into few requests, all issued at once, transient failures retried
(``loaders.remote_io``), through the node's block cache when one is configured
(``loaders.remote_cache``). Remote Parquet shards are read through fsspec file handles. Every
problem with the bytes -- a missing shard, a range past its end, a store that keeps failing
-- is a :class:`~loaders.errors.CorruptSample` naming source, key and shard.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import fsspec

from omniscale.errors import UserError
from omniscale.loaders.block_cache import BlockCache, CacheConfig
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.probe import Corrupt, decode_text, short
from omniscale.loaders.remote_cache import CachedReads
from omniscale.loaders.remote_io import (
    Counters,
    DirectReads,
    FetchError,
    RangeFetcher,
    RemoteSettings,
    scrub,
)
from omniscale.location import Location
from omniscale.refs import SampleRef

TAR_BLOCK = 512
# One sample's slice is read into memory; refuse ranges no training sample needs before
# allocating them (a corrupt ref must not exhaust a worker's memory).
MAX_SAMPLE_BYTES = 1 << 31
MAX_OPEN_FILES = 16


@dataclass(frozen=True)
class RawSample:
    """A sample's payload: ``(member name, bytes)`` in the ref's member order.

    Text-only formats yield one member ``KEY.txt`` holding the UTF-8 text, so every format
    decodes through the same path (``loaders.decode``).
    """

    source: str
    key: str
    members: tuple[tuple[str, bytes], ...]


class SampleReader:
    """Reads SampleRefs of named sources; one per worker (not thread-safe).

    ``sources``: name -> local directory, URL, or Location (with its storage options);
    ``storage_options`` (per source name) apply to a source given as a plain URL. ``remote``
    says how remote reads are batched and retried; ``cache`` puts remote tar/JSONL reads
    through a node-local block cache (local sources never use it).

    Keeps at most ``max_open`` shards open (least recently used closed first): workers read
    many sources, so the handle count, not the source count, bounds its memory.
    """

    def __init__(self, sources: Mapping[str, "str | os.PathLike | Location"],
                 max_open: int = MAX_OPEN_FILES,
                 storage_options: Mapping[str, dict] | None = None,
                 remote: RemoteSettings | None = None, cache: CacheConfig | None = None
                 ) -> None:
        if max_open < 1:
            raise ValueError(f"max_open: must be >= 1, got {max_open}")
        options = dict(storage_options or {})  # per source name: fsspec options
        self._locs = {name: Location.of(where, options.get(name))
                      for name, where in sources.items()}
        self._remote_names = {name for name, loc in self._locs.items() if not loc.is_local}
        self._fs: dict[str, tuple[fsspec.AbstractFileSystem, str]] = {}
        self._open: OrderedDict[str, _OpenShard] = OrderedDict()
        self._max_open = max_open
        self._group: tuple[str, int, object] | None = None  # last Parquet row group read
        self.remote = remote or RemoteSettings()
        self.cache = cache
        self._counters = Counters()
        self._remote: DirectReads | CachedReads | None = None  # made on the first remote read

    @property
    def sources(self) -> dict[str, Location]:
        """Source name -> where its shards are."""
        return dict(self._locs)

    def stats(self) -> dict[str, int]:
        """Counters since the reader was made (``remote_io.READ_STATS``): requests to the
        store, bytes fetched, retries, requests that failed for good, cache block hits and
        misses. All zero for local sources."""
        return self._counters.snapshot()

    def read(self, ref: SampleRef) -> RawSample:
        """The ref's members as bytes; CorruptSample when the bytes are not what it says."""
        fmt = shard_format(ref.shard)
        if fmt != "parquet" and ref.source in self._remote_names:
            got = self.read_many([ref])[0]
            if isinstance(got, CorruptSample):
                raise got
            return got
        try:
            if fmt == "tar":
                members = self._tar_members(ref, self._read_range(ref, ref.offset, ref.size))
            elif fmt == "parquet":
                members = ((f"{ref.key}.txt", self._read_parquet(ref).encode("utf-8")),)
            else:
                members = (self._jsonl_member(ref, self._read_range(ref, ref.offset,
                                                                    ref.size)),)
        except Corrupt as e:
            raise CorruptSample(ref.source, ref.key, str(e)) from None
        except (OSError, ValueError) as e:  # pyarrow's errors subclass these too
            self._close_shard(self._path(ref)[1])
            raise CorruptSample(ref.source, ref.key,
                                f"{ref.shard}: unreadable ({scrub(short(e))})") from None
        return RawSample(ref.source, ref.key, members)

    def read_many(self, refs: list[SampleRef]) -> list["RawSample | CorruptSample"]:
        """Every ref's sample, or its CorruptSample, in order: one work item's refs read
        together. Remote tar and JSONL refs are fetched at once (coalesced, concurrent,
        retried); the rest are read one by one as :meth:`read` does. An unknown source or
        format raises a UserError, as in :meth:`read`."""
        out: list = [None] * len(refs)
        remote: dict[tuple[str, str], list[int]] = {}
        for i, ref in enumerate(refs):
            if ref.source in self._remote_names and shard_format(ref.shard) != "parquet":
                remote.setdefault((ref.source, ref.shard), []).append(i)
                continue
            try:
                out[i] = self.read(ref)
            except CorruptSample as e:
                out[i] = e
        if remote:
            self._read_remote(refs, remote, out)
        return out

    def fetches_together(self, ref: SampleRef) -> bool:
        """Whether :meth:`read_many` fetches ``ref`` together with others (a remote tar or
        JSONL shard), so reading a work item's refs at once saves requests."""
        return ref.source in self._remote_names and not ref.shard.endswith(".parquet")

    @property
    def open_files(self) -> int:
        return len(self._open)

    def close(self) -> None:
        for path in list(self._open):
            self._close_shard(path)
        self._group = None
        if self._remote is not None:
            self._remote.fetcher.close()

    def __enter__(self) -> "SampleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- remote shards ------------------------------------------------------------------------

    def _read_remote(self, refs: list[SampleRef], groups: dict[tuple[str, str], list[int]],
                     out: list) -> None:
        wanted, asked = [], []
        for (source, shard), indices in groups.items():
            ranges, mine = [], []
            for i in indices:
                ref = refs[i]
                if ref.offset < 0 or ref.size < 0 or ref.size > MAX_SAMPLE_BYTES:
                    out[i] = CorruptSample(ref.source, ref.key, f"{ref.shard}: bad byte range "
                                           f"[{ref.offset}, {ref.offset + ref.size})")
                    continue
                ranges.append((ref.offset, ref.offset + ref.size))
                mine.append(i)
            if mine:
                wanted.append((self._locs[source].join(shard), ranges))
                asked.append(mine)
        if not wanted:
            return
        for indices, datas in zip(asked, self._remote_reads().read(wanted)):
            for i, data in zip(indices, datas):
                out[i] = self._parse(refs[i], data)

    def _parse(self, ref: SampleRef, data: "bytes | FetchError") -> "RawSample | CorruptSample":
        if isinstance(data, FetchError):
            return CorruptSample(ref.source, ref.key, f"{ref.shard}: {data.reason}")
        try:
            if shard_format(ref.shard) == "tar":
                members = self._tar_members(ref, data)
            else:
                members = (self._jsonl_member(ref, data),)
        except Corrupt as e:
            return CorruptSample(ref.source, ref.key, str(e))
        return RawSample(ref.source, ref.key, members)

    def _remote_reads(self) -> "DirectReads | CachedReads":
        if self._remote is None:
            fetcher = RangeFetcher(self.remote, self._counters)
            self._remote = (CachedReads(BlockCache(self.cache), fetcher)
                            if self.cache is not None else DirectReads(fetcher))
        return self._remote

    # --- formats ------------------------------------------------------------------------------

    def _tar_members(self, ref: SampleRef, data: bytes) -> tuple[tuple[str, bytes], ...]:
        """The ref's members out of its slice of the tar, each checked against its header."""
        if not ref.members:
            raise Corrupt("the ref lists no members")
        end = ref.offset + ref.size
        out = []
        for name, offset, size in ref.members:
            if offset - TAR_BLOCK < ref.offset or size < 0 or offset + size > end:
                raise Corrupt(f"member {name!r}: bytes [{offset}, {offset + size}) are outside "
                              f"the sample's range [{ref.offset}, {end})")
            start = offset - ref.offset
            _check_header(name, size, data[start - TAR_BLOCK:start])
            out.append((name, data[start:start + size]))
        return tuple(out)

    def _read_parquet(self, ref: SampleRef) -> str:
        import pyarrow.parquet as pq

        fs, path = self._path(ref)
        shard = self._shard(fs, path)
        if shard.parquet is None:
            shard.parquet = pq.ParquetFile(shard.handle)
        parquet = shard.parquet
        if not 0 <= ref.offset < parquet.num_row_groups:
            raise Corrupt(f"{ref.shard}: no row group {ref.offset} (it has "
                          f"{parquet.num_row_groups})")
        if self._group is not None and self._group[:2] == (path, ref.offset):
            table = self._group[2]
        else:
            columns = ["text"] + (["key"] if "key" in parquet.schema_arrow.names else [])
            table = parquet.read_row_group(ref.offset, columns=columns)
            self._group = (path, ref.offset, table)  # neighbours in a group are read together
        if not 0 <= ref.size < table.num_rows:
            raise Corrupt(f"{ref.shard}: row group {ref.offset} has no row {ref.size} (it has "
                          f"{table.num_rows})")
        if "key" in table.column_names:
            _check_key(ref, table.column("key")[ref.size].as_py())
        text = table.column("text")[ref.size].as_py()
        if not isinstance(text, str):
            raise Corrupt(f"{ref.shard}: row {ref.size} of row group {ref.offset}: text is "
                          f"{'null' if text is None else type(text).__name__}")
        return text

    def _jsonl_member(self, ref: SampleRef, data: bytes) -> tuple[str, bytes]:
        """The line's text as a ``KEY.txt`` member, or a conversation's line (``messages``,
        ``loaders.chat``) as a ``KEY.json`` member."""
        line = decode_text(data)
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise Corrupt(f"{ref.shard}: bytes [{ref.offset}, {ref.offset + ref.size}) are not "
                          f"a JSON line ({short(e)})") from None
        conversation = isinstance(obj, dict) and "messages" in obj and "text" not in obj
        if not isinstance(obj, dict) or not (conversation or isinstance(obj.get("text"), str)):
            raise Corrupt(f"{ref.shard}: line at byte {ref.offset} is not an object with a "
                          "string 'text' field (or 'messages')")
        if obj.get("key") is not None:
            _check_key(ref, obj["key"])
        if conversation:
            return f"{ref.key}.json", data
        return f"{ref.key}.txt", obj["text"].encode("utf-8")

    # --- files --------------------------------------------------------------------------------

    def _read_range(self, ref: SampleRef, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0 or size > MAX_SAMPLE_BYTES:
            raise Corrupt(f"{ref.shard}: bad byte range [{offset}, {offset + size})")
        handle = self._shard(*self._path(ref)).handle
        handle.seek(offset)
        data = handle.read(size)
        if len(data) < size:
            # A short read means the shard ends inside the range: truncated or replaced.
            raise Corrupt(f"{ref.shard}: byte range [{offset}, {offset + size}) is past the end "
                          f"of the shard ({offset + len(data)} bytes)")
        return data

    def _path(self, ref: SampleRef) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, root = self._filesystem(ref.source)
        return fs, (f"{root.rstrip('/')}/{ref.shard}" if root else ref.shard)

    def _location(self, source: str) -> Location:
        loc = self._locs.get(source)
        if loc is None:
            raise UserError(f"source {source!r}: the loader has no path for it (known: "
                            f"{', '.join(sorted(self._locs)) or 'none'})")
        return loc

    def _filesystem(self, source: str) -> tuple[fsspec.AbstractFileSystem, str]:
        if source not in self._fs:
            self._fs[source] = self._location(source).fs()
        return self._fs[source]

    def _shard(self, fs: fsspec.AbstractFileSystem, path: str) -> "_OpenShard":
        shard = self._open.get(path)
        if shard is not None:
            self._open.move_to_end(path)
            return shard
        while len(self._open) >= self._max_open:
            self._close_shard(next(iter(self._open)))
        shard = _OpenShard(fs.open(path, "rb"))
        self._open[path] = shard
        return shard

    def _close_shard(self, path: str) -> None:
        shard = self._open.pop(path, None)
        if shard is not None:
            shard.handle.close()
        if self._group is not None and self._group[0] == path:
            self._group = None


@dataclass
class _OpenShard:
    handle: object  # a binary file object from fsspec
    parquet: object | None = None  # pyarrow.parquet.ParquetFile over ``handle``


def shard_format(shard: str) -> str:
    """``tar``, ``parquet`` or ``jsonl`` from the shard's suffix (the index's naming)."""
    for suffix, fmt in ((".tar", "tar"), (".parquet", "parquet"), (".jsonl", "jsonl")):
        if shard.endswith(suffix):
            return fmt
    raise UserError(f"shard {shard!r}: unknown format (expected .tar, .parquet or .jsonl)")


def _check_header(name: str, size: int, block: bytes) -> None:
    """The tar header in front of a member's data must describe that member."""
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        raise Corrupt(f"missing member {name!r}: no tar header in front of its bytes (the shard "
                      "changed since indexing?)") from None
    # Names over 100 bytes live in a GNU/pax header before this one, truncated here.
    same_name = info.name == name or len(name.encode("utf-8")) >= 100
    if not same_name or info.size != size:
        raise Corrupt(f"missing member {name!r}: the tar holds {info.name!r} ({info.size} "
                      "bytes) there (the shard changed since indexing?)")


def _check_key(ref: SampleRef, key) -> None:
    if str(key) != ref.key:
        raise Corrupt(f"{ref.shard}: the record holds key {str(key)!r}, not {ref.key!r} (the "
                      "shard changed since indexing?)")
