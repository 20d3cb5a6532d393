"""Records of an input file, each with the line it starts on, and why a record is skipped.

``.jsonl``: one record per non-blank line. ``.json``: a JSON array of records, or one record.
A line that is not UTF-8 or not JSON is a skipped record, and reading goes on with the next
line; in a JSON array the first broken record ends the file (nothing after it can be told
apart), and the skip says so.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# Why a record is skipped: the summary counts skips by these.
NOT_UTF8 = "not UTF-8"
NOT_JSON = "not JSON"
MALFORMED = "malformed record"
UNKNOWN_ROLE = "unknown role"
MARKERS = "markers do not match media"
NO_ASSISTANT = "no assistant turn"
MISSING_MEDIA = "missing media"
UNREADABLE_MEDIA = "unreadable media"
UNSUPPORTED_MEDIA = "unsupported media"
UNREADABLE_FILE = "unreadable file"

_ESCAPED = re.compile("[\udc80-\udcff]")  # bytes that surrogateescape kept from bad UTF-8
_SPACE = re.compile(r"[ \t\r\n]*")


class Skip(Exception):
    """A record that cannot be converted: ``category`` (one of the constants above) and a
    one-line ``reason``."""

    def __init__(self, category: str, reason: str) -> None:
        self.category, self.reason = category, " ".join(str(reason).split())
        super().__init__(self.reason)

    def __reduce__(self):
        return (type(self), (self.category, self.reason))


@dataclass
class Record:
    """One record: ``number`` counts records from 0 in file order (skipped ones too), ``line``
    is where it starts (from 1), ``index`` its position in a JSON array, ``consumed`` the bytes
    of the file read so far. Exactly one of ``value`` and ``skip`` is set."""

    number: int
    line: int
    index: int | None
    consumed: int
    value: object = None
    skip: Skip | None = None


def read_records(path: Path) -> Iterator[Record]:
    """Every record of ``path`` in file order; a file that cannot be read is one skip.
    JSON lines are read line by line; a ``.json`` file is read whole."""
    try:
        if path.suffix.lower() != ".json":
            with open(path, "rb") as f:
                yield from _lines(f)
            return
        data = path.read_bytes()
    except OSError as e:
        yield Record(0, 0, None, 0, skip=Skip(UNREADABLE_FILE, f"cannot read: {e.strerror}"))
        return
    text = data.decode("utf-8", errors="surrogateescape")
    start = _SPACE.match(text).end()
    if text[start:start + 1] == "[":
        yield from _array(data, text, start)
        return
    single = _document(data, text, start)
    if single is not None:
        yield single
    else:  # JSON lines under a .json name
        yield from _lines(io.BytesIO(data))


def _document(data: bytes, text: str, start: int) -> Record | None:
    """The file as one JSON document, or None when it is not one."""
    try:
        value, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    if _SPACE.match(text, end).end() != len(text):
        return None
    return _checked(Record(0, 1 + text.count("\n", 0, start), None, len(data), value),
                    text, start, end)


def _lines(f: BinaryIO) -> Iterator[Record]:
    number, offset = 0, 0
    for line_no, line in enumerate(f, start=1):
        offset += len(line)
        if line.strip():
            yield _parse(number, line_no, offset, line.rstrip(b"\r\n"))
            number += 1


def _parse(number: int, line: int, consumed: int, raw: bytes) -> Record:
    record = Record(number, line, None, consumed)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        record.skip = Skip(NOT_UTF8, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                     f"{e.start + 1})")
        return record
    try:
        record.value = json.loads(text)
    except ValueError as e:
        record.skip = Skip(NOT_JSON, f"not JSON ({_json_error(e)})")
    return record


def _array(data: bytes, text: str, start: int) -> Iterator[Record]:
    """The elements of a JSON array, parsed one at a time to know where each starts."""
    decoder = json.JSONDecoder()
    scale = len(data) / max(len(text), 1)  # characters read -> bytes read, for progress
    pos = _SPACE.match(text, start + 1).end()
    line, counted, number = 1, 0, 0
    while True:
        line += text.count("\n", counted, pos)
        counted = pos
        if pos < len(text) and text[pos] == "]":
            return
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError as e:
            what = "no closing ']'" if pos >= len(text) else _json_error(e)
            yield Record(number, line, number, len(data),
                         skip=Skip(NOT_JSON, f"not JSON ({what}); the rest of the file is "
                                             "not read"))
            return
        yield _checked(Record(number, line, number, int(end * scale), value), text, pos, end)
        number += 1
        pos = _SPACE.match(text, end).end()
        if pos < len(text) and text[pos] == ",":
            pos = _SPACE.match(text, pos + 1).end()
        elif pos >= len(text) or text[pos] != "]":
            line += text.count("\n", counted, pos)
            counted = pos
            yield Record(number, line, number, len(data),
                         skip=Skip(NOT_JSON, "not JSON (expected ',' or ']' after a record); "
                                             "the rest of the file is not read"))
            return


def _checked(record: Record, text: str, start: int, end: int) -> Record:
    """``record`` skipped when its text held bytes that are not UTF-8."""
    bad = _ESCAPED.search(text, start, end)
    if bad:
        line = record.line + text.count("\n", start, bad.start())
        column = bad.start() - text.rfind("\n", 0, bad.start())
        byte = ord(bad.group()) - 0xdc00
        record.value, record.skip = None, Skip(
            NOT_UTF8, f"not UTF-8 (byte 0x{byte:02x} on line {line}, column {column})")
    return record


def _json_error(e: ValueError) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg}: column {e.colno}" if e.lineno == 1 else \
            f"{e.msg}: line {e.lineno} column {e.colno}"
    return str(e)
