"""Read a sample's bytes by reference: what a stateless loader worker does with a SampleRef.

A ref names its source (by name), shard, byte range and members (``dataplane.refs``), so a
worker needs no index: it opens the shard, reads one range and slices it. The shard's format
follows from its suffix (``loaders.index.SHARD_SUFFIX``):

- ``.tar`` (WebDataset): ``offset``/``size`` is the sample's contiguous slice of the tar, read
  in one call; each member's data range is checked against the tar header in front of it, so a
  shard rewritten since indexing is caught instead of decoding someone else's bytes;
- ``.parquet``: ``offset`` is the row group and ``size`` the row within it (column ``text``);
- ``.jsonl``: ``offset``/``size`` is the line's byte range (newline excluded).

Paths go through fsspec, so a source at ``s3://…`` or ``gs://…`` works once that fsspec
backend is installed; local paths need nothing. Every problem with the bytes is a
:class:`~loaders.errors.CorruptSample` naming source and key.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import fsspec

from omniscale.dataplane.errors import UserError
from omniscale.dataplane.refs import SampleRef
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.probe import Corrupt, decode_text, short

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

    Keeps at most ``max_open`` shards open (least recently used closed first): workers read
    many sources, so the handle count, not the source count, bounds its memory.
    """

    def __init__(self, sources: Mapping[str, str | os.PathLike], max_open: int = MAX_OPEN_FILES,
                 storage_options: Mapping[str, dict] | None = None) -> None:
        if max_open < 1:
            raise ValueError(f"max_open: must be >= 1, got {max_open}")
        self._roots = {name: os.fspath(path) for name, path in sources.items()}
        self._options = dict(storage_options or {})  # per source name: fsspec options
        self._fs: dict[str, tuple[fsspec.AbstractFileSystem, str]] = {}
        self._open: OrderedDict[str, _OpenShard] = OrderedDict()
        self._max_open = max_open
        self._group: tuple[str, int, object] | None = None  # last Parquet row group read

    @property
    def sources(self) -> dict[str, str]:
        """Source name -> its directory (or URL)."""
        return dict(self._roots)

    def read(self, ref: SampleRef) -> RawSample:
        """The ref's members as bytes; CorruptSample when the bytes are not what it says."""
        fmt = shard_format(ref.shard)
        try:
            if fmt == "tar":
                members = self._read_tar(ref)
            elif fmt == "parquet":
                members = ((f"{ref.key}.txt", self._read_parquet(ref).encode("utf-8")),)
            else:
                members = (self._read_jsonl(ref),)
        except Corrupt as e:
            raise CorruptSample(ref.source, ref.key, str(e)) from None
        except (OSError, ValueError) as e:  # pyarrow's errors subclass these too
            self._close_shard(self._path(ref)[1])
            raise CorruptSample(ref.source, ref.key,
                                f"{ref.shard}: unreadable ({short(e)})") from None
        return RawSample(ref.source, ref.key, members)

    @property
    def open_files(self) -> int:
        return len(self._open)

    def close(self) -> None:
        for path in list(self._open):
            self._close_shard(path)
        self._group = None

    def __enter__(self) -> "SampleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- formats ------------------------------------------------------------------------------

    def _read_tar(self, ref: SampleRef) -> tuple[tuple[str, bytes], ...]:
        if not ref.members:
            raise Corrupt("the ref lists no members")
        data = self._read_range(ref, ref.offset, ref.size)
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

    def _read_jsonl(self, ref: SampleRef) -> tuple[str, bytes]:
        """The line's text as a ``KEY.txt`` member, or a conversation's line (``messages``,
        ``loaders.chat``) as a ``KEY.json`` member."""
        data = self._read_range(ref, ref.offset, ref.size)
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

    def _filesystem(self, source: str) -> tuple[fsspec.AbstractFileSystem, str]:
        if source not in self._fs:
            if source not in self._roots:
                raise UserError(f"source {source!r}: the loader has no path for it (known: "
                                f"{', '.join(sorted(self._roots)) or 'none'})")
            self._fs[source] = fsspec.core.url_to_fs(self._roots[source],
                                                     **self._options.get(source, {}))
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
