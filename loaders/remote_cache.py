"""A node-local cache of remote shards, in fixed-size blocks, shared by every process on it.

A remote shard is cached as aligned blocks of ``block_bytes`` (block ``i`` holds bytes
``[i*B, (i+1)*B)``), each its own file named by the object and its fingerprint (URL, size and
ETag, looked up once per shard per reader): an object replaced in the store has a new ETag,
hence new names, and its old blocks are never served for it (they age out). A read takes the
blocks it has and fetches each run of missing blocks in one request.

Several worker processes and ranks share one directory. Nothing needs a lock to read: a block
file appears whole (written to a temporary file, then ``os.replace``) and a reader opens it
before reading, so a block evicted meanwhile stays readable through the open descriptor. The
bookkeeping -- the total size and eviction, least recently used first (a hit sets the block's
time) -- runs under one ``filelock`` in the directory, once per batch of blocks written.
Eviction frees down to 90% of ``max_bytes`` so it runs once per tenth of the cache written,
not once per block.

:class:`Prefetcher` fills the cache ahead of the readers (the pipeline hands it the refs of
steps to come).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from filelock import FileLock

from omniscale.loaders.remote_io import (
    Counters,
    FetchError,
    MiB,
    RangeFetcher,
    RemoteSettings,
    fingerprint,
    past_end,
    range_error,
)
from omniscale.location import Location

LOW_WATER = 0.9  # eviction frees down to this share of max_bytes
STALE_TMP_S = 3600  # a temporary block file older than this was left by a dead writer
MAX_FINGERPRINTS = 65536  # shards whose fingerprint a reader remembers
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


class CachedReads:
    """A reader's remote ranges through the block cache (thread-safe: the prefetcher's
    threads share one)."""

    def __init__(self, cache: BlockCache, fetcher: RangeFetcher) -> None:
        self.cache, self.fetcher = cache, fetcher
        self._fps: OrderedDict[Location, dict] = OrderedDict()
        self._lock = threading.Lock()

    def fingerprints(self, locs: list[Location]) -> dict[Location, dict | FetchError]:
        """Each object's fingerprint: remembered, or looked up (all unknown ones at once).
        Failures are not remembered: the next read asks again."""
        out: dict[Location, dict | FetchError] = {}
        with self._lock:
            for loc in locs:
                if loc in self._fps:
                    self._fps.move_to_end(loc)
                    out[loc] = self._fps[loc]
        unknown = list(dict.fromkeys(loc for loc in locs if loc not in out))
        # Another process of the node (the plan prefetcher, ahead of every worker) may have
        # looked the object up moments ago: as fresh as a lookup of our own, and free.
        shared = {loc: self.cache.recent_fingerprint(loc) for loc in unknown}
        asked = [loc for loc in unknown if shared[loc] is None]
        infos = self.fetcher.info([loc.fs() for loc in asked]) if asked else []
        with self._lock:
            for loc, info in [*((loc, shared[loc]) for loc in unknown if shared[loc]),
                              *zip(asked, infos)]:
                if isinstance(info, FetchError):
                    out[loc] = info
                    continue
                fp = info if loc not in asked else fingerprint(info)
                if loc in asked:
                    self.cache.share_fingerprint(loc, fp)
                out[loc] = self._fps[loc] = fp
                if len(self._fps) > MAX_FINGERPRINTS:
                    self._fps.popitem(last=False)
        return out

    def read(self, wanted: list[tuple[Location, list[tuple[int, int]]]]
             ) -> list[list[bytes | FetchError]]:
        """For each ``(shard object, ranges)``, each range's bytes or its FetchError."""
        plans = self._plan(wanted)
        hits: dict[tuple[int, int], int] = {}  # (object, block) -> open descriptor
        try:
            for k, plan in enumerate(plans):
                if isinstance(plan, _Plan):
                    for b in plan.blocks:
                        fd = self.cache.open(plan.key, b, self.cache.block_len(b, plan.size))
                        if fd is not None:
                            hits[(k, b)] = fd
            missing = {k: [b for b in p.blocks if (k, b) not in hits]
                       for k, p in enumerate(plans) if isinstance(p, _Plan)}
            self.fetcher.counters.add(cache_hits=len(hits),
                                      cache_misses=sum(map(len, missing.values())))
            fetched = self._fetch(plans, missing)
            return [self._slices(k, wanted[k], plan, hits, fetched)
                    for k, plan in enumerate(plans)]
        finally:
            for fd in hits.values():
                os.close(fd)

    def fill(self, wanted: list[tuple[Location, list[tuple[int, int]]]],
             claim=None) -> int:
        """Fetch into the cache the blocks ``wanted`` needs and it lacks; the number fetched.
        ``claim(key, blocks)``: those of the blocks this caller may fetch (the others are in
        flight elsewhere), ``claim(key, blocks, release=True)`` when done. A block is
        checked for in the cache after it is claimed, so two callers never both fetch it."""
        plans = self._plan(wanted)
        claimed, missing = {}, {}
        try:
            for k, p in enumerate(plans):
                if not isinstance(p, _Plan):
                    continue
                mine = claimed[k] = claim(p.key, p.blocks) if claim is not None else p.blocks
                missing[k] = [b for b in mine
                              if not self.cache.has(p.key, b, self.cache.block_len(b, p.size))]
                self.fetcher.counters.add(cache_hits=len(mine) - len(missing[k]))
            fetched = self._fetch(plans, missing)
        finally:
            if claim is not None:
                for k, blocks in claimed.items():
                    claim(plans[k].key, blocks, release=True)
        return sum(not isinstance(v, FetchError) for v in fetched.values())

    def _plan(self, wanted) -> list["_Plan | FetchError"]:
        fps = self.fingerprints([loc for loc, _ in wanted])
        plans: list = []
        b = self.cache.config.block_bytes
        for loc, ranges in wanted:
            fp = fps[loc]
            if isinstance(fp, FetchError):
                plans.append(fp)
                continue
            blocks = set()
            for start, end in ranges:
                if start < end <= fp["size"]:
                    blocks.update(range(start // b, (end + b - 1) // b))
            plans.append(_Plan(loc, self.cache.key(loc, fp), fp["size"], sorted(blocks)))
        return plans

    def _fetch(self, plans: list, missing: dict[int, list[int]]
               ) -> dict[tuple[int, int], bytes | FetchError]:
        """Runs of missing blocks, one request each (at most ``max_request`` bytes), all at
        once; each block stored in the cache and returned."""
        b = self.cache.config.block_bytes
        per_request = max(1, self.fetcher.settings.max_request // b)
        jobs, runs = [], []
        for k, blocks in missing.items():
            plan = plans[k]
            fs, path = plan.loc.fs()
            for first, stop in _runs(blocks, per_request):
                jobs.append((fs, path, first * b, min(stop * b, plan.size)))
                runs.append((k, first, stop))
        out: dict[tuple[int, int], bytes | FetchError] = {}
        for (k, first, stop), data in zip(runs, self.fetcher.fetch(jobs) if jobs else []):
            plan = plans[k]
            expected = min(stop * b, plan.size) - first * b
            if not isinstance(data, FetchError) and len(data) != expected:
                data = FetchError("failed", f"changed in the store while being read (expected "
                                  f"{expected} bytes from byte {first * b}, got {len(data)})")
            if isinstance(data, FetchError):
                out.update(((k, i), data) for i in range(first, stop))
                continue
            blocks = {i: data[(i - first) * b:(i - first + 1) * b] for i in range(first, stop)}
            self.cache.put(plan.key, blocks)
            out.update(((k, i), block) for i, block in blocks.items())
        return out

    def _slices(self, k: int, wanted, plan, hits: dict, fetched: dict) -> list:
        loc, ranges = wanted
        if isinstance(plan, FetchError):
            return [range_error(plan, loc, s, e, None) if e > s else b"" for s, e in ranges]
        b = self.cache.config.block_bytes
        out: list = []
        for start, end in ranges:
            if end <= start:
                out.append(b"")
                continue
            if end > plan.size:
                out.append(past_end(start, end, plan.size))
                continue
            pieces, error = [], None
            for i in range(start // b, (end + b - 1) // b):
                lo, hi = max(start, i * b) - i * b, min(end, (i + 1) * b) - i * b
                if (k, i) in hits:
                    pieces.append(os.pread(hits[(k, i)], hi - lo, lo))
                else:
                    block = fetched[(k, i)]
                    if isinstance(block, FetchError):
                        error = range_error(block, loc, start, end, plan.size)
                        break
                    pieces.append(block[lo:hi])
            out.append(error if error is not None else b"".join(pieces))
        return out


@dataclass
class _Plan:
    loc: Location
    key: str
    size: int
    blocks: list[int]


def _runs(blocks: list[int], most: int) -> list[tuple[int, int]]:
    """Sorted block indices as ``[first, stop)`` runs of consecutive blocks, each at most
    ``most`` long."""
    runs: list[list[int]] = []
    for i in sorted(blocks):
        if runs and runs[-1][1] == i and runs[-1][1] - runs[-1][0] < most:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(a, z) for a, z in runs]


class Prefetcher:
    """Fetches into the cache, in the background, the blocks that refs will need.

    Prefetching needs a cache: without one there is nowhere to keep the bytes for the reader
    that will want them (the pipeline creates a Prefetcher only when a cache is configured).
    Local sources and Parquet shards (read through their own file handles) are skipped.
    ``submit`` never blocks; blocks already cached, or being fetched by this prefetcher, are
    not fetched again. Failures are counted, not raised: the reader that needs the bytes
    retries and reports them.
    """

    def __init__(self, sources: Mapping[str, "Location | str"], cache: CacheConfig,
                 threads: int = 4, settings: RemoteSettings | None = None) -> None:
        self.sources = {name: Location.of(where) for name, where in sources.items()}
        self.counters = Counters()
        self._reads = CachedReads(BlockCache(cache),
                                  RangeFetcher(settings or RemoteSettings(), self.counters))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="omniscale-prefetch")
        self._inflight: set[tuple[str, int]] = set()
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, refs) -> None:
        """Start fetching the blocks of ``refs`` (SampleRefs) that are not cached yet."""
        groups: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for ref in refs:
            loc = self.sources.get(ref.source)
            if loc is None or loc.is_local or not ref.shard.endswith((".tar", ".jsonl")):
                continue
            groups.setdefault((ref.source, ref.shard), []).append(
                (ref.offset, ref.offset + ref.size))
        with self._lock:
            if self._closed:
                return
            for (source, shard), ranges in groups.items():
                future = self._pool.submit(self._fill, self.sources[source].join(shard), ranges)
                self._pending.add(future)
                future.add_done_callback(self._done)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until what was submitted so far is fetched (or failed); False on a
        timeout. For tests and benchmarks: the pipeline never waits on a prefetch."""
        with self._lock:
            pending = list(self._pending)
        return not wait_futures(pending, timeout).not_done

    def stats(self) -> dict[str, int]:
        """``store_*`` counters of its requests, ``prefetch_blocks`` fetched,
        ``cache_hits`` (blocks cached already) and ``prefetch_skipped`` (in flight)."""
        return self.counters.snapshot()

    def close(self, wait: bool = False) -> None:
        """Stop: what has not started is dropped; fetches under way finish in the background
        (each bounded by ``attempt_timeout_s``), or before this returns with ``wait``."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fill(self, loc: Location, ranges: list[tuple[int, int]]) -> None:
        try:
            fetched = self._reads.fill([(loc, ranges)], self._claim)
            self.counters.add(prefetch_blocks=fetched)
        except Exception:  # noqa: BLE001 -- a background fetch must not kill its thread
            self.counters.add(store_errors=1)

    def _done(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def _claim(self, key: str, blocks: list[int], release: bool = False) -> list[int]:
        """Blocks of ``key`` this thread fetches (the others are in flight already)."""
        with self._lock:
            if release:
                self._inflight.difference_update((key, b) for b in blocks)
                return blocks
            mine = [b for b in blocks if (key, b) not in self._inflight]
            self._inflight.update((key, b) for b in mine)
        self.counters.add(prefetch_skipped=len(blocks) - len(mine))
        return mine
