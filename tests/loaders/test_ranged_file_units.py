"""``loaders.ranged_file`` in memory (issue #46): which ranges a :class:`RangedFile` asks its
``fetch`` for, what it does with a wrong answer, its seeks and reads at the edges, and the
window of one tar member (:class:`MemberFile`) over a file.

Every expected range is worked out by hand from the documented rule: a read after a skip
fetches ``min_block`` bytes; a read that carries on from the last range, or after a gap of at
most ``read_through`` bytes, takes the gap too and doubles the block, up to ``max_block``."""

from __future__ import annotations

import io
import random

import pytest

from omniscale.loaders.ranged_file import MemberFile, RangedFile

KiB, MiB = 1 << 10, 1 << 20
DATA = random.Random(46).randbytes(1000)


class _Store:
    """``fetch(start, end)`` over ``data``, logging each range it is asked for."""

    def __init__(self, data: bytes, whole: bool = False) -> None:
        self.data, self.whole, self.ranges = data, whole, []

    def __call__(self, start: int, end: int) -> bytes:
        self.ranges.append((start, end))
        return self.data if self.whole else self.data[start:end]


def _small(store: _Store, size: int = len(DATA)) -> RangedFile:
    """A file with blocks of 4 to 64 bytes, read through across gaps of up to 8 bytes."""
    return RangedFile(store, size, "small", min_block=4, max_block=64, read_through=8)


def test_a_read_through_with_the_default_sizes_doubles_the_range_up_to_8_mib():
    data = random.Random(3).randbytes(24 * MiB)
    store = _Store(data)
    f = RangedFile(store, len(data))
    pieces = []
    while piece := f.read(512):
        pieces.append(piece)
    assert b"".join(pieces) == data
    # 16 KiB, 32 KiB, ... 8 MiB (ten ranges, 16368 KiB), another 8 MiB, then the 16 KiB left
    sizes = [16 * KiB << i for i in range(10)] + [8 * MiB, 16 * KiB]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    assert store.ranges == [(s, s + n) for s, n in zip(starts, sizes)]
    assert (f.requests, f.fetched) == (12, len(data))


def test_a_read_just_past_a_range_that_ends_below_a_power_of_two_is_read_through():
    """The gap is measured in bytes: 30 to 33 is 3 bytes, however many bits the two differ
    in (30 is 0b11110, 33 is 0b100001)."""
    store = _Store(DATA)
    f = _small(store)
    f.seek(26)
    assert f.read(4) == DATA[26:30]
    f.seek(33)
    assert f.read(1) == DATA[33:34]
    # [26, 30) after the skip; then the 3-byte gap and a doubled block of 8: [30, 38)
    assert store.ranges == [(26, 30), (30, 38)]
    assert (f.requests, f.fetched) == (2, 12)


def test_a_read_past_the_gap_or_back_before_the_range_starts_a_small_block():
    store = _Store(DATA)
    f = _small(store)
    f.seek(100)
    assert f.read(2) == DATA[100:102]  # [100, 104)
    f.seek(113)
    assert f.read(2) == DATA[113:115]  # 9 bytes past 104: a new block [113, 117)
    f.seek(50)
    assert f.read(2) == DATA[50:52]  # back before the range: [50, 54)
    assert store.ranges == [(100, 104), (113, 117), (50, 54)]
    assert (f.requests, f.fetched) == (3, 12)


@pytest.mark.timeout(10)  # an off-by-one into the buffer reads nothing and loops for ever
def test_the_byte_just_before_the_buffer_is_fetched_not_taken_from_it():
    store = _Store(DATA)
    f = _small(store)
    f.seek(10)
    assert f.read(2) == DATA[10:12]  # holds [10, 14)
    f.seek(9)
    assert f.read(1) == DATA[9:10]
    assert store.ranges == [(10, 14), (9, 13)]


def test_a_store_answering_with_more_bytes_than_asked_is_an_error():
    """A server that ignores the Range header sends the whole object: its bytes are not the
    range's, so the read fails rather than return them."""
    f = _small(_Store(DATA, whole=True))
    f.seek(100)
    with pytest.raises(OSError, match=r"small: asked for bytes 100-104, got 1000 "):
        f.read(4)


def test_a_store_answering_with_fewer_bytes_than_asked_is_an_error():
    f = _small(_Store(DATA[:102]), 1000)  # the object shrank to 102 bytes after its size was read
    f.seek(100)
    with pytest.raises(OSError, match=r"small: asked for bytes 100-104, got 2 "):
        f.read(4)


def test_a_seek_before_the_start_fails_naming_the_position_and_moves_nothing():
    f = _small(_Store(DATA))
    with pytest.raises(OSError, match=r"^small: seek to a negative position \(-5\)$"):
        f.seek(-5)
    f.seek(3)
    with pytest.raises(OSError, match=r"\(-7\)$"):
        f.seek(-10, io.SEEK_CUR)
    assert f.tell() == 3
    assert f.seek(-4, io.SEEK_END) == 996 and f.read() == DATA[996:]


def test_read_takes_the_rest_in_one_range_and_nothing_past_the_end():
    store = _Store(DATA)
    f = _small(store)
    f.seek(10)
    assert f.read() == DATA[10:]
    assert store.ranges == [(10, 1000)]
    f.seek(1010)  # past the end: allowed, as for any file, and reads nothing
    assert f.read() == b"" and f.read(5) == b""
    assert f.requests == 1


def test_a_ranged_file_can_be_buffered_and_sought_like_a_file():
    f = _small(_Store(DATA))
    assert f.readable() and f.seekable()
    buffered = io.BufferedReader(f, buffer_size=16)
    assert buffered.seek(500) == 500 and buffered.read(3) == DATA[500:503]
    assert buffered.seek(-3, io.SEEK_CUR) == 500 and buffered.read(3) == DATA[500:503]


# --- MemberFile: bytes [100, 150) of DATA ---------------------------------------------------

def _member(shard: bytes = DATA) -> MemberFile:
    return MemberFile(io.BytesIO(shard), 100, 50)


def test_a_member_reads_its_own_bytes_from_any_position():
    m = _member()
    assert m.read() == DATA[100:150]
    assert m.seek(5) == 5 and m.read(3) == DATA[105:108]
    assert m.seek(2, io.SEEK_CUR) == 10 and m.read(2) == DATA[110:112]
    assert m.seek(-4, io.SEEK_END) == 46 and m.read() == DATA[146:150]


def test_a_seek_before_a_members_start_stops_at_its_start():
    m = _member()
    assert m.seek(-10) == 0 and m.tell() == 0
    assert m.read(2) == DATA[100:102]
    assert m.seek(-30, io.SEEK_CUR) == 0


def test_reads_stop_at_the_end_of_the_member_not_the_shard():
    m = _member()
    m.seek(20)
    assert m.read(100) == DATA[120:150]  # the 30 bytes left, none of the next member's
    assert m.read(10) == b"" and m.read() == b""
    m.seek(48)
    assert m.read(10) == DATA[148:150] and m.read(10) == b""
    assert m.readinto(bytearray(4)) == 0


def test_a_member_past_its_end_reads_nothing():
    m = _member()
    assert m.seek(60) == 60
    assert m.read() == b"" and m.read(5) == b""


def test_a_member_cut_short_by_a_truncated_shard_reads_what_is_there_then_ends():
    m = _member(DATA[:120])
    assert m.read(50) == DATA[100:120]
    assert m.read(50) == b"" and m.tell() == 20
