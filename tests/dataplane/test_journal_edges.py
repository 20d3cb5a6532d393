"""The plane's journal (``dataplane.journal``) at its edges, one unit at a time: how a state dir
is opened (created, cleaned of half-written files), which damaged log lines are refused, a lost
newline kept, what ``append``, ``records`` and ``roll_back`` promise, and which snapshot is read.
Each is a case the mutation run (issue #46, item 3) found no test for; the restarts of a real
plane are in ``test_plane_durability.py`` and ``test_restore_edges.py``."""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import pytest

from omniscale.dataplane import journal as journal_module
from omniscale.dataplane.journal import Journal, JournalError

RECORDS = [{"t": "start", "spec": "mix.yaml"}, {"t": "commit", "step": 0},
           {"t": "commit", "step": 1}]


def _line(body: bytes, checksum: bytes | None = None) -> bytes:
    """A log line as the format says (``{"c":"<crc32, 8 hex>","r":<record>}``), built here
    rather than by the journal; ``checksum``: another checksum field instead of the body's."""
    checksum = b"%08x" % zlib.crc32(body) if checksum is None else checksum
    return b'{"c":"' + checksum + b'","r":' + body + b"}\n"


def _record_line(record: dict) -> bytes:
    return _line(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())


def _state_dir(tmp_path, lines: list[bytes]):
    state = tmp_path / "state"
    state.mkdir()
    (state / "wal.jsonl").write_bytes(b"".join(lines))
    return state


def _refused_unchanged(state, message: str) -> None:
    """Opening ``state`` is refused in one line and leaves its log as it was."""
    before = (state / "wal.jsonl").read_bytes()
    with pytest.raises(JournalError, match=message):
        Journal(state)
    assert (state / "wal.jsonl").read_bytes() == before
    assert not list(state.glob("wal.torn-*"))


# -- opening a state dir ------------------------------------------------------------------------
def test_a_state_dir_whose_parent_does_not_exist_yet_is_created(tmp_path):
    state = tmp_path / "runs" / "job-1" / "plane"
    journal = Journal(state)
    assert journal.append(RECORDS[0]) == len(_record_line(RECORDS[0]))
    assert [r for _, r in Journal(state).records()] == RECORDS[:1]


def test_half_written_snapshots_and_spec_copies_are_removed_on_open(tmp_path):
    """A crash between writing a temp file and renaming it leaves ``*.tmp<pid>``: the next
    open removes them and keeps the files that were renamed."""
    journal = Journal(tmp_path / "state")
    journal.append(RECORDS[0])
    snapshot = journal.write_snapshot({"step": 0, "wal_offset": journal.size()})
    spec = journal.specs / f"{journal.store_spec('weights: 1')}.yaml"
    stale = [journal.snapshots / "snap-0000000003.json.tmp4242",
             journal.specs / f"{'0' * 64}.yaml.tmp17"]
    for path in stale:
        path.write_text("half")
    Journal(tmp_path / "state")
    assert not any(path.exists() for path in stale)
    assert snapshot.exists() and spec.exists()


# -- damaged log lines --------------------------------------------------------------------------
def test_a_log_whose_first_byte_became_a_newline_is_refused_not_cut(tmp_path):
    """Not taken for a torn last record (which would move the whole log aside and forget
    every trained step)."""
    data = b"".join(_record_line(r) for r in RECORDS)
    state = _state_dir(tmp_path, [b"\n" + data[1:]])
    _refused_unchanged(state, r"record 1 \(byte 0\) is corrupt")


@pytest.mark.parametrize("where", [0, 2, 5, 14, 16, 18, 19, -2])  # -2: the brace before "\n"
def test_a_flipped_byte_in_a_records_frame_is_refused(tmp_path, where):
    """The frame around the record (``{"c":"``, ``","r":``, the closing brace) is outside the
    checksum; a flipped byte there is damage all the same."""
    first = bytearray(_record_line(RECORDS[0]))
    first[where] ^= 0x01
    state = _state_dir(tmp_path, [bytes(first), _record_line(RECORDS[1])])
    _refused_unchanged(state, r"record 1 \(byte 0\) is corrupt")


def _body_with_a_leading_zero_and_a_letter_in_its_crc() -> bytes:
    for pad in range(10_000):
        body = json.dumps({"pad": pad, "t": "commit"}, separators=(",", ":")).encode()
        crc = b"%08x" % zlib.crc32(body)
        if crc.startswith(b"0") and any(c in b"abcdef" for c in crc):
            return body
    raise AssertionError("no such body")


