"""``loaders.remote_cache`` over an in-memory object store that logs every request (issue #46):
which blocks a read fetches and in how many requests, how it answers empty, reversed and
past-the-end ranges, a missing, deleted, shrunk or misbehaving shard, how long a reader
remembers a lookup, and what the :class:`Prefetcher` fetches, skips, counts and drops.

The store's objects are short byte strings cached in blocks of 4 bytes, so every expected
request and slice is worked out by hand (block ``i`` is bytes ``[4i, 4i + 4)``)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid

import fsspec
import pytest
from fsspec import AbstractFileSystem

from omniscale.loaders import remote_cache
from omniscale.loaders.block_cache import FINGERPRINT_TTL_S, BlockCache, CacheConfig
from omniscale.loaders.remote_cache import CachedReads, Prefetcher
from omniscale.loaders.remote_io import Counters, FetchError, RangeFetcher, RemoteSettings
from omniscale.location import Location
from omniscale.refs import SampleRef

PROTOCOL = "remotecacheunits"
HOLD_S = 5.0  # the longest a held request waits for the test to let it go
DATA = b"0123456789"  # blocks [0, 4), [4, 8) and the short [8, 10)


class _Objects:
    """An object store's contents, and its requests logged as a server counts them:
    ``("head", path)`` and ``("get", path, start, end)``. ``hold()`` keeps GETs waiting until
    ``release()``; with ``whole`` set every range is answered with the whole object, as by a
    server that ignores the Range header."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.log: list[tuple] = []
        self.whole, self.answered = False, 0
        self._held = False
        self._cond = threading.Condition()

    def info(self, path: str) -> dict:
        with self._cond:
            self.log.append(("head", path))
            data = self.objects.get(path)
        if data is None:
            raise FileNotFoundError(path)
        return {"name": path, "size": len(data), "type": "file",
                "ETag": f'"{hashlib.md5(data).hexdigest()}"'}

    def get(self, path: str, start: int, end: int) -> bytes:
        with self._cond:
            self.log.append(("get", path, start, end))
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._held, timeout=HOLD_S)
            data = self.objects.get(path)
            self.answered += 1
        if data is None:
            raise FileNotFoundError(path)
        return data if self.whole else data[start:end]

    def gets(self) -> list[tuple[str, int, int]]:
        return [entry[1:] for entry in self.log if entry[0] == "get"]

    def heads(self) -> list[str]:
        return [entry[1] for entry in self.log if entry[0] == "head"]

    def hold(self) -> None:
        with self._cond:
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def wait_for_gets(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.gets()) >= n, timeout=HOLD_S)


_STORES: dict[str, _Objects] = {}


