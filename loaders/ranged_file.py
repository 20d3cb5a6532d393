"""Read a shard in place: a seekable file over an object store that fetches byte ranges.

The indexer reads tar headers and the first bytes of media members, skipping the payloads in
between; downloading a shard to read its headers would cost its whole size in transfer (and,
across regions, in egress). :class:`RangedFile` turns each read that misses its buffer into one
ranged GET (``fs.cat_file(path, start, end)``, which every fsspec backend implements):

- after a skip (a seek past what it holds) it fetches a small block: a tar header, an image's
  header, the start of a text member;
- when reads carry on from where the last range ended, or after a gap too small to be worth a
  request of its own, it reads the gap too and doubles the block, so a shard of small members
  (text, thumbnails) is read through in few, growing ranges instead of one request per header.

:class:`MemberFile` is the window of one tar member, handed to PIL or soundfile, which read
only the header bytes they parse. :func:`open_shard` opens a local file as before (the page
cache does this job there) and a remote object as a :class:`RangedFile`.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator

from omniscale.location import Location

MIN_BLOCK = 16 << 10  # a tar header with its pax record, a JPEG's or WAV's header
MAX_BLOCK = 8 << 20  # the widest read-ahead when a shard is read through
READ_THROUGH_GAP = 64 << 10  # skipping less than this costs more in requests than in bytes


class _Seekable(io.RawIOBase):
    """A readable, seekable raw file whose position is ``_pos``."""

    _pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos


class RangedFile(_Seekable):
    """A read-only, seekable file of ``size`` bytes whose bytes ``fetch(start, end)`` returns.

    ``requests`` and ``fetched`` count what it fetched (bytes over the wire, for tests and
    reports). One reader at a time: a shard is scanned by one task.
    """

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, name: str = "",
                 min_block: int = MIN_BLOCK, max_block: int = MAX_BLOCK,
                 read_through: int = READ_THROUGH_GAP) -> None:
        super().__init__()
        self._fetch, self.size, self.name = fetch, int(size), name
        self._min, self._max, self._through = min_block, max_block, read_through
        self._block = min_block
        self._pos = 0
        self._buf, self._buf_start = b"", 0
        self.requests = self.fetched = 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(f"{self.name}: seek to a negative position ({base + offset})")
        self._pos = base + offset
        return self._pos

    def readall(self) -> bytes:
        # One range for the rest (io's default reads 8 KiB at a time).
        return self.read(max(0, self.size - self._pos))

    def readinto(self, b) -> int:
        """Fill ``b`` as far as the object goes (not one short read: ``tarfile`` takes a short
        header read for the end of the archive)."""
        out = memoryview(b).cast("B")
        done = 0
        while done < len(out) and self._pos < self.size:
            at = self._pos - self._buf_start
            if not 0 <= at < len(self._buf):
                self._fill(len(out) - done)
                continue
            chunk = self._buf[at:at + len(out) - done]
            out[done:done + len(chunk)] = chunk
            done += len(chunk)
            self._pos += len(chunk)
        return done

    def _fill(self, wanted: int) -> None:
        buf_end = self._buf_start + len(self._buf)
        if self._buf and 0 <= self._pos - buf_end <= self._through:
            # Reading on: take the gap too and look further ahead next time.
            self._block = min(self._block * 2, self._max)
            start = buf_end
        else:
            self._block = self._min
            start = self._pos
        end = min(self.size, max(self._pos + wanted, start + self._block))
        data = self._fetch(start, end)
        if len(data) != end - start:
            raise OSError(f"{self.name}: asked for bytes {start}-{end}, got {len(data)} "
                          "(did the object change while it was read?)")
        self.requests += 1
        self.fetched += len(data)
        self._buf, self._buf_start = bytes(data), start


class MemberFile(_Seekable):
    """The bytes ``[offset, offset + size)`` of ``f`` as a file of their own (a tar member's
    data), so a parser reads the member's header without the rest of it."""

    def __init__(self, f, offset: int, size: int) -> None:
        super().__init__()
        self._f, self._offset, self.size = f, offset, size
        self._pos = 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readall(self) -> bytes:
        # One read of the rest (io's default reads 8 KiB at a time: many small ranges).
        return self.read(max(0, self.size - self._pos))

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.size - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(memoryview(b).cast("B")[:n]) or 0
        self._pos += got
        return got


@contextlib.contextmanager
def open_shard(loc: Location, size: int | None = None) -> Iterator[tuple[object, int]]:
    """``(binary file, size)`` of the shard at ``loc``: a local file, or a :class:`RangedFile`
    over the object (``size`` from the listing saves a request per shard)."""
    if loc.is_local:
        with open(loc.url, "rb") as f:
            yield f, os.fstat(f.fileno()).st_size
        return
    fs, path = loc.fs()
    if size is None:
        size = int(fs.info(path)["size"])
    with RangedFile(lambda start, end: fs.cat_file(path, start=start, end=end), size,
                    loc.shown()) as f:
        yield f, size
