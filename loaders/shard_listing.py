"""A source's shards and their fingerprints, in a local directory or under an object-store URL.

A re-index compares each shard's fingerprint with the one its index recorded: size and mtime
for a local file, size and ETag for an object (what :meth:`Location.fingerprint` reads). Remote
fingerprints come from the listing itself -- one LIST answers a thousand objects, where asking
each object would cost a request per shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from omniscale.errors import UserError
from omniscale.layout import FORMATS
from omniscale.location import Location

SHARD_SUFFIX = {"webdataset": ".tar", "parquet": ".parquet", "jsonl": ".jsonl"}


def source_shards(source: Location, fmt: str, required: bool = True) -> dict[str, dict]:
    """Shard path relative to ``source`` -> fingerprint, sorted by path; names starting with
    ``_`` or ``.`` (the index, temporary files) are not shards."""
    suffix = SHARD_SUFFIX[fmt]
    if source.is_local:
        root = source.local_path()
        if not root.is_dir():
            raise UserError(f"{shown(source)}: no such source directory")
        found = {p.relative_to(root).as_posix(): p for p in root.rglob(f"*{suffix}")
                 if p.is_file() and not _hidden(p.relative_to(root).as_posix())}
        shards = {name: shard_fingerprint(found[name]) for name in sorted(found)}
    else:
        listing = _remote_listing(source)
        shards = {name: listing[name] for name in sorted(listing) if name.endswith(suffix)}
    if required and not shards:
        raise UserError(f"{shown(source)}: no *{suffix} shards (format {fmt})")
    return shards


def list_shards(source_dir: "str | Path | Location", fmt: str, required: bool = True
                ) -> list[str]:
    """Shard paths relative to ``source_dir``, sorted (see :func:`source_shards`)."""
    return list(source_shards(Location.of(source_dir), fmt, required))


def infer_format(source_dir: "str | Path | Location") -> str:
    """The one format whose shards the directory holds; a UserError if none or several."""
    source = Location.of(source_dir)
    if source.is_local:
        found = [fmt for fmt in FORMATS if source_shards(source, fmt, required=False)]
    else:  # one listing, not one per format
        names = _remote_listing(source)
        found = [fmt for fmt in FORMATS if any(n.endswith(SHARD_SUFFIX[fmt]) for n in names)]
    if len(found) != 1:
        what = "no shards" if not found else f"shards of several formats ({', '.join(found)})"
        raise UserError(f"{shown(source)}: {what}; a source directory holds *.tar, *.parquet "
                        "or *.jsonl shards of one format")
    return found[0]


def shard_fingerprint(path: Path) -> dict:
    stat = Path(path).stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def remote_fingerprint(info: dict) -> dict:
    """An object's fingerprint from a listing or ``info`` entry, as
    :meth:`Location.fingerprint` makes it (size and ETag)."""
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime")
    return {"size": int(info["size"]), "etag": str(tag).strip('"') if tag else None}


def shown(where: "str | Path | Location") -> str:
    """A place as messages show it: a URL without credentials, or a local path relative to
    the working directory when below it."""
    if isinstance(where, Location):
        if not where.is_local:
            return where.shown()
        where = where.local_path()
    path = Path(where)
    if path.is_absolute() and path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())
    return path.as_posix()


@contextlib.contextmanager
def remote_errors(loc: Location, doing: str) -> Iterator[None]:
    """An object store's failure (no such bucket, access denied, no connection) as one line
    naming the place; the store's own exception types differ per backend."""
    try:
        yield
    except UserError:
        raise
    except FileNotFoundError:
        raise UserError(f"{loc.shown()}: cannot {doing}: no such bucket or object") from None
    except Exception as e:  # noqa: BLE001 -- any backend's error, turned into one line
        from omniscale.loaders.probe import short

        denied = isinstance(e, PermissionError) or "AccessDenied" in str(e)
        reason = "access denied" if denied else f"{type(e).__name__}: {short(e)}"
        netloc = urlsplit(loc.url).netloc
        if "@" in netloc:  # a backend's message may quote the URL, user:password and all
            reason = reason.replace(netloc.rsplit("@", 1)[0], "…")
        raise UserError(f"{loc.shown()}: cannot {doing} ({reason})") from None


def _remote_listing(source: Location) -> dict[str, dict]:
    """Every object below ``source`` that could be a shard: relative path -> fingerprint."""
    fs, path = source.fs()
    prefix = path.rstrip("/") + "/"
    with remote_errors(source, "list the source"):
        fs.invalidate_cache(path)  # a re-index in the same process must see new objects
        found = fs.find(path, detail=True)
    listing = {}
    for name, info in found.items():
        rel = name[len(prefix):] if name.startswith(prefix) else ""
        if rel and info.get("type") != "directory" and not _hidden(rel):
            listing[rel] = remote_fingerprint(info)
    if not listing:
        raise UserError(f"{source.shown()}: no such source directory (no objects under it)")
    return listing


def _hidden(rel: str) -> bool:
    return any(part[:1] in ("_", ".") for part in rel.split("/"))
