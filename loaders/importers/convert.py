"""One input file into WebDataset shards: the unit of work of ``omniscale data import``.

Runs in a worker process. Samples go into ``{stem}-00000.tar``, ``{stem}-00001.tar``, ... of
at most ``samples_per_shard`` each, written under temporary names (``.NAME.part``) and renamed
only once the whole file is converted, so a shard with a final name is always complete. A
sample is ``KEY.json`` (``loaders.conversation``) and its media ``KEY.N.EXT``, numbered per kind
in the order their parts appear; its key is ``{stem}-{record number}``, so the same input makes
the same shards, byte for byte (fixed member metadata), whatever ran before.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omniscale.loaders.importers import llava, openai, sharegpt
from omniscale.loaders.importers.form import Conversation
from omniscale.loaders.importers.media import MediaFetcher
from omniscale.loaders.importers.records import Record, Skip, read_records

FORMATS: dict[str, Callable[[object], Conversation]] = {
    "openai": openai.parse, "sharegpt": sharegpt.parse, "llava": llava.parse}
# Fixed member metadata: a tar otherwise records who wrote it and when.
MTIME = 1_700_000_000
OWNER = "omniscale"
PROGRESS_BYTES = 1 << 20  # report progress in steps of this much input


@dataclass(frozen=True)
class FileTask:
    """``path``: the input file; ``rel``: its name in origins and skips; ``stem``: the prefix
    of its shards and keys; ``media_root``: where relative references point (None: beside
    the input file)."""

    fmt: str
    path: str
    rel: str
    stem: str
    out: str
    samples_per_shard: int
    media_root: str | None = None


@dataclass
class FileResult:
    rel: str
    shards: list[str]
    samples: int
    skipped: list[dict]


def convert_file(task: FileTask, progress: Callable[[int], None] | None = None) -> FileResult:
    """Convert ``task.path``; ``progress`` is called with the input bytes read since its last
    call. Every record is either a sample or an entry in ``skipped``."""
    parse = FORMATS[task.fmt]
    fetcher = MediaFetcher(Path(task.media_root or Path(task.path).parent))
    writer = ShardWriter(Path(task.out), task.stem, task.samples_per_shard)
    skipped, reported = [], 0
    try:
        for record in read_records(Path(task.path)):
            try:
                if record.skip is not None:
                    raise record.skip
                conversation = parse(record.value)
                members = media_members(conversation, fetcher)
            except Skip as skip:
                skipped.append(skip_entry(task.rel, record, skip))
            else:
                sample = {"messages": conversation.messages,
                          "origin": origin(task.rel, record)}
                meta = json.dumps(sample, ensure_ascii=False).encode("utf-8")
                writer.add(f"{task.stem}-{record.number:09d}", [("json", meta), *members])
            if progress is not None and record.consumed - reported >= PROGRESS_BYTES:
                progress(record.consumed - reported)
                reported = record.consumed
        shards = writer.finish()
    except BaseException:
        writer.abort()
        raise
    if progress is not None:
        progress(max(_size(task.path) - reported, 0))
    return FileResult(task.rel, shards, writer.samples, skipped)


def media_members(conversation: Conversation, fetcher: MediaFetcher
                  ) -> list[tuple[str, bytes]]:
    """``(N.EXT, bytes)`` per media item, N counting each kind from 0 in part order."""
    members, counts = [], {}
    for item in conversation.media:
        ext, data = fetcher.fetch(item)
        n = counts[item.kind] = counts.get(item.kind, -1) + 1
        members.append((f"{n}.{ext}", data))
    return members


def origin(rel: str, record: Record) -> dict:
    found = {"file": rel, "line": record.line}
    if record.index is not None:
        found["index"] = record.index
    ident = record.value.get("id") if isinstance(record.value, dict) else None
    if isinstance(ident, (str, int)) and not isinstance(ident, bool):
        found["id"] = ident
    return found


def skip_entry(rel: str, record: Record, skip: Skip) -> dict:
    entry = {"file": rel, "line": record.line}
    if record.index is not None:
        entry["index"] = record.index
    return {**entry, "category": skip.category, "reason": skip.reason}


class ShardWriter:
    """Tar shards of at most ``per_shard`` samples, under temporary names until
    :meth:`finish` renames them all."""

    def __init__(self, out: Path, stem: str, per_shard: int) -> None:
        self.out, self.stem, self.per_shard = out, stem, per_shard
        self.names: list[str] = []
        self.samples = 0
        self._tar: tarfile.TarFile | None = None

    def add(self, key: str, members: list[tuple[str, bytes]]) -> None:
        if self._tar is None or self.samples % self.per_shard == 0:
            self._next()
        for suffix, data in members:
            info = tarfile.TarInfo(f"{key}.{suffix}")
            info.size, info.mtime, info.mode = len(data), MTIME, 0o644
            info.uname = info.gname = OWNER
            self._tar.addfile(info, io.BytesIO(data))
        self.samples += 1

    def finish(self) -> list[str]:
        self._close()
        for name in self.names:
            os.replace(self._part(name), self.out / name)
        return list(self.names)

    def abort(self) -> None:
        self._close()
        for name in self.names:
            self._part(name).unlink(missing_ok=True)

    def _next(self) -> None:
        self._close()
        self.names.append(f"{self.stem}-{len(self.names):05d}.tar")
        self._tar = tarfile.open(self._part(self.names[-1]), "w", format=tarfile.PAX_FORMAT)

    def _close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def _part(self, name: str) -> Path:
        return self.out / f".{name}.part"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
