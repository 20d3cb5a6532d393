"""Edges of remote reads through the node's block cache (issue #46, item 3):

- a damaged block (a short file in the cache directory, as a full disk or a killed writer
  leaves it) is fetched again and replaced, never served -- by a reader and by a prefetch;
- the retry count cap stops a request that keeps failing when the total deadline is far off.

The damaged-block tests read from the real S3 server process, which counts the requests; the
retry test uses a file system stand-in that fails a set number of times."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from omniscale.loaders.block_cache import BlockCache, CacheConfig
from omniscale.loaders.remote_cache import CachedReads
from omniscale.loaders.remote_io import Counters, FetchError, RangeFetcher, RemoteSettings
from omniscale.location import Location
from tests.s3_fixtures import (  # noqa: F401 -- fixtures
    new_bucket,
    put_object,
    s3_fixture,
    s3_server_fixture,
)

BLOCK = 4096
DATA = random.Random(46).randbytes(BLOCK * 5 + 100)  # 6 blocks, the last one short
DAMAGED = 2  # the block cut short


@pytest.fixture
def shard(s3, tmp_path):
    """A 6-block object in the S3 server, and a cache config for it."""
    bucket = new_bucket(s3, "cache-edges")
    put_object(s3, bucket, "shard.tar", DATA)
    loc = Location.of(f"s3://{bucket}/shard.tar", s3.storage_options)
    cache = CacheConfig(str(tmp_path / "cache"), max_bytes=1 << 20, block_bytes=BLOCK)
    return loc, cache


def _reads(cache: CacheConfig) -> CachedReads:
    """A fresh reader (a new process's: no remembered fingerprints)."""
    return CachedReads(BlockCache(cache), RangeFetcher(RemoteSettings(), Counters()))


def _gets(s3) -> int:
    return s3.stats()["by_method"].get("GET", 0)


def _damage(cache: CacheConfig) -> Path:
    """Cut the cached DAMAGED block to half its length; its path."""
    [path] = [p for p in _block_files(cache) if p.name.endswith(f".{DAMAGED}")]
    path.write_bytes(path.read_bytes()[:BLOCK // 2])
    return path


def _block_files(cache: CacheConfig) -> list[Path]:
    return [p for p in Path(cache.dir).glob("??/*") if not p.name.endswith(".tmp")]


def test_a_short_cached_block_is_fetched_again_not_served(s3, shard):
    loc, cache = shard
    everything = [(loc, [(0, len(DATA))])]
    assert _reads(cache).read(everything) == [[DATA]]
    assert len(_block_files(cache)) == 6 and _gets(s3) == 1
    damaged = _damage(cache)
    # a new reader: every block but the damaged one is a hit; that one is fetched, alone
    reads = _reads(cache)
    wanted = [(loc, [(BLOCK * DAMAGED - 10, BLOCK * (DAMAGED + 1) + 10), (0, len(DATA))])]
    assert reads.read(wanted) == [[DATA[BLOCK * DAMAGED - 10:BLOCK * (DAMAGED + 1) + 10],
                                   DATA]]
    assert _gets(s3) == 2
    stats = reads.fetcher.counters.snapshot()
    assert (stats["cache_hits"], stats["cache_misses"]) == (5, 1)
    assert damaged.read_bytes() == DATA[BLOCK * DAMAGED:BLOCK * (DAMAGED + 1)]  # replaced
    assert _reads(cache).read(everything) == [[DATA]] and _gets(s3) == 2  # whole again


def test_a_prefetch_replaces_a_short_cached_block(s3, shard):
    loc, cache = shard
    everything = [(loc, [(0, len(DATA))])]
    assert _reads(cache).fill(everything) == 6
    damaged = _damage(cache)
    assert _reads(cache).fill(everything) == 1  # only the damaged block is fetched again
    assert _gets(s3) == 2
    assert damaged.read_bytes() == DATA[BLOCK * DAMAGED:BLOCK * (DAMAGED + 1)]
    assert _reads(cache).read(everything) == [[DATA]] and _gets(s3) == 2  # all hits


class _FailingFS:
    """A synchronous file system whose first ``failures`` reads fail as a dropped connection
    does (a transient error), and which then serves ``data``."""

    def __init__(self, data: bytes, failures: int) -> None:
        self.data, self.failures, self.calls = data, failures, 0

    def cat_file(self, path, start=None, end=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionResetError(f"connection reset ({self.calls})")
        return self.data[start:end]


def test_the_attempt_cap_stops_retries_long_before_the_deadline():
    fs = _FailingFS(b"0123456789", failures=6)
    # a deadline an hour away and no back-off: only the count of 3 attempts can stop it
    settings = RemoteSettings(attempts=3, backoff_s=0.0, max_backoff_s=0.0,
                              total_timeout_s=3600.0)
    counters = Counters()
    fetcher = RangeFetcher(settings, counters)
    [got] = fetcher.fetch([(fs, "shard", 2, 6)])
    fetcher.close()
    assert isinstance(got, FetchError) and got.kind == "failed"
    assert got.reason.startswith("unreadable after 3 attempts in ")
    assert fs.calls == 3
    stats = counters.snapshot()
    assert (stats["store_requests"], stats["store_retries"], stats["store_errors"]) == (3, 2, 1)
    # with room for more attempts than failures, the same reads come through on the 7th try
    fs = _FailingFS(b"0123456789", failures=6)
    retried = RangeFetcher(RemoteSettings(attempts=7, backoff_s=0.0, max_backoff_s=0.0,
                                          total_timeout_s=3600.0), Counters())
    assert retried.fetch([(fs, "shard", 2, 6)]) == [b"2345"] and fs.calls == 7
    retried.close()


def test_blocks_are_fetched_in_runs_of_consecutive_blocks_at_most_a_request_long():
    from omniscale.loaders.remote_cache import _runs

    # unsorted, with gaps, and a run of five cut at three blocks a request
    assert _runs([9, 1, 2, 3, 4, 5, 7], 3) == [(1, 4), (4, 6), (7, 8), (9, 10)]
    assert _runs([4, 2, 3], 1) == [(2, 3), (3, 4), (4, 5)]
    assert _runs([], 4) == []
