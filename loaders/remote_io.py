"""Byte ranges of objects in a remote store: coalesced, concurrent, retried and counted.

A work item's samples sit close together in a few shards, and an object store charges a
round trip (tens of milliseconds) per request whatever its size. So the ranges of one shard
are merged into few requests (:func:`coalesce`: neighbours closer than ``coalesce_gap``, a
merged request at most ``max_request`` bytes), and the requests of a work item go out
together: on the file system's event loop for async fsspec backends (s3fs, gcsfs, adlfs,
http), on a small thread pool otherwise.

Stores fail transiently (throttling, 5xx, dropped connections, stalls), so
:class:`RangeFetcher` retries those with exponential back-off and jitter, within
``attempts`` tries and ``total_timeout_s`` seconds; each try is cut off after
``attempt_timeout_s`` (a stalled connection is a transient failure, not a hung worker). A
missing object or a range past the end is permanent: it is not retried but comes back as a
:class:`FetchError`, which the reader turns into a CorruptSample naming the shard. Messages
never carry credentials: URLs are shown without ``user:password@`` or query strings.

The fsspec backends retry some errors themselves (botocore, s3fs): those tries are below
this layer and not counted here; ``config_kwargs: {retries: {total_max_attempts: 1}}`` in a
source's storage options leaves retrying to this layer alone.
"""

from __future__ import annotations

import asyncio
import errno
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from omniscale.loaders.probe import short
from omniscale.location import Location

KiB, MiB = 1 << 10, 1 << 20

# What a reader counts (``SampleReader.stats``), summed per step by the pipeline.
READ_STATS = ("store_requests", "store_bytes", "store_retries", "store_errors",
              "cache_hits", "cache_misses")


