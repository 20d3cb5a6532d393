"""The node-local block store of remote shards: fixed-size blocks in one directory, shared by
every process on the node.

A remote shard is cached as aligned blocks of ``block_bytes`` (block ``i`` holds bytes
``[i*B, (i+1)*B)``), each its own file named by the object and its fingerprint (URL, size and
ETag, looked up once per shard per reader): an object replaced in the store has a new ETag,
hence new names, and its old blocks are never served for it (they age out).

Several worker processes and ranks share one directory. Nothing needs a lock to read: a block
file appears whole (written to a temporary file, then ``os.replace``) and a reader opens it
before reading, so a block evicted meanwhile stays readable through the open descriptor. The
bookkeeping -- the total size and eviction, least recently used first (a hit sets the block's
time) -- runs under one ``filelock`` in the directory, once per batch of blocks written.
Eviction frees down to 90% of ``max_bytes`` so it runs once per tenth of the cache written,
not once per block. Reads through it: :mod:`loaders.remote_cache`.
"""


from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass

from filelock import FileLock

from omniscale.loaders.remote_io import (
    MiB,
)
from omniscale.location import Location

LOW_WATER = 0.9  # eviction frees down to this share of max_bytes
STALE_TMP_S = 3600  # a temporary block file older than this was left by a dead writer
FINGERPRINT_TTL_S = 60.0  # a lookup recorded by another process of the node is reused this long


@dataclass(frozen=True)
class CacheConfig:
    """Where the cache is, its size cap, and its block size (also the smallest fetch)."""

    dir: str
    max_bytes: int
    block_bytes: int = 4 * MiB

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", os.path.abspath(os.fspath(self.dir)))
        if self.block_bytes < 1 or self.max_bytes < self.block_bytes:
            raise ValueError(f"cache {self.dir}: max_bytes ({self.max_bytes}) must be at least "
                             f"one block ({self.block_bytes} bytes)")


class BlockCache:
    """One process's handle on a shared cache directory."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        os.makedirs(config.dir, exist_ok=True)
        self._lock = FileLock(os.path.join(config.dir, ".lock"))
        self._usage = os.path.join(config.dir, "usage")

    def key(self, loc: Location, fp: dict) -> str:
        """An object's name in the cache: its URL, store endpoint, size and ETag."""
        options = loc.storage_options
        endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
            "endpoint_url")
        ident = json.dumps([loc.url, endpoint, fp["size"], fp.get("etag")])
        return hashlib.sha256(ident.encode()).hexdigest()[:40]

    def _fingerprint_path(self, loc: Location) -> str:
        name = hashlib.sha256(json.dumps([loc.url, loc.options_json]).encode()).hexdigest()
        return os.path.join(self.config.dir, "fingerprints", f"{name[:40]}.json")

    def share_fingerprint(self, loc: Location, fp: dict) -> None:
        """Record a lookup for the node's other readers (atomically; best effort)."""
        path = self._fingerprint_path(loc)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "w") as f:
                json.dump(fp, f)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only or full cache: each reader looks up for itself

    def recent_fingerprint(self, loc: Location) -> dict | None:
        """A lookup another process recorded less than ``FINGERPRINT_TTL_S`` ago, or None.
        The bound is how long a replaced object can go unnoticed by a new reader; a reader
        that looked up keeps its answer for its whole life anyway."""
        path = self._fingerprint_path(loc)
        try:
            if time.time() - os.stat(path).st_mtime > FINGERPRINT_TTL_S:
                return None
            with open(path) as f:
                fp = json.load(f)
        except (OSError, ValueError):
            return None
        return fp if isinstance(fp, dict) and "size" in fp else None

    def path(self, key: str, index: int) -> str:
        return os.path.join(self.config.dir, key[:2], f"{key}.{index}")

    def block_len(self, index: int, size: int) -> int:
        b = self.config.block_bytes
        return max(0, min(b, size - index * b))

    def open(self, key: str, index: int, length: int) -> int | None:
        """A descriptor of the block (marked used now), or None when it is not cached."""
        try:
            fd = os.open(self.path(key, index), os.O_RDONLY)
        except FileNotFoundError:
            return None
        if os.fstat(fd).st_size != length:  # a damaged block: fetched again, replaced
            os.close(fd)
            return None
        now = time.time_ns()  # not the kernel's coarse clock: LRU order within a millisecond
        try:
            os.utime(fd, ns=(now, now))
        except OSError:
            pass  # a read-only cache still serves
        return fd

    def has(self, key: str, index: int, length: int) -> bool:
        try:
            return os.stat(self.path(key, index)).st_size == length
        except FileNotFoundError:
            return False

    def put(self, key: str, blocks: dict[int, bytes]) -> None:
        """Store blocks (written outside the lock, published and accounted under it)."""
        cap = self.config.max_bytes
        staged = []
        for index, data in blocks.items():
            if len(data) > cap:
                continue
            final = self.path(key, index)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = f"{final}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            now = time.time_ns()
            os.utime(tmp, ns=(now, now))
            staged.append((tmp, final, len(data)))
        if not staged:
            return
        with self._lock:
            used = self._read_usage()
            for tmp, final, n in staged:
                try:
                    old = os.stat(final).st_size
                except FileNotFoundError:
                    old = None
                if old == n:  # another process stored it first
                    os.unlink(tmp)
                    continue
                used -= old or 0
                if used + n > cap:
                    used = self._evict(max(0, int(cap * LOW_WATER) - n))
                os.replace(tmp, final)
                used += n
            self._write_usage(used)

    def usage(self) -> int:
        """Bytes of block files, as accounted (scanned when there is no account yet)."""
        with self._lock:
            return self._read_usage()

    def _read_usage(self) -> int:
        try:
            with open(self._usage) as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            return self._evict(None)  # no (readable) account: count the blocks

    def _write_usage(self, used: int) -> None:
        with open(self._usage, "w") as f:
            f.write(str(max(used, 0)))

    def _evict(self, target: int | None) -> int:
        """Delete the least recently used blocks until at most ``target`` bytes remain
        (None: delete nothing); the bytes that remain. Called under the lock."""
        blocks, now = [], time.time()
        for sub in os.scandir(self.config.dir):
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue  # not a block folder (the lock, the account)
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                    if entry.name.endswith(".tmp"):
                        if now - st.st_mtime > STALE_TMP_S:
                            os.unlink(entry.path)
                        continue
                except FileNotFoundError:
                    continue
                blocks.append((st.st_mtime_ns, entry.path, st.st_size))
        total = sum(size for _, _, size in blocks)
        if target is not None and total > target:
            for _, path, size in sorted(blocks):
                try:
                    os.unlink(path)  # an open descriptor keeps a concurrent read whole
                except FileNotFoundError:
                    pass
                total -= size
                if total <= target:
                    break
        self._write_usage(total)
        return total
