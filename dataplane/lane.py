"""The plan lane: plan fetches over one persistent TCP (or TLS) connection per client, served by
one thread from a selector loop -- no gRPC and no thread hand-off per fetch (see
:mod:`dataplane.server` for why, and ``PlaneClient(stream=True)`` for the client).

A frame, both ways: u32 little-endian n, then n bytes. Client to server: first a hello (an Arrow
IPC record {token}), then plan requests (the ``plan`` action's body). Server to client: one
status byte (LANE_OK or LANE_REFUSED) then Arrow IPC -- the plan's stream, an empty record
(hello accepted) or {error, reason?} (the one-line refusal and its ``actions.Reason``; after a
refused hello the server closes).

Under abuse (see :class:`LaneLimits`): at most ``max_connections`` connections (more are closed
as soon as they are accepted); a connection that has not sent a valid hello (with TLS: finished
its handshake and sent a hello) within ``hello_timeout_s`` is closed, and so is one that sent no
request for ``idle_timeout_s`` (a PlaneClient reconnects by itself). When ``accept`` fails for
want of file descriptors the listener is left out of the selector for 0.1 s, doubling up to
1 s, so the thread does not spin on a backlog it cannot accept. Warnings about such events are
logged at most once per WARN_EVERY_S seconds each, with a count of those left out. Timeouts are
checked from the selector loop itself (``select`` with a timeout): no thread per connection.

With an ``ssl.SSLContext`` every connection is TLS (the Flight port's certificate and key):
handshakes run non-blocking in the same loop, and a read or write that TLS needs to turn into
the other (``SSLWantReadError``/``SSLWantWriteError``) waits for that event before it is retried
with the very same bytes.
"""

from __future__ import annotations

import errno
import hmac
import logging
import selectors
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.flight as flight

from omniscale.dataplane import wire

log = logging.getLogger(__name__)

LANE_OK, LANE_REFUSED = 0, 1
LANE_MAX_REQUEST = 1 << 16  # a plan request is ~400 bytes; anything bigger is not one
WARN_EVERY_S = 10.0  # each kind of lane warning at most this often
ACCEPT_BACKOFF_S = (0.1, 1.0)  # listener pause after accept ran out of descriptors: first, most
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_TLS_READS = 16  # TLS reads per event before other connections get their turn
_U32 = struct.Struct("<I")
_REPLY = struct.Struct("<IB")
_LISTENER, _WAKE = object(), object()  # selector keys' data besides connections
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


def lane_frame(payload: bytes) -> bytes:
    return _U32.pack(len(payload)) + payload


@dataclass(frozen=True)
class LaneLimits:
    """What one lane tolerates; the defaults suit a job of thousands of ranks."""

    max_connections: int = 4096
    hello_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0


class _Conn:
    __slots__ = ("sock", "inbuf", "out", "authed", "closing", "deadline", "tls", "handshaking",
                 "retry")

    def __init__(self, sock: socket.socket, deadline: float, tls: bool):
        self.sock, self.inbuf, self.out = sock, bytearray(), []
        self.authed = self.closing = False
        self.deadline = deadline  # closed when the loop sees this (monotonic) time pass
        self.tls = self.handshaking = tls
        self.retry = False  # TLS: out[0] must be sent again as is (a write that had to wait)