@dataclass(frozen=True)
class RemoteSettings:
    """How remote reads are batched and retried; the defaults suit S3 from a cloud VM."""

    coalesce_gap: int = 256 * KiB  # ranges of a shard closer than this share a request
    max_request: int = 64 * MiB  # a merged request's cap (a larger sample stays whole)
    concurrency: int = 16  # requests in flight per work item
    attempts: int = 5  # tries per request, the first included
    backoff_s: float = 0.2  # before the first retry; doubled each retry, jittered
    max_backoff_s: float = 5.0
    attempt_timeout_s: float = 60.0  # one try; a stall past it is retried
    total_timeout_s: float = 180.0  # all tries of a work item's requests together

    def __post_init__(self) -> None:
        for name in ("coalesce_gap", "max_request", "concurrency", "attempts"):
            if getattr(self, name) < (0 if name == "coalesce_gap" else 1):
                raise ValueError(f"remote reads: {name} must be positive, got "
                                 f"{getattr(self, name)}")
        for name in ("backoff_s", "max_backoff_s", "attempt_timeout_s", "total_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"remote reads: {name} must be >= 0, got {getattr(self, name)}")


class Counters:
    """Thread-safe integer counters (the prefetcher's threads share one)."""

    def __init__(self, names: tuple[str, ...] = READ_STATS) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._values[name] = self._values.get(name, 0) + int(n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


def stats_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def add_stats(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """``total`` with ``more`` added in (in place, returned)."""
    for k, v in more.items():
        total[k] = total.get(k, 0) + v
    return total


class FetchError(Exception):
    """A request that failed for good: ``kind`` is ``missing`` (no such object), ``range``
    (past the end), or ``failed`` (retries spent, or an error retrying cannot fix);
    ``reason`` is one credential-free line."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


# --- classifying errors ---------------------------------------------------------------------

_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                    "RequestLimitExceeded", "RequestTimeout", "RequestTimeoutException",
                    "InternalError", "ServiceUnavailable", "BandwidthLimitExceeded",
                    "PriorRequestNotComplete", "OperationAborted"}
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# s3fs turns 503/SlowDown into EBUSY and 500/InternalError into EREMOTEIO
_TRANSIENT_ERRNO = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                    errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE,
                    getattr(errno, "EREMOTEIO", errno.EIO)}


def classify(e: BaseException) -> str:
    """``missing``, ``range``, ``transient`` or ``permanent``, from the error and its causes
    (fsspec backends wrap the store's error in an OSError)."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for x in chain:
        if isinstance(x, FileNotFoundError):
            return "missing"
        code, status = _code_and_status(x)
        if code == "InvalidRange" or status == 416:
            return "range"
        if code in ("NoSuchKey", "NoSuchBucket") or status == 404:
            return "missing"
    for x in chain:
        code, status = _code_and_status(x)
        if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS:
            return "transient"
        if isinstance(x, (TimeoutError, asyncio.TimeoutError, ConnectionError)):
            return "transient"
        if isinstance(x, _network_errors()):
            return "transient"
    first = chain[0] if chain else None
    if isinstance(first, OSError) and not isinstance(first, PermissionError) \
            and first.errno in _TRANSIENT_ERRNO:
        return "transient"
    return "permanent"


def _code_and_status(e: BaseException) -> tuple[str | None, int | None]:
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        code = (response.get("Error") or {}).get("Code")
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return code, int(status) if status else (int(code) if str(code).isdigit() else None)
    for attr in ("status", "code"):  # aiohttp's ClientResponseError, gcsfs' HttpError
        value = getattr(e, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return None, value
    return None, None


def _network_errors() -> tuple:
    """The backends' connection and time-out errors (botocore, aiohttp and fsspec come with
    s3fs, a dependency)."""
    from aiohttp import ClientConnectionError, ClientPayloadError
    from botocore.exceptions import HTTPClientError
    from fsspec.exceptions import FSTimeoutError

    return (HTTPClientError, ClientConnectionError, ClientPayloadError, FSTimeoutError)


_USERINFO = re.compile(r"([a-z][a-z0-9+.-]*://)[^/@\s]*@", re.IGNORECASE)
_QUERY = re.compile(r"([a-z][a-z0-9+.-]*://[^\s?\"']*)\?[^\s\"']*", re.IGNORECASE)


def scrub(text: str) -> str:
    """``text`` with URLs' ``user:password@`` and query strings (signatures) removed."""
    return _QUERY.sub(r"\1", _USERINFO.sub(r"\1", text))


def _reason(e: BaseException, timeout: float) -> str:
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) and not str(e):
        return f"timed out after {timeout:.3g} s"
    return scrub(short(e))


# --- coalescing -----------------------------------------------------------------------------

def coalesce(ranges: list[tuple[int, int]], gap: int, cap: int
             ) -> list[tuple[int, int, list[int]]]:
    """``[start, end)`` ranges merged into requests ``(start, end, indices of the ranges it
    covers)``: a range joins the request before it when it starts within ``gap`` bytes of its
    end and the request stays within ``cap`` bytes. Empty ranges are left out."""
    order = sorted((s, e, i) for i, (s, e) in enumerate(ranges) if e > s)
    merged: list[tuple[int, int, list[int]]] = []
    for s, e, i in order:
        if merged:
            ms, me, members = merged[-1]
            if s - me <= gap and max(me, e) - ms <= cap:
                merged[-1] = (ms, max(me, e), members + [i])
                continue
        merged.append((s, e, [i]))
    return merged


# --- fetching -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Job:
    fs: object
    path: str
    start: int | None = None  # None: the object's info (a HEAD), not bytes
    end: int | None = None


class RangeFetcher:
    """Issues requests concurrently, retrying transient failures; counts what it does."""

    def __init__(self, settings: RemoteSettings, counters: Counters) -> None:
        self.settings, self.counters = settings, counters
        self._pool: ThreadPoolExecutor | None = None  # for synchronous backends only
        self._pool_lock = threading.Lock()

    def fetch(self, requests: list[tuple[object, str, int, int]]) -> list[bytes | FetchError]:
        """The bytes ``[start, end)`` of each ``(fs, path, start, end)``; a FetchError
        where a request failed for good."""
        return self._run([_Job(fs, path, s, e) for fs, path, s, e in requests])

    def info(self, objects: list[tuple[object, str]]) -> list[dict | FetchError]:
        """Each object's info (size, ETag), fresh from the store (not a listing cache)."""
        for fs, path in objects:
            fs.invalidate_cache(path)
        return self._run([_Job(fs, path) for fs, path in objects])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _run(self, jobs: list[_Job]) -> list:
        s = self.settings
        results: list = [None] * len(jobs)
        pending = list(range(len(jobs)))
        began = time.monotonic()
        deadline = began + s.total_timeout_s
        attempt = 0
        while pending:
            timeout = max(min(s.attempt_timeout_s, deadline - time.monotonic()), 1e-3)
            outs = self._once([jobs[i] for i in pending], timeout)
            self.counters.add(store_requests=len(pending), store_bytes=sum(
                len(o) for o in outs if isinstance(o, (bytes, bytearray))))
            attempt += 1
            retry = []
            for i, out in zip(pending, outs):
                if not isinstance(out, BaseException):
                    results[i] = out
                    continue
                kind = classify(out)
                if kind == "transient":
                    retry.append(i)
                    results[i] = out
                else:
                    results[i] = FetchError(kind if kind != "permanent" else "failed",
                                            _reason(out, timeout))
            delay = min(s.max_backoff_s, s.backoff_s * 2 ** (attempt - 1))
            delay *= random.uniform(0.5, 1.0)  # jitter: workers throttled together spread out
            if retry and (attempt >= s.attempts or time.monotonic() + delay >= deadline):
                spent = time.monotonic() - began
                for i in retry:
                    results[i] = FetchError("failed", f"unreadable after {attempt} attempt"
                                            f"{'s' if attempt > 1 else ''} in {spent:.1f} s "
                                            f"({_reason(results[i], timeout)})")
                retry = []
            if retry:
                time.sleep(delay)  # back-off before retrying, not synchronisation
                self.counters.add(store_retries=len(retry))
            pending = retry
        self.counters.add(store_errors=sum(isinstance(r, FetchError) for r in results))
        return results

    def _once(self, jobs: list[_Job], timeout: float) -> list:
        """One try of every job: its result or its exception, in order."""
        by_fs: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            by_fs.setdefault(id(job.fs), []).append(i)
        outs: list = [None] * len(jobs)
        for indices in by_fs.values():
            group = [jobs[i] for i in indices]
            fs = group[0].fs
            if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
                got = self._async(fs, group, timeout)
            else:
                got = self._threads(group, timeout)
            for i, out in zip(indices, got):
                outs[i] = out
        return outs

    def _async(self, fs, jobs: list[_Job], timeout: float) -> list:
        from fsspec.asyn import sync

        limit = self.settings.concurrency

        async def one(job: _Job, gate: asyncio.Semaphore):
            async with gate:
                if job.start is None:
                    return await asyncio.wait_for(fs._info(job.path), timeout)
                return await asyncio.wait_for(
                    fs._cat_file(job.path, start=job.start, end=job.end), timeout)

        async def gather():
            gate = asyncio.Semaphore(limit)
            return await asyncio.gather(*(one(j, gate) for j in jobs), return_exceptions=True)

        try:
            return sync(fs.loop, gather)
        except Exception as e:  # noqa: BLE001 -- the loop itself failed: every job did
            return [e] * len(jobs)

    def _threads(self, jobs: list[_Job], timeout: float) -> list:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.settings.concurrency,
                                                thread_name_prefix="omniscale-fetch")
        futures = [self._pool.submit(_call, job) for job in jobs]
        wait_futures(futures, timeout)
        outs = []
        for f in futures:
            if f.done():
                outs.append(f.exception() or f.result())
            else:  # abandoned: a blocking call cannot be interrupted
                f.cancel()
                outs.append(TimeoutError(f"timed out after {timeout:g} s"))
        return outs


def _call(job: _Job):
    if job.start is None:
        return job.fs.info(job.path)
    return job.fs.cat_file(job.path, start=job.start, end=job.end)


def fingerprint(info: dict) -> dict:
    """What changes when an object changes (as ``Location.fingerprint`` has it)."""
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime")
    return {"size": int(info["size"]), "etag": str(tag).strip('"') if tag else None}


def missing(loc: Location) -> FetchError:
    return FetchError("missing", f"missing from the store ({loc.shown()})")


def past_end(start: int, end: int, size: int | None) -> FetchError:
    known = f" ({size} bytes)" if size is not None else ""
    return FetchError("range", f"byte range [{start}, {end}) is past the end of the shard{known}")


# --- reads without a cache ------------------------------------------------------------------

class DirectReads:
    """A reader's remote ranges straight from the store: coalesced per shard, all of a work
    item's requests at once."""

    def __init__(self, fetcher: RangeFetcher) -> None:
        self.fetcher = fetcher

    def read(self, wanted: list[tuple[Location, list[tuple[int, int]]]]
             ) -> list[list[bytes | FetchError]]:
        """For each ``(shard object, ranges)``, each range's bytes or its FetchError."""
        s = self.fetcher.settings
        out: list[list] = [[b"" if e <= st else None for st, e in ranges]
                           for _, ranges in wanted]
        jobs, plan = [], []
        for k, (loc, ranges) in enumerate(wanted):
            fs, path = loc.fs()
            for start, end, members in coalesce(ranges, s.coalesce_gap, s.max_request):
                jobs.append((fs, path, start, end))
                plan.append((k, start, members))
        for (k, start, members), data in zip(plan, self.fetcher.fetch(jobs)):
            loc, ranges = wanted[k]
            for i in members:
                rs, re_ = ranges[i]
                if isinstance(data, FetchError):
                    out[k][i] = range_error(data, loc, rs, re_, None)
                    continue
                piece = data[rs - start:re_ - start]
                # A short answer: the object ends inside the range.
                out[k][i] = piece if len(piece) == re_ - rs else past_end(
                    rs, re_, start + len(data))
        return out


def range_error(error: FetchError, loc: Location, start: int, end: int, size: int | None
           ) -> FetchError:
    """A request's error as one range of it sees it."""
    if error.kind == "missing":
        return missing(loc)
    if error.kind == "range":
        return past_end(start, end, size)
    return error
