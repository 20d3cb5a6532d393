"""Where a source's shards and its index live: a local directory or an fsspec URL.

A :class:`Location` is a URL (``s3://bucket/prefix``, ``gs://…``, ``https://…``) or an absolute
local path, plus the source's ``storage_options`` (endpoint, region, anonymous access). It is
two strings, so it pickles into worker processes and Ray actors and compares by value.

Credentials never travel in a Location: :func:`check_storage_options` refuses keys, secrets
and tokens in a spec (they come from the environment or a profile, as boto and gcsfs read
them), and :meth:`Location.shown` drops any ``user:password@`` part of a URL, so what reaches
logs, snapshots, metrics and the index names the place, not the key.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from omniscale.errors import UserError

# Option names that carry a secret in fsspec backends (s3fs, gcsfs, adlfs, http auth).
_SECRET = re.compile(r"(^|_)(key|secret|token|password|passwd|credentials?|sas|signature)$"
                     r"|^(auth|headers)$", re.IGNORECASE)
_ALLOWED_KEY_NAMES = {"use_listings_cache"}


def is_url(where: object) -> bool:
    """Whether ``where`` names a remote object store (``scheme://``), not a local path;
    ``file://`` URLs are local."""
    text = os.fspath(where) if not isinstance(where, str) else where
    scheme = text.split("://", 1)[0] if "://" in text else ""
    return bool(scheme) and scheme != "file" and scheme.replace("+", "").isalnum()


def check_storage_options(options: object, where: str) -> dict:
    """``options`` as a dict, or a UserError naming ``where`` and the offending key: a secret
    in a spec would be copied into the plane's snapshots and every run directory."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise UserError(f"{where}: storage_options must be a mapping, got "
                        f"{type(options).__name__}")
    for key, value in options.items():
        if _SECRET.search(str(key)) and str(key) not in _ALLOWED_KEY_NAMES:
            raise UserError(f"{where}.{key}: credentials do not belong in a spec (it is copied "
                            "into snapshots and run directories); set them in the environment "
                            "(AWS_ACCESS_KEY_ID, …) or a profile (`profile: NAME`)")
        if isinstance(value, dict):
            check_storage_options(value, f"{where}.{key}")
    try:
        json.dumps(options)
    except TypeError as e:
        raise UserError(f"{where}: storage_options must be plain YAML values ({e})") from None
    return dict(options)


@dataclass(frozen=True)
class Location:
    """A directory-like place: ``url`` (absolute local path or URL, no trailing slash) and the
    fsspec ``storage_options`` to reach it, kept as canonical JSON."""

    url: str
    options_json: str = "{}"

    @classmethod
    def of(cls, where: "str | os.PathLike | Location", storage_options: dict | None = None
           ) -> "Location":
        if isinstance(where, Location):
            return where if storage_options is None else cls(where.url, _canonical(
                storage_options))
        text = os.fspath(where)
        if text.startswith("file://"):
            text = text[len("file://"):]
        if not is_url(text):
            text = os.path.abspath(os.path.expanduser(text))
        else:
            text = text.rstrip("/") or text
        return cls(text, _canonical(storage_options or {}))

    @property
    def storage_options(self) -> dict:
        return json.loads(self.options_json)

    @property
    def is_local(self) -> bool:
        return not is_url(self.url)

    @property
    def name(self) -> str:
        """The last path component (a source directory's default name)."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def join(self, *parts: str) -> "Location":
        tail = "/".join(p.strip("/") for p in parts if p)
        url = f"{self.url.rstrip('/')}/{tail}" if tail else self.url
        return Location(os.path.normpath(url) if self.is_local else url, self.options_json)

    def local_path(self) -> Path:
        if not self.is_local:
            raise ValueError(f"{self.shown()}: not a local path")
        return Path(self.url)

    # --- file system ----------------------------------------------------------------------

    def fs(self):
        """``(fsspec file system, path within it)``; fsspec caches the file system per
        process and options, so this is cheap to call per operation."""
        import fsspec

        return fsspec.core.url_to_fs(self.url, **self.storage_options)

    def open(self, mode: str = "rb", **kwargs):
        fs, path = self.fs()
        return fs.open(path, mode, **kwargs)

    def exists(self) -> bool:
        if self.is_local:
            return os.path.exists(self.url)
        fs, path = self.fs()
        return fs.exists(path)

    def is_file(self) -> bool:
        if self.is_local:
            return os.path.isfile(self.url)
        fs, path = self.fs()
        return fs.isfile(path)

    def is_dir(self) -> bool:
        if self.is_local:
            return os.path.isdir(self.url)
        fs, path = self.fs()
        return fs.isdir(path)

    def fingerprint(self) -> dict:
        """What changes when the object changes: size plus mtime (local) or the ETag (object
        stores; a content hash for single-part uploads)."""
        if self.is_local:
            st = os.stat(self.url)
            return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        fs, path = self.fs()
        info = fs.info(path)
        tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime")
        return {"size": int(info["size"]), "etag": str(tag).strip('"') if tag else None}

    def size(self) -> int:
        return int(self.fingerprint()["size"])

    def shown(self) -> str:
        """The URL for messages: any ``user:password@`` dropped."""
        if self.is_local:
            return self.url
        parts = urlsplit(self.url)
        if "@" not in parts.netloc:
            return self.url
        return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))

    def __str__(self) -> str:
        return self.shown()


def _canonical(options: dict) -> str:
    return json.dumps(options, sort_keys=True, separators=(",", ":"))
