"""The tar scan: byte ranges that give back exactly each member and each sample, and every
way a shard can be cut short or malformed reported with the member and the byte position."""

from __future__ import annotations

import io
import tarfile

from omniscale.loaders.tar_scan import BLOCK, scan_tar
from tests.loaders.index_fixtures import write_tar

LONG_KEY = "nested/dir/" + "k" * 120  # beyond ustar's 100-byte names: pax headers


def sample_members():
    return [
        ("a.txt", b"first"), ("a.jpg", b"\xff" * 700), ("a.json", b"{}"),
        (f"{LONG_KEY}.txt", b"long name"), (f"{LONG_KEY}.0.wav", b"w" * 1500),
        ("c.txt", b""), ("c.1.png", b"p" * 513),
    ]


def test_byte_ranges_give_back_members_and_samples(tmp_path):
    shard = write_tar(tmp_path / "s.tar", sample_members())
    data = shard.read_bytes()
    scan = scan_tar(shard)
    assert scan.problems == []
    assert [s.key for s in scan.samples] == ["a", LONG_KEY, "c"]
    with tarfile.open(shard) as tar:
        expected = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    for sample in scan.samples:
        assert sample.error is None
        for member in sample.members:
            assert data[member.offset:member.offset + member.size] == expected[member.name]
        piece = data[sample.offset:sample.offset + sample.size]
        with tarfile.open(fileobj=io.BytesIO(piece)) as tar:
            names = tar.getnames()
            assert names == [m.name for m in sample.members]
            assert all(tar.extractfile(n).read() == expected[n] for n in names)
    # samples tile the shard's data: each starts where the previous one ended
    ends = [s.offset + s.size for s in scan.samples]
    assert [s.offset for s in scan.samples[1:]] == ends[:-1]


def test_truncated_member_keeps_complete_samples(tmp_path):
    shard = write_tar(tmp_path / "s.tar", sample_members())
    data = shard.read_bytes()
    full = scan_tar(shard).samples
    wav = next(m for m in full[1].members if m.name.endswith(".wav"))
    cut_at = wav.offset + 100
    shard.write_bytes(data[:cut_at])
    scan = scan_tar(shard)
    assert [s.key for s in scan.samples] == ["a", LONG_KEY]
    assert scan.samples[0].error is None and scan.samples[0] == full[0]
    error = scan.samples[1].error
    assert f"{LONG_KEY}.0.wav" in error and f"the shard has {cut_at}" in error


def test_header_cut_short_names_member_and_position(tmp_path):
    shard = write_tar(tmp_path / "s.tar", sample_members())
    data = shard.read_bytes()
    c_offset = scan_tar(shard).samples[2].offset
    shard.write_bytes(data[:c_offset + 200])
    scan = scan_tar(shard)
    assert [s.key for s in scan.samples[:2]] == ["a", LONG_KEY]
    assert all(s.error is None for s in scan.samples[:2])
    cut = scan.samples[2]
    assert cut.key == "c" and cut.members == []
    assert cut.error == f"truncated tar: header of member 'c.txt' at byte {c_offset} is cut short"


def test_garbage_header_and_not_a_tar(tmp_path):
    shard = write_tar(tmp_path / "s.tar", sample_members()[:2])
    end = scan_tar(shard).samples[0]
    data = shard.read_bytes()[:end.offset + end.size]
    shard.write_bytes(data + b"\x00" * 10 + b"garbage" * 100)
    scan = scan_tar(shard)
    assert scan.samples[0].error is None
    assert scan.problems == [f"invalid tar header at byte {len(data)}"]
    shard.write_bytes(data + b"garbage" * 100)
    scan = scan_tar(shard)
    assert [s.key for s in scan.samples] == ["a"] and scan.samples[0].error is None
    assert scan.problems == [f"invalid tar header at byte {len(data)}"]
    (tmp_path / "x.tar").write_bytes(b"hello" * 300)
    assert scan_tar(tmp_path / "x.tar").problems[0].startswith("not a tar")
    (tmp_path / "e.tar").write_bytes(b"")
    assert scan_tar(tmp_path / "e.tar").problems[0].startswith("not a tar")


def test_non_contiguous_key_and_duplicate_member(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [("a.txt", b"1"), ("b.txt", b"2"), ("a.jpg", b"3"),
                                           ("c.txt", b"4"), ("c.txt", b"5")])
    scan = scan_tar(shard)
    assert [(s.key, s.error is None) for s in scan.samples] == [
        ("a", True), ("b", True), ("a", False), ("c", False)]
    assert "repeats non-contiguously (first at byte 0)" in scan.samples[2].error
    assert "duplicate member" in scan.samples[3].error


def test_padding_cut_keeps_last_sample(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [("a.txt", b"x" * 10)])
    data = shard.read_bytes()
    shard.write_bytes(data[:BLOCK + 10])  # data intact, padding and end blocks gone
    scan = scan_tar(shard)
    assert scan.problems == [] and scan.samples[0].error is None
    assert scan.samples[0].size == BLOCK + 10