class _Store(AbstractFileSystem):
    """The fsspec file system of the store named by its ``run`` storage option (fsspec makes
    one instance per thread: they share the store)."""

    protocol = PROTOCOL

    def __init__(self, run: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.store = _STORES[run]

    def info(self, path, **kwargs):
        return self.store.info(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        return self.store.get(path, start, end)

    def invalidate_cache(self, path=None) -> None:
        pass


fsspec.register_implementation(PROTOCOL, _Store, clobber=True)


class _Bucket:
    """A bucket of its own store (a fresh file system per test)."""

    def __init__(self) -> None:
        self.run = run = uuid.uuid4().hex
        self.fs = _STORES[run] = _Objects()
        self.root = Location.of(f"{PROTOCOL}://bucket", {"run": run})

    def put(self, name: str, data: bytes) -> Location:
        loc = self.root.join(name)
        self.fs.objects[loc.fs()[1]] = data
        return loc

    def delete(self, loc: Location) -> None:
        del self.fs.objects[loc.fs()[1]]


@pytest.fixture
def bucket():
    made = _Bucket()
    yield made
    _STORES.pop(made.run)


@pytest.fixture
def cache(tmp_path) -> CacheConfig:
    return CacheConfig(str(tmp_path / "cache"), max_bytes=1 << 20, block_bytes=4)


def _reads(cache: CacheConfig, **settings) -> CachedReads:
    return CachedReads(BlockCache(cache), RangeFetcher(RemoteSettings(**settings), Counters()))


def _path(loc: Location) -> str:
    return loc.fs()[1]


def _age_shared_lookups(cache: CacheConfig, *locs: Location) -> None:
    """Make the node's shared records of these lookups too old to reuse (as
    FINGERPRINT_TTL_S after they were made), so only a reader's own memory spares a HEAD."""
    old = time.time() - FINGERPRINT_TTL_S - 1
    for loc in locs:
        record = BlockCache(cache)._fingerprint_path(loc)
        if os.path.exists(record):
            os.utime(record, (old, old))


# --- CachedReads -----------------------------------------------------------------------------

def test_a_read_fetches_only_the_blocks_its_ranges_touch(bucket, cache):
    loc = bucket.put("a.tar", DATA)
    reads = _reads(cache)
    # [0, 4) ends on block 0's edge and needs no byte of block 1; [5, 5) needs nothing
    assert reads.read([(loc, [(0, 4), (5, 5)])]) == [[b"0123", b""]]
    assert bucket.fs.gets() == [(_path(loc), 0, 4)]
    assert reads.read([(loc, [(8, 10), (2, 4)])]) == [[b"89", b"23"]]
    assert bucket.fs.gets() == [(_path(loc), 0, 4), (_path(loc), 8, 10)]  # [2, 4): a hit
    stats = reads.fetcher.counters.snapshot()
    assert (stats["cache_misses"], stats["cache_hits"]) == (2, 1)


def test_a_request_is_at_most_max_request_bytes_of_whole_blocks(bucket, cache):
    loc = bucket.put("a.tar", DATA)
    # 10 bytes a request hold two whole 4-byte blocks, not two and a half
    assert _reads(cache, max_request=10).read([(loc, [(0, 10)])]) == [[DATA]]
    assert bucket.fs.gets() == [(_path(loc), 0, 8), (_path(loc), 8, 10)]


def test_a_reader_looks_a_shard_up_once_even_after_the_nodes_record_ages_out(bucket, cache):
    loc = bucket.put("a.tar", DATA)
    reads = _reads(cache)
    assert reads.read([(loc, [(0, 2)])]) == [[b"01"]]
    _age_shared_lookups(cache, loc)
    assert reads.read([(loc, [(4, 6)])]) == [[b"45"]]
    assert bucket.fs.heads() == [_path(loc)]


def test_past_its_cap_a_reader_forgets_the_least_recently_used_lookup(
        bucket, cache, monkeypatch):
    monkeypatch.setattr(remote_cache, "MAX_FINGERPRINTS", 2)
    a, b, c = (bucket.put(name, DATA) for name in ("a.tar", "b.tar", "c.tar"))
    reads = _reads(cache)
    for loc in (a, b, a, c, a, c, b):  # c pushes out b, used less recently than a
        assert reads.read([(loc, [(0, 2)])]) == [[b"01"]]
        _age_shared_lookups(cache, a, b, c)
    assert bucket.fs.heads() == [_path(a), _path(b), _path(c), _path(b)]


def _error(got, kind: str, reason: str) -> bool:
    return isinstance(got, FetchError) and (got.kind, got.reason) == (kind, reason)


def test_a_missing_shard_fails_its_ranges_and_spares_the_other_shards(bucket, cache):
    loc = bucket.put("a.tar", DATA)
    gone = bucket.root.join("gone.tar")
    [missing, here] = _reads(cache).read([(gone, [(0, 4), (3, 3), (5, 2)]), (loc, [(0, 4)])])
    assert _error(missing[0], "missing", f"missing from the store ({gone.shown()})")
    assert missing[1:] == [b"", b""]  # an empty and a reversed range need no bytes
    assert here == [b"0123"]
    # a prefetch of both fetches the shard that is there, whole
    assert _reads(cache).fill([(gone, [(0, 4)]), (loc, [(0, 10)])]) == 2  # block 0 is cached
    assert bucket.fs.gets() == [(_path(loc), 0, 4), (_path(loc), 4, 10)]


def test_empty_reversed_and_past_the_end_ranges_in_one_read(bucket, cache):
    loc = bucket.put("a.tar", DATA)
    ranges = [(3, 3), (0, 4), (20, 15), (6, 10), (8, 12), (4, 8)]
    got = _reads(cache).read([(loc, ranges)])[0]
    assert got[:4] == [b"", b"0123", b"", b"6789"]
    assert _error(got[4], "range", "byte range [8, 12) is past the end of the shard (10 bytes)")
    assert got[5:] == [b"4567"]


def test_a_shard_shrunk_after_its_lookup_fails_naming_the_bytes(bucket, cache):
    loc = bucket.put("a.tar", DATA)
    reads = _reads(cache)
    assert reads.read([(loc, [(0, 2)])]) == [[b"01"]]  # remembers 10 bytes
    bucket.put("a.tar", b"abcdef")
    [[got]] = reads.read([(loc, [(4, 10)])])  # [4, 10) of 6 bytes: 2 come back
    assert _error(got, "failed", "changed in the store while being read "
                                 "(expected 6 bytes from byte 4, got 2)")


def test_a_store_answering_a_range_with_the_whole_object_is_an_error(bucket, cache):
    loc = bucket.put("a.tar", DATA)
    bucket.fs.whole = True
    [[got]] = _reads(cache).read([(loc, [(4, 8)])])
    assert _error(got, "failed", "changed in the store while being read "
                                 "(expected 4 bytes from byte 4, got 10)")


def test_a_shard_deleted_after_its_lookup_fails_alone(bucket, cache):
    a, b = bucket.put("a.tar", DATA), bucket.put("b.tar", DATA)
    reads = _reads(cache)
    assert reads.read([(a, [(0, 2)]), (b, [(0, 2)])]) == [[b"01"], [b"01"]]
    bucket.delete(a)
    [[gone], here] = reads.read([(a, [(4, 8)]), (b, [(4, 8)])])
    assert _error(gone, "missing", f"missing from the store ({a.shown()})")
    assert here == [b"4567"]


# --- Prefetcher ------------------------------------------------------------------------------

def _ref(source: str, shard: str, offset: int = 0, size: int = len(DATA)) -> SampleRef:
    return SampleRef(0, source, shard, "k", offset, size)


def test_a_prefetch_skips_unknown_sources_local_sources_and_parquet_shards(
        bucket, cache, tmp_path):
    src = bucket.root.join("src")
    tar, jsonl = bucket.put("src/s.tar", DATA), bucket.put("src/t.jsonl", DATA)
    bucket.put("src/p.parquet", DATA)
    with Prefetcher({"remote": src, "local": str(tmp_path)}, cache) as prefetch:
        prefetch.submit([_ref("gone", "x.tar"), _ref("local", "l.tar"),
                         _ref("remote", "p.parquet"), _ref("remote", "s.tar"),
                         _ref("remote", "t.jsonl", 4, 2)])
        assert prefetch.wait(HOLD_S)
        stats = prefetch.stats()
    assert sorted(bucket.fs.gets()) == [(_path(tar), 0, 10), (_path(jsonl), 4, 8)]
    assert (stats["prefetch_blocks"], stats["store_errors"]) == (3 + 1, 0)


def test_a_prefetch_of_a_source_that_cannot_be_reached_is_counted_not_raised(
        bucket, cache):
    bucket.put("src/s.tar", DATA)
    sources = {"bad": "nosuchprotocol://bucket/src", "remote": bucket.root.join("src")}
    with Prefetcher(sources, cache, threads=1) as prefetch:
        prefetch.submit([_ref("bad", "s.tar")])
        prefetch.submit([_ref("remote", "s.tar")])
        assert prefetch.wait(HOLD_S)
        stats = prefetch.stats()
    assert (stats["store_errors"], stats["prefetch_blocks"]) == (1, 3)


@pytest.mark.timeout(30)  # the failure this guards against is a deadlock
def test_submitting_prefetches_that_finish_at_once_never_blocks(bucket, cache):
    """A fetch can be over (failed at once, or nothing to fetch) before ``submit`` has noted
    it: ``submit`` returns all the same, every time."""
    for _ in range(20):  # a first submit starts the thread, which may be done before it returns
        with Prefetcher({"bad": "nosuchprotocol://bucket/src"}, cache, threads=1) as prefetch:
            prefetch.submit([_ref("bad", "s.tar")])
            assert prefetch.wait(HOLD_S)
            assert prefetch.stats()["store_errors"] == 1


def test_a_block_being_prefetched_is_not_fetched_twice_and_counts_as_skipped(bucket, cache):
    shard = bucket.put("src/s.tar", DATA)
    with Prefetcher({"remote": bucket.root.join("src")}, cache, threads=2) as prefetch:
        bucket.fs.hold()
        prefetch.submit([_ref("remote", "s.tar", 0, 8)])  # blocks 0 and 1
        bucket.fs.wait_for_gets(1)
        prefetch.submit([_ref("remote", "s.tar", 0, 10)])  # 0 and 1 are in flight: block 2
        bucket.fs.wait_for_gets(2)
        bucket.fs.release()
        assert prefetch.wait(HOLD_S)
        stats = prefetch.stats()
    assert bucket.fs.gets() == [(_path(shard), 0, 8), (_path(shard), 8, 10)]
    assert (stats["prefetch_blocks"], stats["prefetch_skipped"], stats["cache_hits"]) == \
        (3, 2, 0)


def test_close_returns_while_a_fetch_is_under_way_and_that_fetch_finishes(bucket, cache):
    bucket.put("src/s.tar", DATA)
    prefetch = Prefetcher({"remote": bucket.root.join("src")}, cache, threads=1)
    bucket.fs.hold()
    prefetch.submit([_ref("remote", "s.tar")])
    bucket.fs.wait_for_gets(1)
    prefetch.close()
    answered_before_close_returned = bucket.fs.answered
    bucket.fs.release()
    prefetch.close(wait=True)
    assert answered_before_close_returned == 0
    assert prefetch.stats()["prefetch_blocks"] == 3  # finished in the background


def test_close_drops_the_prefetches_not_started(bucket, cache):
    a = bucket.put("src/a.tar", DATA)
    bucket.put("src/b.tar", DATA)
    prefetch = Prefetcher({"remote": bucket.root.join("src")}, cache, threads=1)
    bucket.fs.hold()
    prefetch.submit([_ref("remote", "a.tar")])
    bucket.fs.wait_for_gets(1)
    prefetch.submit([_ref("remote", "b.tar")])  # waits for the one thread
    prefetch.close()
    bucket.fs.release()
    prefetch.close(wait=True)
    assert bucket.fs.heads() == [_path(a)] and bucket.fs.gets() == [(_path(a), 0, 10)]


def test_a_prefetch_submitted_after_close_fetches_nothing(bucket, cache):
    bucket.put("src/s.tar", DATA)
    prefetch = Prefetcher({"remote": bucket.root.join("src")}, cache)
    prefetch.close()
    prefetch.submit([_ref("remote", "s.tar")])
    assert prefetch.wait(HOLD_S)
    assert bucket.fs.log == [] and prefetch.stats().get("prefetch_blocks", 0) == 0


def _prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("omniscale-prefetch")}


def test_by_default_four_shards_are_prefetched_at_a_time(bucket, cache):
    """The prefetch's share of the store's request rate: four threads, four requests in
    flight, the rest queued (and dropped by a close)."""
    for i in range(6):
        bucket.put(f"src/{i}.tar", DATA)
    before = _prefetch_threads()
    prefetch = Prefetcher({"remote": bucket.root.join("src")}, cache)
    bucket.fs.hold()
    prefetch.submit([_ref("remote", f"{i}.tar") for i in range(6)])
    bucket.fs.wait_for_gets(4)
    threads = len(_prefetch_threads() - before)
    prefetch.close()
    bucket.fs.release()
    prefetch.close(wait=True)
    assert threads == 4
    assert len(bucket.fs.gets()) == 4
