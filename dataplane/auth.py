"""Where the plane's secrets come from, and when the plane may bind beyond loopback.

One place for every command (``plane serve``, ``plane status``, ``plane reload``, ``train
--plane``): the bearer token comes from ``--token-file FILE`` or the OMNISCALE_PLANE_TOKEN
environment variable (``--token T`` still works, but any user on the machine sees it in
``ps``); a ``grpc+tls://`` plane's CA certificate from ``--tls-root`` or OMNISCALE_PLANE_TLS_ROOT.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

from omniscale.errors import UserError

TOKEN_ENV = "OMNISCALE_PLANE_TOKEN"
TLS_ROOT_ENV = "OMNISCALE_PLANE_TLS_ROOT"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:  # a host name: loopback only if every address it resolves to is
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def resolve_token(token: str | None = None, token_file: str | os.PathLike | None = None,
                  environ=None) -> str | None:
    """The token: ``token_file``'s contents (surrounding whitespace stripped), else ``token``,
    else $OMNISCALE_PLANE_TOKEN, else None. A file that is missing, unreadable or empty is a
    one-line UserError naming it."""
    if token_file is not None:
        try:
            text = Path(token_file).read_text().strip()
        except FileNotFoundError:
            raise UserError(f"--token-file {token_file}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            raise UserError(f"--token-file {token_file}: cannot read it ({why})") from None
        if not text:
            raise UserError(f"--token-file {token_file}: the file is empty")
        if "\n" in text:
            raise UserError(f"--token-file {token_file}: expected one line (the token), got "
                            f"{text.count(chr(10)) + 1}")
        return text
    if token:
        return token
    return (environ if environ is not None else os.environ).get(TOKEN_ENV) or None


def read_pem(path: str | os.PathLike, flag: str) -> bytes:
    """A PEM file's bytes; a missing or unreadable one is a one-line UserError naming ``flag``."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise UserError(f"{flag} {path}: not a PEM file")
    return data


def check_bind(host: str, token: str | None, tls: bool, insecure: bool = False) -> None:
    """Binding loopback needs nothing. Binding anything else needs a token, and TLS unless
    ``insecure`` (``--insecure``: plain TCP, the token then crosses the network in clear text).
    Refusals are one line naming the flags to add."""
    if is_loopback(host):
        return
    missing = []
    if not token:
        missing.append(f"--token-file FILE (or {TOKEN_ENV})")
    if not tls and not insecure:
        missing.append("--tls-cert/--tls-key (or --insecure to serve plain TCP)")
    if missing:
        raise UserError(f"--host {host}: binding anything but loopback requires "
                        f"{' and '.join(missing)}")
