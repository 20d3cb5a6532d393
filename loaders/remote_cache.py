"""Reads of remote shards through the node's block cache (:mod:`loaders.block_cache`): a read
takes the blocks the cache has and fetches each run of missing blocks in one request, and
:class:`Prefetcher` fills the cache ahead of the readers (the loader hands it the refs of
steps to come).
"""


from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from omniscale.loaders.block_cache import BlockCache, CacheConfig
from omniscale.loaders.remote_io import (
    Counters,
    FetchError,
    RangeFetcher,
    RemoteSettings,
    fingerprint,
    past_end,
    range_error,
)
from omniscale.location import Location

MAX_FINGERPRINTS = 65536  # shards whose fingerprint a reader remembers


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
        looked_up = set(asked)  # a set: a read of thousands of shards at once stays linear
        with self._lock:
            for loc, info in [*((loc, shared[loc]) for loc in unknown if shared[loc]),
                              *zip(asked, infos)]:
                if isinstance(info, FetchError):
                    out[loc] = info
                    continue
                fp = info if loc not in looked_up else fingerprint(info)
                if loc in looked_up:
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
        # Reentrant: submit adds each future's done callback under it, and a future done
        # already runs its callback (which takes the lock) at once, in submit's thread.
        self._lock = threading.RLock()
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