BODY = _body_with_a_leading_zero_and_a_letter_in_its_crc()
CRC = b"%08x" % zlib.crc32(BODY)


@pytest.mark.parametrize("checksum", [
    b"zzzzzzzz",  # not hex at all
    CRC.upper(),  # one bit flipped in each letter: the same number, spelt otherwise
    b"+" + CRC[1:],  # the leading 0 flipped to a sign: the same number
    b" " + CRC[1:],  # ... or to a space
], ids=["not-hex", "upper-case", "sign", "space"])
def test_a_damaged_checksum_field_is_refused(tmp_path, checksum):
    """The checksum field is what the journal writes (8 lower-case hex digits) or damage:
    never parsed leniently into the number it might have been."""
    assert checksum != CRC
    state = _state_dir(tmp_path, [_line(BODY, checksum), _record_line(RECORDS[1])])
    _refused_unchanged(state, r"record 1 \(byte 0\) is corrupt")


@pytest.mark.parametrize("body", [b"[1,2]", b'"commit"', b'{"t":5}', b'{"step":1}', b"{nope}",
                                  b'{"t":"\xff"}'],
                         ids=["list", "string", "number-type", "no-type", "not-json",
                              "not-utf8"])
def test_a_line_with_a_valid_checksum_but_no_record_is_refused(tmp_path, body):
    """A record is a JSON object with a string ``t``; anything else is refused in one line,
    however its checksum came out right."""
    state = _state_dir(tmp_path, [_line(body), _record_line(RECORDS[1])])
    _refused_unchanged(state, r"record 1 \(byte 0\) is corrupt")


@pytest.mark.parametrize("parity", [0, 1])
def test_a_last_record_that_lost_its_newline_is_kept_at_either_parity(tmp_path, parity):
    """The log ends in a whole record without its newline, at an even and at an odd offset:
    the newline is put back and nothing else changes."""
    first = _record_line(RECORDS[0])
    lasts = [_record_line({"t": "commit", "pad": "x" * pad}) for pad in range(2)]
    last = next(line for line in lasts if (len(first) + len(line) - 1) % 2 == parity)
    state = _state_dir(tmp_path, [first, last[:-1]])
    journal = Journal(state)
    assert (state / "wal.jsonl").read_bytes() == first + last
    assert journal.end == len(first + last)
    assert [r for _, r in journal.records()] == [RECORDS[0], json.loads(last[20:-2])]


# -- append, records, roll_back -----------------------------------------------------------------
def test_append_is_durable_on_return_unless_told_otherwise(tmp_path, monkeypatch):
    journal = Journal(tmp_path / "state")
    wal_inode = os.stat(journal.wal).st_ino
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)
    monkeypatch.setattr(journal_module.os, "fsync", fsync)
    journal.append(RECORDS[0])
    assert synced == [wal_inode]  # the log fsynced before append returned
    journal.append(RECORDS[1], sync=False)
    assert synced == [wal_inode]  # not yet: the caller's sync_to does it


def _three_records(tmp_path) -> tuple[Journal, list[int]]:
    """A journal with RECORDS and the offsets after each (from the lines' lengths)."""
    journal = Journal(tmp_path / "state")
    for record in RECORDS:
        journal.append(record)
    ends, total = [], 0
    for record in RECORDS:
        total += len(_record_line(record))
        ends.append(total)
    return journal, ends


def test_records_between_two_offsets_are_those_records(tmp_path):
    journal, ends = _three_records(tmp_path)
    assert journal.records(ends[0], ends[1]) == [(ends[1], RECORDS[1])]
    assert journal.records(ends[0]) == [(ends[1], RECORDS[1]), (ends[2], RECORDS[2])]
    assert journal.records(ends[1], ends[1]) == []


def test_records_between_any_two_record_ends_are_exactly_those_between(tmp_path):
    # records of different lengths, so that the offsets take many values
    records = [{"t": "commit", "step": i, "pad": "x" * (7 * i % 23)} for i in range(9)]
    journal = Journal(tmp_path / "state")
    ends, total = [0], 0
    for record in records:
        journal.append(record)
        total += len(_record_line(record))
        ends.append(total)
    for i, start in enumerate(ends):
        for j in range(i, len(ends)):
            expected = [(ends[k + 1], records[k]) for k in range(i, j)]
            assert journal.records(start, ends[j]) == expected, (i, j)