class _RateLimited:
    """log.warning at most once per ``every`` seconds per kind, counting those left out."""

    def __init__(self, every: float = WARN_EVERY_S):
        self.every, self._next, self._left_out = every, {}, {}

    def warning(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return
        self._next[kind] = now + self.every
        more = self._left_out.pop(kind, 0)
        if more:
            message += f" ({more} more like it in the last {self.every:g} s)"
        log.warning(message, *args)


class PlanLane:
    """One thread serving plan requests on every lane connection from a selector loop.

    ``plan_ipc(request bytes) -> IPC bytes`` is the server's own handler (so the lane and the
    ``plan`` action cannot drift apart); Flight errors it raises become refusals. A connection
    is read only while its replies are flushed, so a client that does not read cannot make the
    plane buffer without bound; a malformed frame closes the connection. ``ssl_context``: a
    server-side context; every connection is then TLS."""

    def __init__(self, plan_ipc, host: str, token: str | None,
                 ssl_context: ssl.SSLContext | None = None, limits: LaneLimits | None = None):
        self._plan_ipc, self._token, self._ssl = plan_ipc, token, ssl_context
        self.limits = limits or LaneLimits()
        family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        self._listener = socket.create_server(address[:2], family=family, backlog=1024)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._listener, _READ, _LISTENER)
        self._sel.register(self._wake_r, _READ, _WAKE)
        self._conns: set[_Conn] = set()
        self._ready: set[_Conn] = set()  # TLS connections with decrypted bytes still to read
        self._warn = _RateLimited()
        self._now = time.monotonic()
        self._tick_s = max(0.01, min(1.0, self.limits.hello_timeout_s / 4,
                                     self.limits.idle_timeout_s / 4))
        self._sweep_at = self._now + self._tick_s
        self._listen_at: float | None = None  # listener paused (out of descriptors) until then
        self._backoff = ACCEPT_BACKOFF_S[0]
        self._thread: threading.Thread | None = None
        self.running = self._closed = False

    @property
    def connections(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        self.running = True
        self._thread = threading.Thread(target=self._run, name="omniscale-plane-lane",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the port and every connection (clients see the plane gone and retry)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self.running:
            self.running = False
            self._wake_w.send(b"x")
            self._thread.join(timeout=10)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        for conn in self._conns:
            conn.sock.close()
        self._listener.close()
        self._sel.close()
        self._wake_w.close()

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        select = self._sel.select
        while True:
            wait = 0.0 if self._ready else max(0.0, min(self._sweep_at, self._listen_at or
                                                        self._sweep_at) - self._now)
            events = select(wait)
            self._now = time.monotonic()
            for key, mask in events:
                conn = key.data
                if conn is _LISTENER:
                    self._accept()
                elif conn is _WAKE:
                    return
                else:
                    self._serve(conn, mask)
            if self._ready:
                for conn in list(self._ready):
                    self._ready.discard(conn)
                    self._serve(conn, _READ)
            if self._listen_at is not None and self._now >= self._listen_at:
                self._listen_at = None
                self._sel.register(self._listener, _READ, _LISTENER)
            if self._now >= self._sweep_at:
                self._sweep()

    def _serve(self, conn: _Conn, mask: int) -> None:
        if conn.sock.fileno() < 0:  # dropped earlier in this round
            return
        try:
            if conn.tls:
                self._tls_serve(conn)
                return
            if mask & _READ:
                self._read(conn)
            if mask & _WRITE and conn.sock.fileno() >= 0:
                self._flush(conn)
        except Exception:  # noqa: BLE001 -- one bad connection, not the lane
            log.exception("plan lane: dropping a connection")
            self._drop(conn)

    def _sweep(self) -> None:
        """Close connections past their deadline: no hello in time, or idle too long."""
        now = self._now
        self._sweep_at = now + self._tick_s
        for conn in [c for c in self._conns if c.deadline <= now]:
            if conn.authed:
                log.debug("plan lane: closing a connection idle for %g s",
                          self.limits.idle_timeout_s)
            else:
                self._warn.warning("hello", "plan lane: closed a connection that sent no valid "
                                   "hello within %g s", self.limits.hello_timeout_s)
            self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # that client gave up already: the next one
                continue
            except OSError as e:  # out of descriptors and such: stop selecting it a while
                self._sel.unregister(self._listener)
                self._listen_at = self._now + self._backoff
                kind = "descriptors" if e.errno in _OUT_OF_FDS else "accept"
                self._warn.warning(kind, "plan lane: accept failed (%s) with %d connections "
                                   "open; not accepting for %.1f s (raise `ulimit -n`, or "
                                   "fewer clients)", e.strerror or e, len(self._conns),
                                   self._backoff)
                self._backoff = min(self._backoff * 2, ACCEPT_BACKOFF_S[1])
                return
            self._backoff = ACCEPT_BACKOFF_S[0]
            if len(self._conns) >= self.limits.max_connections:
                sock.close()
                self._warn.warning("cap", "plan lane: refused a connection: %d open, the most "
                                   "it takes (max_connections)", len(self._conns))
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is not None:
                    sock = self._ssl.wrap_socket(sock, server_side=True,
                                                 do_handshake_on_connect=False)
            except OSError as e:
                log.debug("plan lane: dropping a new connection: %s", e)
                sock.close()
                continue
            conn = _Conn(sock, self._now + self.limits.hello_timeout_s, self._ssl is not None)
            self._conns.add(conn)
            self._sel.register(sock, _READ, conn)

    def _drop(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        self._ready.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _want(self, conn: _Conn, events: int) -> None:
        if self._sel.get_key(conn.sock).events != events:
            self._sel.modify(conn.sock, events, conn)

    # -- frames -------------------------------------------------------------------------------
    def _frames(self, conn: _Conn, data: bytes) -> bool:
        """Answer the whole frames received so far; False when the connection was dropped."""
        inbuf = conn.inbuf
        inbuf += data
        while len(inbuf) >= 4 and not conn.closing:
            size = _U32.unpack_from(inbuf)[0]
            if size > LANE_MAX_REQUEST:
                self._drop(conn)
                return False
            if len(inbuf) < 4 + size:
                break
            body = bytes(inbuf[4:4 + size])
            del inbuf[:4 + size]
            self._answer(conn, body)
        return True

    def _answer(self, conn: _Conn, body: bytes) -> None:
        conn.deadline = self._now + self.limits.idle_timeout_s
        if not conn.authed:
            try:
                given = str(wire.decode(body).get("token") or "")
            except ValueError:
                given = None
            if given is None or (self._token and not hmac.compare_digest(
                    given.encode(), self._token.encode())):
                self._refuse(conn, "missing or wrong token")
                conn.closing = True
                return
            conn.authed = True
            reply = pa.py_buffer(wire.encode({}))
        else:
            try:
                reply = self._plan_ipc(body)
            except flight.FlightError as e:  # its extra_info: the refusal's Reason
                self._refuse(conn, str(e), bytes(e.extra_info or b"").decode(errors="replace"))
                return
        conn.out += (_REPLY.pack(reply.size + 1, LANE_OK), memoryview(reply))

    def _refuse(self, conn: _Conn, message: str, reason: str = "") -> None:
        reply = wire.encode({"error": message} | ({"reason": reason} if reason else {}))
        conn.out += (_REPLY.pack(len(reply) + 1, LANE_REFUSED), reply)

    # -- plain TCP ----------------------------------------------------------------------------
    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        if self._frames(conn, data):
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        out = conn.out
        while out:
            try:
                sent = conn.sock.sendmsg(out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(conn)
                return
            while sent:
                size = len(out[0])
                if sent >= size:
                    del out[0]
                    sent -= size
                else:
                    out[0] = memoryview(out[0])[sent:]
                    sent = 0
        if not out and conn.closing:
            self._drop(conn)
            return
        self._want(conn, _WRITE if out else _READ)

    # -- TLS ----------------------------------------------------------------------------------
    def _tls_serve(self, conn: _Conn) -> None:
        """Handshake, then alternate: flush the replies, read more requests. Whatever TLS
        waits for (read or write) is what the connection is selected for next."""
        sock = conn.sock
        if conn.handshaking:
            try:
                sock.do_handshake()
            except ssl.SSLWantReadError:
                return self._want(conn, _READ)
            except ssl.SSLWantWriteError:
                return self._want(conn, _WRITE)
            except OSError as e:  # ssl.SSLError included: not TLS, wrong version, bad cert …
                log.debug("plan lane: TLS handshake failed: %s", e)
                return self._drop(conn)
            conn.handshaking = False
        for _ in range(_TLS_READS):
            if conn.out and not self._tls_flush(conn):
                return
            if conn.closing:
                return self._drop(conn)
            try:
                data = sock.recv(1 << 16)
            except ssl.SSLWantReadError:
                return self._want(conn, _READ)
            except ssl.SSLWantWriteError:
                return self._want(conn, _WRITE)
            except OSError:  # SSLZeroReturnError (a clean TLS close) included
                data = b""
            if not data:
                return self._drop(conn)
            if not self._frames(conn, data):
                return
        if conn.out and not self._tls_flush(conn):
            return
        self._want(conn, _READ)
        if sock.pending():
            self._ready.add(conn)  # decrypted bytes select cannot see: next round

    def _tls_flush(self, conn: _Conn) -> bool:
        """Send the queued replies; True when all went out, else the connection waits for what
        TLS needs (or was dropped). A send that must wait is retried with the same bytes, as
        OpenSSL requires, so replies are only merged before a first attempt."""
        out = conn.out
        while out:
            if not conn.retry and len(out) > 1:
                out[:] = [b"".join(out)]  # one TLS record per reply, not per piece
            try:
                sent = conn.sock.send(out[0])
            except ssl.SSLWantWriteError:
                conn.retry = True
                self._want(conn, _WRITE)
                return False
            except ssl.SSLWantReadError:
                conn.retry = True
                self._want(conn, _READ)
                return False
            except OSError:
                self._drop(conn)
                return False
            conn.retry = False
            if sent >= len(out[0]):
                del out[0]
            else:
                out[0] = memoryview(out[0])[sent:]
        if conn.closing:
            self._drop(conn)
            return False
        self._want(conn, _READ)
        return True
