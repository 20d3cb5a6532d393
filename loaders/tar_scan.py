"""Scan a WebDataset tar shard into samples and byte ranges, reading headers only.

A sample is the run of contiguous members sharing a key (``omniscale.layout.split_member_name``).
Its byte range starts at the first header of its first member (pax / GNU long-name headers
included) and ends after the last member's data, padded to the 512-byte block: one contiguous
slice of the shard that is itself a valid tar holding exactly the sample's members, so a loader
fetches a sample with one ranged read.

Python's ``tarfile`` parses the headers (pax and GNU extensions included) and, positioned by
seeks, never reads a payload. It does not notice a shard cut short, though -- it silently stops
at a header it cannot read and happily reports members whose data lies past the end of the
file -- so the scan checks both itself and reports the shard, the member and the byte position.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from omniscale.layout import split_member_name

BLOCK = tarfile.BLOCKSIZE


@dataclass(frozen=True)
class TarMember:
    """One regular file in the shard: its full name and the byte range of its data."""

    name: str
    offset: int
    size: int

    @property
    def suffix(self) -> str:
        return split_member_name(self.name)[1]


@dataclass
class TarSample:
    """A sample's key, its byte range in the shard and its members in tar order.

    ``error`` is set when the sample cannot be used as a whole (cut off by a truncated shard,
    a key repeated after other samples, a duplicated member); the index still lists it.
    """

    key: str
    offset: int
    size: int
    members: list[TarMember] = field(default_factory=list)
    error: str | None = None


@dataclass
class TarScan:
    """Every sample found, in shard order, plus problems that belong to no sample."""

    samples: list[TarSample]
    problems: list[str]


def padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def scan_tar(path: str | Path) -> TarScan:
    """Samples of the shard at ``path``; never raises for a malformed shard.

    Every complete sample before a truncation is kept; the sample the truncation cuts is
    listed with ``error`` set (or, when its header is unreadable, reported in ``problems``).
    """
    path = Path(path)
    with open(path, "rb") as f:
        return scan_tar_file(f, path.stat().st_size)


def scan_tar_file(f, file_size: int) -> TarScan:
    """:func:`scan_tar` of an open, seekable binary file of ``file_size`` bytes (a local file
    or a ``loaders.ranged_file.RangedFile`` over an object store: only headers are read)."""
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except tarfile.TarError as e:
        return TarScan([], [f"not a tar ({_one_line(e)})"])
    members, cut = _read_members(tar, file_size)
    if cut is None:
        cut = _check_tail(f, tar.offset)
    samples = _group(members)
    for sample in samples:
        # A shard cut inside the last block's padding still holds all of the data.
        sample.size = min(sample.size, file_size - sample.offset)
    problems: list[str] = []
    if cut is not None:
        key = split_member_name(cut.name)[0] if cut.name else None
        if key is not None and samples and samples[-1].key == key and samples[-1].error is None:
            # The cut member belongs to the last sample: that sample is incomplete.
            samples[-1].error = cut.message
        elif key is not None:
            samples.append(TarSample(key=key, offset=cut.position,
                                     size=file_size - cut.position, error=cut.message))
        else:
            problems.append(cut.message)
    return TarScan(samples, problems)


@dataclass(frozen=True)
class _Cut:
    """Where a shard stops making sense: the member (if its name is readable) and why."""

    name: str | None
    position: int
    message: str


def _read_members(tar: tarfile.TarFile, file_size: int
                  ) -> tuple[list[tarfile.TarInfo], _Cut | None]:
    """Regular-file headers up to the first one whose data the file does not hold."""
    members: list[tarfile.TarInfo] = []
    while True:
        position = tar.offset
        try:
            info = tar.next()
        except (tarfile.TarError, EOFError, OSError) as e:
            if position >= file_size:
                return members, None  # cut inside the last padding: every byte of data is here
            return members, _Cut(None, position, f"truncated or invalid tar header at byte "
                                                 f"{position} ({_one_line(e)})")
        if info is None:
            return members, None
        end = info.offset_data + info.size
        if info.isreg() and end > file_size:
            return members, _Cut(info.name, info.offset,
                                 f"truncated tar: member {info.name!r} at byte {info.offset} "
                                 f"needs {end} bytes, the shard has {file_size}")
        if info.isreg():
            members.append(info)
        # Directories, links and the like carry no sample data and are skipped.


def _check_tail(f, position: int) -> _Cut | None:
    """A problem when the bytes after the last member are not end-of-archive zeros.

    ``tarfile`` stops silently at a header that is cut short or damaged; only the bytes left
    over tell it apart from a proper end of archive.
    """
    f.seek(position)
    head = f.read(BLOCK)
    if not head.strip(b"\0") and not _has_data(f):
        return None
    if len(head) == BLOCK:
        # A whole block tarfile refused (bad checksum, garbage): its name field means nothing.
        return _Cut(None, position, f"invalid tar header at byte {position}")
    name = _header_name(head)
    named = f" of member {name!r}" if name else ""
    return _Cut(name, position, f"truncated tar: header{named} at byte {position} is cut short")


def _header_name(head: bytes) -> str | None:
    """The name field of a partial header, when it reads as a plausible name."""
    try:
        name = head[:100].split(b"\0", 1)[0].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return name if name and name.isprintable() else None


def _has_data(f, chunk: int = 1 << 20) -> bool:
    """Whether any non-zero byte follows (read in bounded chunks, not all at once)."""
    while block := f.read(chunk):
        if block.strip(b"\0"):
            return True
    return False


def _group(infos: list[tarfile.TarInfo]) -> list[TarSample]:
    """Runs of contiguous members sharing a key; a key seen again later is an error."""
    samples: list[TarSample] = []
    first_seen: dict[str, int] = {}
    for info in infos:
        key, suffix = split_member_name(info.name)
        member = TarMember(info.name, info.offset_data, info.size)
        current = samples[-1] if samples else None
        if current is not None and current.key == key:
            if any(m.suffix == suffix for m in current.members) and current.error is None:
                current.error = f"member {info.name!r}: duplicate member in the sample"
            current.members.append(member)
            current.size = padded(info.offset_data + info.size) - current.offset
            continue
        sample = TarSample(key=key, offset=info.offset,
                           size=padded(info.offset_data + info.size) - info.offset,
                           members=[member])
        if key in first_seen:
            sample.error = (f"member {info.name!r}: key {key!r} repeats non-contiguously "
                            f"(first at byte {first_seen[key]})")
        else:
            first_seen[key] = info.offset
        samples.append(sample)
    return samples


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__