def test_the_fsync_count_starts_at_zero_and_counts_each_one(tmp_path):
    journal = Journal(tmp_path / "state")
    assert journal.fsyncs == 0
    journal.append(RECORDS[0])
    journal.append(RECORDS[1])
    assert journal.fsyncs == 2


@pytest.mark.parametrize("back", [1, 5])  # 1: at the newline that ends record 1
def test_records_from_an_offset_inside_a_record_are_refused(tmp_path, back):
    """An offset that is not a record's start is a caller's mistake: refused, not read as
    whatever lines follow it."""
    journal, ends = _three_records(tmp_path)
    with pytest.raises(JournalError, match=f"record at byte {ends[0] - back} is corrupt"):
        journal.records(ends[0] - back)


def test_a_record_damaged_after_open_is_refused_naming_its_byte(tmp_path):
    """A read-only reader (an audit of a live plane's dir) reads what was written since it
    opened: a bad record there is refused, the message saying where it starts."""
    journal, ends = _three_records(tmp_path)
    data = bytearray(journal.wal.read_bytes())
    data[ends[1] + 25] ^= 0x01  # inside record 3's body: its checksum no longer matches
    journal.wal.write_bytes(bytes(data))
    with pytest.raises(JournalError, match=rf"the record at byte {ends[1]} is corrupt$"):
        journal.records(ends[0])


@pytest.mark.parametrize("past", [0, 10])
def test_rolling_back_to_the_end_or_past_it_changes_nothing(tmp_path, past):
    journal, ends = _three_records(tmp_path)
    before = journal.wal.read_bytes()
    assert journal.roll_back(ends[-1] + past) is None
    assert journal.wal.read_bytes() == before
    assert not list(journal.dir.glob("wal.rolled-back-*"))


# -- snapshots ----------------------------------------------------------------------------------
def _snapshots(tmp_path, steps=(2, 5)) -> Journal:
    journal = Journal(tmp_path / "state")
    journal.append(RECORDS[0])
    for step in steps:
        journal.write_snapshot({"step": step, "wal_offset": journal.size(), "note": f"s{step}"})
    return journal


def _damage(journal: Journal, step: int) -> None:
    path = journal.snapshots / f"snap-{step:010d}.json"
    path.write_text(path.read_text().replace(f"s{step}", "sX"))


def test_the_newest_snapshot_that_verifies_is_loaded(tmp_path):
    journal = _snapshots(tmp_path)
    assert journal.load_snapshot()["note"] == "s5"
    _damage(journal, 5)
    assert journal.load_snapshot()["note"] == "s2"  # the one before it
    _damage(journal, 2)
    assert journal.load_snapshot() is None  # none: the caller replays the whole log


def test_a_given_steps_snapshot_is_loaded_and_a_missing_one_refused(tmp_path):
    journal = _snapshots(tmp_path)
    assert journal.load_snapshot(2)["note"] == "s2"  # not the newest
    with pytest.raises(JournalError, match="no snapshot of step 4"):
        journal.load_snapshot(4)


def test_a_snapshot_in_todays_format_written_by_hand_is_read(tmp_path):
    """The snapshot format this release writes (version 2: the state's JSON with its SHA-256
    beside it) stays readable: what a previous run of the same release wrote."""
    journal = _snapshots(tmp_path, steps=(2,))
    body = json.dumps({"step": 5, "wal_offset": journal.size(), "note": "by hand",
                       "version": 2}, sort_keys=True)
    (journal.snapshots / "snap-0000000005.json").write_text(
        json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "body": body}))
    assert journal.load_snapshot()["note"] == "by hand"


def test_a_snapshot_of_an_older_format_is_skipped(tmp_path):
    """A version-1 snapshot (an older OmniScale's), even one whose hash verifies, is not read
    as today's: the one before it is used."""
    journal = _snapshots(tmp_path, steps=(2,))
    body = json.dumps({"step": 5, "wal_offset": journal.size(), "note": "s5", "version": 1},
                      sort_keys=True)
    (journal.snapshots / "snap-0000000005.json").write_text(
        json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "body": body}))
    assert journal.load_snapshot()["note"] == "s2"
    with pytest.raises(JournalError, match="the snapshot of step 5 is corrupt"):
        journal.load_snapshot(5)


def test_a_stray_file_named_like_a_snapshot_is_ignored(tmp_path):
    journal = _snapshots(tmp_path, steps=(2,))
    (journal.snapshots / "snap-latest.json").write_text("{}")
    reopened = Journal(journal.dir)
    assert reopened.snapshot_steps() == [2]
    assert reopened.load_snapshot()["note"] == "s2"
