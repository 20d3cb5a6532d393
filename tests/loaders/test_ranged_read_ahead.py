"""The indexer's read-ahead over an object store (``loaders.ranged_file.open_shard`` with its
default sizes, issue #46 item 3c): how MANY requests a read makes, counted by the real S3
server process, not only which bytes come back. Shrinking the read-ahead (a smaller first
block, a smaller widest block, no doubling, a smaller read-through gap) returns the same
bytes in more requests, and fails here.

The expected counts are worked out by hand from the documented rule: a read after a skip
fetches 16 KiB; a read that carries on from the last range (or after a gap under 64 KiB)
takes the gap too and doubles the block, up to 8 MiB."""

from __future__ import annotations

import random

import pytest

from omniscale.loaders.ranged_file import open_shard
from omniscale.location import Location
from tests.s3_fixtures import (  # noqa: F401 -- fixtures
    new_bucket,
    put_object,
    s3_fixture,
    s3_server_fixture,
)

KiB, MiB = 1 << 10, 1 << 20
SIZE = 24 * MiB
HEADER = 512  # a tar header's size: what the indexer reads of each member

# A read through from byte 0: ranges of 16 KiB, 32 KiB, ... 8 MiB (10 ranges, 16368 KiB),
# then 8 MiB, then the last 16 KiB of the 24 MiB.
READ_THROUGH_RANGES = 10 + 2


@pytest.fixture(scope="module")
def data():
    return random.Random(3).randbytes(SIZE)


@pytest.fixture
def shard(s3, data):
    bucket = new_bucket(s3, "read-ahead")
    put_object(s3, bucket, "big.tar", data)
    s3.control(reset_stats=True)
    return Location.of(f"s3://{bucket}/big.tar", s3.storage_options)


def _counts(s3) -> tuple[int, int, int]:
    """(HEADs, GETs, bytes sent) the server counted."""
    stats = s3.stats()
    return stats["by_method"].get("HEAD", 0), stats["by_method"].get("GET", 0), \
        stats["bytes_out"]


def test_a_shard_read_through_takes_few_growing_ranges(s3, shard, data):
    with open_shard(shard) as (f, size):
        assert size == SIZE
        pieces = []
        while piece := f.read(HEADER):
            pieces.append(piece)
    assert b"".join(pieces) == data
    assert _counts(s3) == (1, READ_THROUGH_RANGES, SIZE)  # the size lookup, then the ranges


def test_headers_a_small_gap_apart_are_read_through(s3, shard, data):
    """A header every 10 KiB (members smaller than the read-through gap): the gaps are read
    too, in the same growing ranges as a read straight through."""
    stride = 10 * KiB
    with open_shard(shard, size=SIZE) as (f, _):
        for at in range(0, SIZE, stride):
            f.seek(at)
            assert f.read(HEADER) == data[at:at + HEADER]
    assert _counts(s3) == (0, READ_THROUGH_RANGES, SIZE)


def test_headers_far_apart_take_one_small_range_each(s3, shard, data):
    """A header every MiB (past the read-through gap): 16 KiB each, nothing in between."""
    with open_shard(shard, size=SIZE) as (f, _):
        for at in range(0, SIZE, MiB):
            f.seek(at)
            assert f.read(HEADER) == data[at:at + HEADER]
    assert _counts(s3) == (0, SIZE // MiB, SIZE // MiB * 16 * KiB)


def test_the_read_through_gap_is_64_kib_to_the_byte(s3, shard, data):
    """A skip of exactly 64 KiB past the last range is read through (the gap and the header
    in one range); a skip one byte longer starts a new 16 KiB range."""
    reads = [0, 16 * KiB + 64 * KiB, 16 * KiB + 64 * KiB + HEADER + 64 * KiB + 1]
    with open_shard(shard, size=SIZE) as (f, _):
        for at in reads:
            f.seek(at)
            assert f.read(HEADER) == data[at:at + HEADER]
    # [0, 16K), [16K, 80K + 512) and [that end + 64K + 1, + 16K)
    assert _counts(s3) == (0, 3, 16 * KiB + (64 * KiB + HEADER) + 16 * KiB)
