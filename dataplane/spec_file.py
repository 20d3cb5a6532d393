"""Reading a mixing spec file for the plane: the spec it starts from, and a ``reload``'s, whose
name comes from a client.

A reload reads only a regular file (never a FIFO or a device, which would block the plane or
feed it without end) under the plane's ``--spec-root``, of at most MAX_SPEC_BYTES; and its
refusal names the file and the field, never the file's text -- a client may name any file
under the root, and a YAML or validation message may quote what it read.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from omniscale.dataplane.actions import Reason, RequestError
from omniscale.dataplane.spec import MixSpec, SpecError, spec_from_text

log = logging.getLogger(__name__)

MAX_SPEC_BYTES = 1 << 20  # a mixing spec is a few KiB; a reload reads no more than this


def read_reload_spec(root: Path, name: str) -> tuple[Path, str, MixSpec]:
    """The spec a reload names (a path under ``root``): its real path, text and parsed form;
    anything else is refused with Reason.SPEC in one line."""
    path = Path(os.path.realpath(root / name))
    if path != root and root not in path.parents:
        raise RequestError(f"{name}: reload reads specs only under {root} "
                           "(the plane's --spec-root)", Reason.SPEC)
    try:
        text = read_spec_file(path, limit=MAX_SPEC_BYTES)  # names the file, no contents
    except SpecError as e:
        raise RequestError(str(e), Reason.SPEC) from None
    try:
        return path, text, spec_from_text(text, str(path), root=path.parent)
    except SpecError as e:
        log.warning("reload refused: %s", e)
        raise RequestError(_redacted(e, str(path)), Reason.SPEC) from None


def read_spec_file(path: Path, limit: int | None) -> str:
    """A spec's text: a regular file (never a FIFO or device: opened without blocking and
    checked after opening), at most ``limit`` bytes, UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SpecError(f"{path}: file not found") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SpecError(f"{path}: not a regular file")
        if limit is not None and info.st_size > limit:
            raise SpecError(f"{path}: {info.st_size} bytes; a spec may have at most {limit}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(-1 if limit is None else limit + 1)
    finally:
        os.close(fd)
    if limit is not None and len(data) > limit:
        raise SpecError(f"{path}: more than {limit} bytes; a spec may have at most {limit}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not UTF-8 text") from None


_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]-]*$")


def _redacted(error: SpecError, file: str) -> str:
    """A spec error for a remote client: the file and the field, never the file's text
    (a YAML or validation message may quote it; the plane's own log has the whole line)."""
    rest = str(error).removeprefix(f"{file}: ")
    field = rest.split(": ", 1)[0]
    where = f"{field}: invalid" if _FIELD.match(field) and field != rest else \
        "not a valid mixing spec"
    return f"{file}: {where} (details in the plane's log; `omniscale data inspect` checks a spec)"
