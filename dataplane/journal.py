"""The plane's durable state in ``--state-dir``: the log (the truth), snapshots (a shortcut) and
copies of every spec the plane applied.

The plane is deterministic from the specs and the **log** (``wal.jsonl``): its first record
says how the job started (spec, settings), the others what happened since (commits with the
fingerprint of what each rank received, reloads, resizes, cost refits, corrupt samples). A
**snapshot** stores the state at a window start and the log offset it follows, so a restart
replays a short tail instead of the whole log; when none verifies, the whole log is replayed.

Every log line is ``{"c": CRC32 of the record's bytes, "r": record}``: JSON for people and
tools, and a flipped byte is caught. On open, the bytes after the last complete record (a
write a crash tore) are moved aside to ``wal.torn-N.bin`` and the log is cut and fsynced
before anything is appended; a bad record anywhere else is refused in one line (``UserError``)
-- never skipped, since that would silently forget trained steps.

Snapshots are written atomically (temp file, fsync, rename, fsync of the directory) and carry a
SHA-256 of their body. Specs are stored content-addressed (``specs/<sha256>.yaml``) when
applied, so an edited or deleted spec file cannot change history. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import zlib
from pathlib import Path

from omniscale.errors import UserError

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 2
_HEAD, _TAIL = b'{"c":"', b'}'  # a line: {"c":"xxxxxxxx","r":<record>}


WAL_NAME = "wal.jsonl"  # the log, in the state dir


class JournalError(UserError):
    """The state dir cannot be trusted as it is: a corrupt log record, a log shorter than a
    snapshot says it was, a spec copy that does not match its hash."""


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a created, renamed or removed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_record(record: dict) -> bytes:
    body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return b'%s%08x","r":%s%s\n' % (_HEAD, zlib.crc32(body), body, _TAIL)


def decode_record(line: bytes) -> dict | None:
    """The record of one line (without its newline), or None when the line is not intact."""
    if not (line.startswith(_HEAD) and line[14:19] == b'","r"' and line.endswith(_TAIL)):
        return None
    body = line[20:-1]
    try:
        # the checksum as written, byte for byte: int() would also take " 1f", "+1f", "1F"
        if line[19:20] != b":" or line[6:14] != b"%08x" % zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("t"), str) else None


class Journal:
    """The log, snapshots (``snapshots/snap-<step>.json``) and spec copies of one job.

    ``readonly`` (audits, or reading a live plane's dir): write nothing; a torn tail is then
    ignored rather than cut (a live plane may be writing it)."""

    def __init__(self, state_dir: str | Path, readonly: bool = False):
        self.dir = Path(state_dir)
        self.readonly = readonly
        self.snapshots = self.dir / "snapshots"
        self.specs = self.dir / "specs"
        self.wal = self.dir / WAL_NAME
        # Group commit: records are written under `_write_lock`; `sync_to` fsyncs under
        # `_sync_lock`, and one fsync makes every record written before it durable, so
        # concurrent writers waiting for durability share fsyncs instead of queueing one each.
        self._write_lock, self._sync_lock = threading.Lock(), threading.Lock()
        self.fsyncs = 0
        if readonly:
            if not self.wal.is_file():
                raise JournalError(f"{self.dir}: no {WAL_NAME} (is this a plane state dir?)")
            self.end = self._scan()
        else:
            self._create()
            self.end = self._scan()
            self._heal()
        self.written = self.synced = self.end  # bytes written / known durable

    # -- opening --------------------------------------------------------------------------
    def _create(self) -> None:
        for d in (self.dir, self.snapshots, self.specs):
            if not d.is_dir():
                d.mkdir(parents=True, exist_ok=True)
                fsync_dir(d.parent)
        if not self.wal.exists():
            self.wal.touch()
            fsync_dir(self.dir)
        for d in (self.snapshots, self.specs):
            for stale in d.glob("*.tmp*"):  # a crash between write and rename
                stale.unlink()
                log.warning("%s: removed a half-written file", stale)

    def _scan(self) -> int:
        """Check every record's checksum; returns the offset after the last complete record
        (where a torn tail, if any, starts). A bad record before that is a JournalError."""
        with open(self.wal, "rb") as f:
            data = f.read()
        pos, n = 0, 0
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            n += 1
            if decode_record(data[pos:nl]) is None:
                raise JournalError(
                    f"{self.wal}: record {n} (byte {pos}) is corrupt and is not the last one; "
                    "refusing to start from a log that lies (restore the state dir from a "
                    "backup, or start a new one)")
            pos = nl + 1
        tail = data[pos:]
        self._torn, self._whole_tail = tail, None
        # A record whole but for its newline (cut just before it, or the newline itself
        # damaged: a write never puts anything else after a record's closing brace) is kept.
        for whole in (tail, tail[:-1]):
            if whole and decode_record(whole) is not None:
                self._torn, self._whole_tail = b"", whole
                return pos + len(whole) + 1
        return pos

    def _heal(self) -> None:
        """Cut a torn tail (kept aside for inspection) before anything is appended."""
        if self._whole_tail is not None:
            with open(self.wal, "r+b") as f:
                f.truncate(self.end - 1)
                f.seek(self.end - 1)
                f.write(b"\n")
                os.fsync(f.fileno())
            log.warning("%s: the last record had lost its newline; restored", self.wal)
            return
        if not self._torn:
            return
        n = len(list(self.dir.glob("wal.torn-*.bin")))
        kept = self.dir / f"wal.torn-{n}.bin"
        with open(kept, "wb") as f:
            f.write(self._torn)
            os.fsync(f.fileno())
        with open(self.wal, "r+b") as f:
            f.truncate(self.end)
            os.fsync(f.fileno())
        fsync_dir(self.dir)
        log.warning("%s: a torn last record (%d bytes, a crash while writing) was cut off and "
                    "kept in %s", self.wal, len(self._torn), kept.name)
        self._torn = b""

    # -- log ------------------------------------------------------------------------------
    def append(self, record: dict, sync: bool = True) -> int:
        """Append one record; returns the log's size after it (a replay offset). Durable on
        return, or with ``sync=False`` once ``sync_to`` that offset returned."""
        if self.readonly:
            raise RuntimeError(f"{self.dir}: opened read-only")
        line = encode_record(record)
        with self._write_lock:
            with open(self.wal, "ab") as f:
                f.write(line)
                f.flush()
                self.written = f.tell()
            offset = self.written
        if sync:
            self.sync_to(offset)
        return offset

    def sync_to(self, offset: int) -> None:
        """Make the log durable up to ``offset`` (at least): one fsync, unless another caller's
        fsync already covered it."""
        with self._sync_lock:
            if self.synced >= offset:
                return
            with self._write_lock:
                target = self.written
            fd = os.open(self.wal, os.O_RDONLY)
            try:
                os.fsync(fd)  # the inode's dirty pages: whichever descriptor wrote them
            finally:
                os.close(fd)
            self.synced, self.fsyncs = max(self.synced, target), self.fsyncs + 1

    def records(self, offset: int = 0, end: int | None = None) -> list[tuple[int, dict]]:
        """``(offset after it, record)`` of every complete record from byte ``offset`` to
        ``end`` (default: as far as the log was complete when read)."""
        with open(self.wal, "rb") as f:
            f.seek(offset)
            data = f.read((self.size() if end is None else end) - offset)
        out, pos = [], 0
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            record = decode_record(data[pos:nl])
            if record is None:
                raise JournalError(f"{self.wal}: the record at byte {offset + pos} is corrupt")
            pos = nl + 1
            out.append((offset + pos, record))
        return out

    def size(self) -> int:
        return self.wal.stat().st_size

    def first_record(self) -> tuple[int, dict] | None:
        """``(offset after it, record)`` of the log's first record; None when it is empty."""
        with open(self.wal, "rb") as f:
            line = f.readline()
        if not line.endswith(b"\n"):
            return None
        record = decode_record(line[:-1])
        if record is None:
            raise JournalError(f"{self.wal}: record 1 (byte 0) is corrupt")
        return len(line), record

    def roll_back(self, offset: int) -> Path | None:
        """Cut the log at ``offset`` (a restore to an earlier step); the cut tail is kept
        beside it for the record. Returns where the tail went, if there was one."""
        size = self.size()
        if size <= offset:
            return None
        with open(self.wal, "rb") as f:
            f.seek(offset)
            tail = f.read()
        n = len(list(self.dir.glob("wal.rolled-back-*.jsonl")))
        kept = self.dir / f"wal.rolled-back-{n}.jsonl"
        with open(kept, "wb") as f:
            f.write(tail)
            os.fsync(f.fileno())
        fsync_dir(self.dir)
        with self._sync_lock, self._write_lock:
            with open(self.wal, "r+b") as f:
                f.truncate(offset)
                os.fsync(f.fileno())
            self.written = self.synced = offset
        return kept

    # -- specs ----------------------------------------------------------------------------
    def store_spec(self, text: str) -> str:
        """Keep ``text`` (a spec's YAML) as ``specs/<sha256>.yaml``; returns the hash."""
        data = text.encode()
        digest = hashlib.sha256(data).hexdigest()
        path = self.specs / f"{digest}.yaml"
        if not path.exists():
            _write_atomic(path, data)
        return digest

    def spec_text(self, digest: str) -> str:
        path = self.specs / f"{digest}.yaml"
        try:
            data = path.read_bytes()
        except OSError as e:
            raise JournalError(f"{path}: the plane's copy of an applied spec cannot be read "
                               f"({e.strerror})") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise JournalError(f"{path}: the plane's copy of an applied spec does not match "
                               "its hash (changed after it was applied)")
        return data.decode()

    # -- snapshots ------------------------------------------------------------------------
    def write_snapshot(self, state: dict) -> Path:
        """Write ``state`` (which has a ``step``) atomically; returns its path."""
        body = json.dumps({**state, "version": SNAPSHOT_VERSION}, sort_keys=True)
        digest = hashlib.sha256(body.encode()).hexdigest()
        path = self.snapshots / f"snap-{int(state['step']):010d}.json"
        _write_atomic(path, json.dumps({"sha256": digest, "body": body}).encode())
        return path

    def snapshot_steps(self) -> list[int]:
        steps = []
        for p in self.snapshots.glob("snap-*.json"):
            try:
                steps.append(int(p.stem.split("-")[1]))
            except ValueError:
                log.warning("%s: not a snapshot's name; ignored", p)
        return sorted(steps)

    def load_snapshot(self, step: int | None = None) -> dict | None:
        """The snapshot of ``step``, or the latest valid one when ``step`` is None.

        Corrupt or half-written snapshots are skipped with a warning (falling back to the one
        before); None when none verifies. Asking for a ``step`` whose snapshot is missing or
        corrupt is a JournalError: restoring some other step would be wrong.
        """
        steps = self.snapshot_steps()
        if step is not None:
            if step not in steps:
                raise JournalError(f"{self.snapshots}: no snapshot of step {step} (have: "
                                   f"{', '.join(map(str, steps)) or 'none'})")
            state = self._read(self.snapshots / f"snap-{step:010d}.json")
            if state is None:
                raise JournalError(f"{self.snapshots}: the snapshot of step {step} is corrupt")
            return state
        for s in reversed(steps):
            state = self._read(self.snapshots / f"snap-{s:010d}.json")
            if state is not None:
                return state
        return None

    def _read(self, path: Path) -> dict | None:
        try:
            outer = json.loads(path.read_text())
            body = outer["body"]
            if hashlib.sha256(body.encode()).hexdigest() != outer["sha256"]:
                raise ValueError("checksum mismatch")
            state = json.loads(body)
            if state.get("version") != SNAPSHOT_VERSION:
                raise ValueError(f"version {state.get('version')} (expected {SNAPSHOT_VERSION})")
            if state["wal_offset"] > self.size():
                raise JournalError(f"{path}: follows {state['wal_offset']} bytes of log, but "
                                   f"{self.wal} holds {self.size()}: the log lost records")
            return state
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("%s: skipping a corrupt snapshot (%s)", path, e)
            return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
