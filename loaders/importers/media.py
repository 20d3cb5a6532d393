"""Media references of a conversation, fetched as the bytes and extension its sample keeps.

A reference is one of

- a local path, relative to the media root (``--media-root``, else the input file's
  directory) unless absolute;
- a tar member, ``path/to/shard.tar#member/name.jpg``, the tar named as a path or a URL;
- a URL fsspec can open: ``file://``, and whatever protocols fsspec has installed;
- a ``data:`` URL (``data:image/png;base64,...``) or inline base64 (OpenAI's ``input_audio``).

Bytes are kept as they are, never re-encoded. The member's extension is the reference's own,
lowercased, when the layout knows it for the item's kind (``omniscale.layout``); an extension it
does not know (or none: a data URL, a URL without one) is told from the bytes' signature.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
import re
import tarfile
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from omniscale.layout import AUDIO_EXTS, IMAGE_EXTS, VIDEO_EXTS, member_kind
from omniscale.loaders.importers.records import (
    MISSING_MEDIA,
    UNREADABLE_MEDIA,
    UNSUPPORTED_MEDIA,
    Skip,
)

KIND_EXTS = {"image": IMAGE_EXTS, "video": VIDEO_EXTS, "audio": AUDIO_EXTS}
TAR_MEMBER = re.compile(r"^(.+?\.tar)#(.+)$")
MAX_OPEN_TARS = 8  # member tables kept per worker: references into one tar come in runs


@dataclass(frozen=True)
class MediaRef:
    """One media item as a record names it: ``ref`` as written (messages show it), or inline
    ``data`` with the extension (``ext``) the record declares for it."""

    kind: str
    ref: str
    data: bytes | None = None
    ext: str | None = None


def inline(kind: str, payload: object, fmt: object, where: str) -> MediaRef:
    """A media item given as base64 text (OpenAI's ``input_audio: {data, format}``)."""
    if not isinstance(payload, str) or not isinstance(fmt, (str, type(None))):
        raise Skip(UNREADABLE_MEDIA, f"{where}: expected base64 text and a format")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise Skip(UNREADABLE_MEDIA, f"{where}: not base64 ({e})") from None
    return MediaRef(kind, f"<inline {fmt or kind}>", data, (fmt or "").lower() or None)


class MediaFetcher:
    """Fetches the media of one input file's records; keeps a few tars' member tables."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._tars: OrderedDict[str, dict[str, tuple[int, int]]] = OrderedDict()

    def fetch(self, item: MediaRef) -> tuple[str, bytes]:
        """(extension, bytes) of ``item``; raises :class:`Skip` naming the reference."""
        shown = f"{item.kind} {_clipped(item.ref)!r}"
        member = TAR_MEMBER.match(item.ref)
        if item.data is not None:
            ext, data = item.ext, item.data
        elif item.ref.startswith("data:"):
            mime, data = _data_url(item.ref, shown)
            ext = _mime_ext(mime)
        elif member:
            ext, data = _name_ext(member.group(2)), self._member(*member.groups(), shown)
        else:
            path = urllib.parse.urlsplit(item.ref).path if "://" in item.ref else item.ref
            ext, data = _name_ext(path), _read(self._location(item.ref), shown)
        if not data:
            raise Skip(UNREADABLE_MEDIA, f"{shown}: empty")
        return _extension(item.kind, ext, data, shown), data

    def _location(self, ref: str) -> str:
        if "://" in ref:
            return ref
        return str(self.root / Path(ref).expanduser())  # an absolute ref stays as it is

    def _member(self, tar: str, name: str, shown: str) -> bytes:
        location = self._location(tar)
        members = self._tars.get(location)
        if members is None:
            members = self._tars[location] = _tar_members(location, shown)
            if len(self._tars) > MAX_OPEN_TARS:
                self._tars.popitem(last=False)
        else:
            self._tars.move_to_end(location)
        found = members.get(name.removeprefix("./"))
        if found is None:
            raise Skip(MISSING_MEDIA, f"{shown}: no member {name!r} in {tar}")
        offset, size = found
        try:
            with _open(location) as f:
                f.seek(offset)
                data = f.read(size)
        except OSError as e:
            raise Skip(UNREADABLE_MEDIA, f"{shown}: {_os_error(e)}") from None
        if len(data) != size:
            raise Skip(UNREADABLE_MEDIA, f"{shown}: member cut short ({len(data)} of {size} "
                                         "bytes: truncated tar)")
        return data


def _open(location: str):
    if "://" in location:
        import fsspec

        return fsspec.open(location, "rb").open()
    return open(location, "rb")


def _read(location: str, shown: str) -> bytes:
    try:
        with _open(location) as f:
            return f.read()
    except FileNotFoundError:
        raise Skip(MISSING_MEDIA, f"{shown}: no such file ({location})") from None
    except IsADirectoryError:
        raise Skip(UNREADABLE_MEDIA, f"{shown}: a directory ({location})") from None
    except (OSError, ValueError, ImportError) as e:  # fsspec: unknown protocol, missing extra
        raise Skip(UNREADABLE_MEDIA, f"{shown}: {_os_error(e)}") from None


def _tar_members(location: str, shown: str) -> dict[str, tuple[int, int]]:
    """Member name -> (data offset, size), read from the headers only."""
    try:
        with _open(location) as f, tarfile.open(fileobj=f, mode="r:") as tar:
            return {info.name.removeprefix("./"): (info.offset_data, info.size)
                    for info in tar if info.isreg()}
    except FileNotFoundError:
        raise Skip(MISSING_MEDIA, f"{shown}: no such tar ({location})") from None
    except (OSError, ValueError, ImportError, tarfile.TarError, EOFError) as e:
        raise Skip(UNREADABLE_MEDIA, f"{shown}: cannot read the tar ({_os_error(e)})") from None


def _data_url(url: str, shown: str) -> tuple[str, bytes]:
    head, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise Skip(UNREADABLE_MEDIA, f"{shown}: a data URL without ','")
    params = head.split(";")
    try:
        if "base64" in params[1:]:
            return params[0], base64.b64decode(payload, validate=True)
        return params[0], urllib.parse.unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as e:
        raise Skip(UNREADABLE_MEDIA, f"{shown}: not base64 ({e})") from None


def _name_ext(name: str) -> str | None:
    base = name.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1] if "." in base else None


def _mime_ext(mime: str) -> str | None:
    ext = mimetypes.guess_extension(mime.strip().lower()) if mime else None
    return ext.lstrip(".") if ext else mime.rpartition("/")[2] or None


def _extension(kind: str, ext: str | None, data: bytes, shown: str) -> str:
    """The member extension for ``data``: its own when the layout knows it, else sniffed."""
    ext = (ext or "").lower() or None
    if ext is None or member_kind(ext) not in KIND_EXTS:
        ext = sniff(data) or ext
    found = member_kind(ext) if ext else None
    if found == kind:
        return ext
    if found in KIND_EXTS:
        raise Skip(UNSUPPORTED_MEDIA, f"{shown}: referenced as {kind}, but .{ext} is {found}")
    raise Skip(UNSUPPORTED_MEDIA, f"{shown}: unsupported {kind} type "
                                  f"{'.' + ext if ext else '(no extension)'} "
                                  f"(one of {', '.join(sorted(KIND_EXTS[kind]))})")


def sniff(data: bytes) -> str | None:
    """The extension of a media file from its first bytes, for the types the layout reads."""
    head = data[:16]
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if head.startswith(b"BM"):
        return "bmp"
    if head.startswith(b"RIFF") and head[8:12] in (b"WEBP", b"WAVE", b"AVI "):
        return {b"WEBP": "webp", b"WAVE": "wav", b"AVI ": "avi"}[head[8:12]]
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"ID3") or (len(head) > 1 and head[0] == 0xff and head[1] & 0xe0 == 0xe0):
        return "mp3"
    if head[4:8] == b"ftyp":
        return "mov" if head[8:10] == b"qt" else "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "mkv" if b"matroska" in data[:64] else "webm"
    return None


def _clipped(ref: str, limit: int = 80) -> str:
    """A reference as messages show it: a data URL's payload is no use in a message."""
    return ref if len(ref) <= limit else ref[:limit - 3] + "..."


def _os_error(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return " ".join(text.split())[:200]
