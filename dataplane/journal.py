"""The plane's durable state: snapshots plus a write-ahead log, in ``--state-dir``.

The plane is deterministic from (spec, seed, mixer state at a window start, dp), so what must
survive a crash is small: a **snapshot** (the mixer state at the start of the window holding
the next step to serve, the spec and dp that window was planned with) and a **log** of what
happened since (steps committed with the fingerprint of what each rank received, mixture
reloads, dp changes). Restart = latest valid snapshot + replay of the log after it.

Snapshots are written atomically (temp file, fsync, rename, fsync of the directory) and carry a
SHA-256 of their body; a corrupt or half-written one is skipped with a warning and the previous
one used. A log line cut short by a crash is ignored the same way. Files are JSON: readable by
people and tools, and nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """Snapshots (``snapshots/snap-<step>.json``) and the log (``wal.jsonl``) of one job."""

    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)
        self.snapshots = self.dir / "snapshots"
        self.snapshots.mkdir(parents=True, exist_ok=True)
        self.wal = self.dir / "wal.jsonl"
        self.wal.touch(exist_ok=True)
        # Group commit: records are written under `_write_lock`; `sync_to` fsyncs under
        # `_sync_lock`, and one fsync makes every record written before it durable, so
        # concurrent writers waiting for durability share fsyncs instead of queueing one each.
        self._write_lock, self._sync_lock = threading.Lock(), threading.Lock()
        self.written = self.synced = self.size()  # bytes written / known durable
        self.fsyncs = 0

    # -- log ------------------------------------------------------------------------------
    def append(self, record: dict, sync: bool = True) -> int:
        """Append one record; returns the log's size after it (a replay offset). Durable on
        return, or with ``sync=False`` once ``sync_to`` that offset returned."""
        line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
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

    def records(self, offset: int = 0) -> list[dict]:
        """Every complete record from byte ``offset`` on; a torn last line is dropped."""
        with open(self.wal, "rb") as f:
            f.seek(offset)
            data = f.read()
        out = []
        for i, line in enumerate(data.split(b"\n")):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if data.endswith(b"\n") or i != data.count(b"\n"):
                    raise ValueError(f"{self.wal}: record {len(out) + 1} after byte {offset} "
                                     "is corrupt (not a torn last line)") from None
                log.warning("%s: ignoring a torn last record (crash while writing)", self.wal)
        return out

    def size(self) -> int:
        return self.wal.stat().st_size

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
        kept.write_bytes(tail)
        with self._sync_lock, self._write_lock:
            with open(self.wal, "r+b") as f:
                f.truncate(offset)
                os.fsync(f.fileno())
            self.written = self.synced = offset
        return kept

    # -- snapshots ------------------------------------------------------------------------
    def write_snapshot(self, state: dict) -> Path:
        """Write ``state`` (which has a ``step``) atomically; returns its path."""
        body = json.dumps({**state, "version": SNAPSHOT_VERSION}, sort_keys=True)
        digest = hashlib.sha256(body.encode()).hexdigest()
        path = self.snapshots / f"snap-{int(state['step']):010d}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(json.dumps({"sha256": digest, "body": body}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.snapshots)
        return path

    def snapshot_steps(self) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in self.snapshots.glob("snap-*.json"))

    def load_snapshot(self, step: int | None = None) -> dict | None:
        """The snapshot of ``step``, or the latest valid one when ``step`` is None.

        Corrupt or half-written snapshots are skipped with a warning (falling back to the one
        before); None when there is none at all. Asking for a ``step`` whose snapshot is
        missing or corrupt is a ValueError: restoring some other step would be wrong.
        """
        steps = self.snapshot_steps()
        if step is not None:
            if step not in steps:
                raise ValueError(f"{self.snapshots}: no snapshot of step {step} (have: "
                                 f"{', '.join(map(str, steps)) or 'none'})")
            state = self._read(self.snapshots / f"snap-{step:010d}.json")
            if state is None:
                raise ValueError(f"{self.snapshots}: the snapshot of step {step} is corrupt")
            return state
        for s in reversed(steps):
            state = self._read(self.snapshots / f"snap-{s:010d}.json")
            if state is not None:
                return state
        return None

    @staticmethod
    def _read(path: Path) -> dict | None:
        try:
            outer = json.loads(path.read_text())
            body = outer["body"]
            if hashlib.sha256(body.encode()).hexdigest() != outer["sha256"]:
                raise ValueError("checksum mismatch")
            state = json.loads(body)
            if state.get("version") != SNAPSHOT_VERSION:
                raise ValueError(f"version {state.get('version')} (expected {SNAPSHOT_VERSION})")
            return state
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s: skipping a corrupt snapshot (%s); falling back to the one before",
                        path, e)
            return None
