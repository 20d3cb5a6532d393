"""``PlaneClient``: the trainer's side of the plane's wire.

Every call has a timeout. While the plane is unreachable (restarting after a crash, not up
yet) calls retry with exponential backoff for up to ``retry_for`` seconds, so a trainer rides
through a plane restart; a refusal (bad rank, committed step, wrong token) is raised at once as
:class:`PlaneError` carrying the plane's one-line message and its ``reason``
(:class:`dataplane.actions.Reason`), which is what code branches on.

The action methods (``commit``, ``status``, ``report_corrupt`` …) come from the action registry
(:mod:`dataplane.actions`): each encodes its request and runs one path, :meth:`PlaneClient._invoke`.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import ssl
import threading
import time
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.flight as flight

from omniscale.dataplane import wire
from omniscale.dataplane.actions import PLAN_STREAM, Action, Reason, Reply, client_methods
from omniscale.dataplane.auth import TLS_ROOT_ENV, read_pem
from omniscale.dataplane.lane import LANE_OK, lane_frame
from omniscale.errors import UserError

log = logging.getLogger(__name__)


class PlaneError(UserError):
    """The plane refused a request, or stayed unreachable past the retry budget; ``reason``
    (a :class:`Reason`) says which, e.g. ``Reason.EXHAUSTED`` or ``Reason.UNREACHABLE``."""

    def __init__(self, message: str, reason: Reason = Reason.REFUSED):
        super().__init__(message)
        self.reason = Reason(reason)

    def __reduce__(self):
        return type(self), (str(self), self.reason)


def _lane_reply(sock: socket.socket) -> tuple[int, memoryview]:
    """One reply frame from the lane: (status, payload), read to its last byte."""
    data = sock.recv(1 << 16)
    while 0 < len(data) < 5:
        more = sock.recv(1 << 16)
        if not more:
            break
        data += more
    if len(data) < 5:
        raise ConnectionError("the plan lane closed the connection")
    total = 4 + int.from_bytes(data[:4], "little")
    if len(data) < total:
        buf = bytearray(total)
        buf[:len(data)] = data
        view, got = memoryview(buf), len(data)
        while got < total:
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("the plan lane closed the connection mid-reply")
            got += n
        data = buf
    elif len(data) > total:  # one request in flight: nothing may follow its reply
        raise ConnectionError("the plan lane sent more than one reply")
    return data[4], memoryview(data)[5:total]


def _lane_error(data) -> tuple[str, bytes]:
    """A lane refusal's message and its reason, as a Flight error's (message, extra_info)."""
    try:
        reply = wire.decode(bytes(data))
    except ValueError:
        return "refused (unreadable reply)", b""
    return str(reply.get("error") or "refused"), str(reply.get("reason") or "").encode()


def _reason(e: flight.FlightError) -> Reason:
    """The plane's reason for a refusal (the error's extra_info), else the one its type
    implies: a plane without reasons, or an error from gRPC itself."""
    try:
        return Reason(bytes(e.extra_info or b"").decode())
    except ValueError:  # none, or one this client does not know
        pass
    if isinstance(e, flight.FlightUnauthenticatedError):
        return Reason.UNAUTHENTICATED
    if isinstance(e, flight.FlightInternalError):
        return Reason.INTERNAL
    return Reason.REFUSED


_RETRYABLE = (flight.FlightUnavailableError, flight.FlightTimedOutError,
              flight.FlightCancelledError, ConnectionError)


def _message(e: Exception) -> str:
    """The server's own message, without gRPC's decorations."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = text.split(". Detail:")[0]
    if ", with message: " in text:  # "Flight returned <kind> error, with message: ..."
        text = text.split(", with message: ", 1)[1]
    return text


@client_methods
class PlaneClient:
    """The plane's actions over the wire: a method per action of :mod:`dataplane.actions`,
    named as the plane's and with its parameters (``get_plan(step, rank)``, ``commit(step,
    rank=None, plan_fp=None)``, ``commit_many(rank, steps, plan_fps)`` …).

    ``stream=True``: ``get_plan`` keeps one connection open for its requests instead of one
    ``plan`` action call each (same plans, same errors): the server's plan lane when it has one
    (a plain TCP connection, no gRPC; see :mod:`dataplane.server`), else a long-lived Flight
    ``do_exchange`` stream. A lane request times out after ``timeout`` like any call. The
    exchange stream is reopened after a random ``stream_s/2 … stream_s`` seconds (random, so
    that clients started together do not all reopen at once) and given ``stream_s + timeout``
    to live, so every request keeps at least ``timeout``; a server's shutdown waits for open
    exchange streams, so close idle clients (or expect it to wait up to that long). One thread
    at a time uses the connection; others fall back to actions.

    A ``grpc+tls://`` URL is verified against ``tls_root`` (a PEM file: the CA, or the plane's
    own self-signed certificate), else $OMNISCALE_PLANE_TLS_ROOT, else the system's CAs; the
    plan lane is then TLS too, checked the same way."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0,
                 retry_for: float = 60.0, stream: bool = False, stream_s: float = 5.0,
                 tls_root: str | None = None):
        self.url, self.timeout, self.retry_for = url, timeout, retry_for
        self._token = token
        self._tls = urlsplit(url).scheme == "grpc+tls"
        self.tls_root = (tls_root or os.environ.get(TLS_ROOT_ENV)) if self._tls else None
        self._root_pem = None if self.tls_root is None else read_pem(
            self.tls_root, "--tls-root" if tls_root else f"${TLS_ROOT_ENV}")
        self._ssl: ssl.SSLContext | None = None
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(headers=headers, timeout=timeout)
        self._client: flight.FlightClient | None = None
        self._plan_actions: dict[tuple[int, int], flight.Action] = {}
        self.stream, self.stream_s = stream, stream_s
        self._stream_options = flight.FlightCallOptions(headers=headers,
                                                        timeout=stream_s + timeout)
        self._stream: tuple | None = None  # (writer, reader, reopen at)
        self._stream_lock = threading.Lock()
        self._lane: socket.socket | None = None
        self._lane_port: int | None = None  # None: not asked yet; 0: the server has none
        self._lane_frames: dict[tuple[int, int], bytes] = {}

    def _connect(self) -> flight.FlightClient:
        if self._client is None:
            extra = {} if self._root_pem is None else {"tls_root_certs": self._root_pem}
            self._client = flight.FlightClient(self.url, **extra)
        return self._client

    def _retrying(self, what: str, fn):
        deadline = time.monotonic() + self.retry_for
        delay = 0.05
        while True:
            try:
                return fn(self._connect())
            except _RETRYABLE as e:
                if time.monotonic() + delay > deadline:
                    raise PlaneError(f"plane at {self.url}: {what} failed for "
                                     f"{self.retry_for:g} s: {_message(e)}",
                                     Reason.UNREACHABLE) from None
                self.close()  # a fresh channel after a server restart
                time.sleep(delay)  # backoff between attempts, not synchronisation
                delay = min(delay * 2, 2.0)
            except flight.FlightError as e:
                raise PlaneError(f"plane at {self.url}: {what}: {_message(e)}",
                                 _reason(e)) from None

    def _invoke(self, action: Action, request):
        """Run one action: a plan over the plan's own paths, anything else as a Flight action
        whose reply is one record."""
        if action.reply is Reply.PLAN:
            return self._fetch_plan(request.step, request.rank, action.label(request))
        reply = self._action(action.name, action.to_body(request))
        return reply if action.client_reply is None else action.client_reply(reply)

    def _fetch_plan(self, step: int, rank: int, what: str) -> pa.Table:
        """This rank's plan for ``step``: one row per LLM placement or encoder item."""
        key = step, rank
        action = self._plan_actions.get(key)
        if action is None:  # the request bytes are the same every time: encode them once
            if len(self._plan_actions) > 4096:
                self._plan_actions.clear()
            action = self._plan_actions[key] = flight.Action(
                "plan", wire.plan_request(*key))

        def fetch(client):  # one IPC stream in one result ("plan" action; see server.py)
            if self.stream and self._stream_lock.acquire(blocking=False):
                try:  # the stream serves one request at a time; other threads use actions
                    fresh = self._lane_port is None
                    if fresh:
                        self._lane_port = self._ask_lane(client)
                    data = self._lane_fetch(key, action.body, fresh) if self._lane_port else None
                    if data is None:
                        data = self._stream_fetch(client, action.body)
                    return pa.ipc.open_stream(data).read_all()
                finally:
                    self._stream_lock.release()
            results = list(client.do_action(action, options=self._options))
            return pa.ipc.open_stream(results[0].body).read_all()
        return self._retrying(what, fetch)

    # -- the plan lane ------------------------------------------------------------------------
    def _ask_lane(self, client: flight.FlightClient) -> int:
        """The server's plan lane port; 0 when it has none (or the URL is not TCP or TLS)."""
        if urlsplit(self.url).scheme not in ("grpc", "grpc+tcp", "grpc+tls"):
            return 0
        try:
            results = list(client.do_action(flight.Action("lane", b""), options=self._options))
        except flight.FlightServerError:  # a server without the lane action (it raises no
            return 0  # other FlightServerError): fetch over the exchange stream instead
        port = wire.decode(results[0].body).get("port") if results else 0
        return int(port or 0)

    def _lane_fetch(self, key: tuple[int, int], body: pa.Buffer, fresh: bool
                    ) -> pa.Buffer | None:
        """One plan request over the lane (connected on first use); the plan's IPC bytes, or
        None when the lane port the server gave just now (``fresh``) cannot be reached although
        Flight can (a firewall that lets only the Flight port through): this client then uses
        the exchange stream until closed. A remembered port that refuses (a plane restarted
        elsewhere) is asked for again."""
        frame = self._lane_frames.get(key)
        if frame is None:
            if len(self._lane_frames) > 4096:
                self._lane_frames.clear()
            frame = self._lane_frames[key] = lane_frame(body.to_pybytes())
        sock = self._lane
        if sock is None:
            host, raw = urlsplit(self.url).hostname, None
            try:  # a firewall that drops the lane's packets costs 5 s once, not the timeout
                sock = raw = socket.create_connection((host, self._lane_port),
                                                      timeout=min(self.timeout, 5.0))
                if self._tls:  # the handshake: within the same 5 s
                    sock = self._lane_tls().wrap_socket(raw, server_hostname=host)
                sock.settimeout(self.timeout)
            except OSError as e:  # ssl.SSLError included
                if raw is not None:
                    raw.close()
                if not fresh:
                    self._lane_port = None
                    raise flight.FlightUnavailableError(f"plan lane: {e}") from None
                log.warning("plane at %s: plan lane port %d unreachable (%s): using the "
                            "Flight stream", self.url, self._lane_port, e)
                self._lane_port = 0
                return None
        try:
            if self._lane is None:
                self._lane_hello(sock)
            sock.sendall(frame)
            status, data = _lane_reply(sock)
        except socket.timeout:
            self._close_lane()  # a late reply would answer the next request: start afresh
            raise flight.FlightTimedOutError(f"plan lane: no reply in {self.timeout:g} s") \
                from None
        except OSError as e:  # the plane went away (a restart may open another lane port)
            self._close_lane()
            self._lane_port = None
            raise flight.FlightUnavailableError(f"plan lane: {e}") from None
        if status != LANE_OK:
            message, reason = _lane_error(data)
            raise flight.FlightServerError(message, extra_info=reason)
        return pa.py_buffer(data)

    def _lane_hello(self, sock: socket.socket) -> None:
        """Present the token on a new lane connection; it becomes the client's lane."""
        self._lane = sock  # closed by _close_lane whatever happens next
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(lane_frame(wire.encode({"token": self._token or ""})))
        status, data = _lane_reply(sock)
        if status != LANE_OK:
            self._close_lane()
            raise flight.FlightUnauthenticatedError(_lane_error(data)[0])

    def _lane_tls(self) -> ssl.SSLContext:
        """The lane's client TLS context: the same roots and host check as Flight's."""
        if self._ssl is None:
            context = ssl.create_default_context(
                cadata=None if self._root_pem is None else self._root_pem.decode("ascii"))
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            self._ssl = context
        return self._ssl

    def _close_lane(self) -> None:
        sock, self._lane = self._lane, None
        if sock is not None:
            sock.close()

    # -- the Flight exchange stream (servers without a lane) ----------------------------------
    def _stream_fetch(self, client: flight.FlightClient, body: pa.Buffer) -> pa.Buffer:
        """One plan request over the plans stream (opened or renewed as needed)."""
        now = time.monotonic()
        if self._stream is not None and now >= self._stream[2]:
            self._close_stream()
        if self._stream is None:
            writer, reader = client.do_exchange(
                flight.FlightDescriptor.for_command(PLAN_STREAM), options=self._stream_options)
            self._stream = (writer, reader, now + self.stream_s * random.uniform(0.5, 1.0))
        writer, reader, _ = self._stream
        try:
            writer.write_metadata(body)
            reply = reader.read_chunk().app_metadata
        except BaseException as e:
            self._close_stream()
            if isinstance(e, StopIteration):  # the server ended the stream: as if unreachable
                raise flight.FlightUnavailableError("plan stream ended") from None
            raise
        if reply is None:
            self._close_stream()
            raise flight.FlightInternalError("plan stream: a reply without a plan")
        return reply

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream[0].close()
            except Exception:  # noqa: BLE001 -- a broken stream is dropped either way
                pass

    def _action(self, kind: str, body: dict) -> dict:
        """The Flight action ``kind`` with ``body`` (a wire record, empty: no body)."""
        action = flight.Action(kind, wire.encode(body) if body else b"")

        def run(client):
            results = list(client.do_action(action, options=self._options))
            return wire.decode(results[0].body) if results else {}
        return self._retrying(kind, run)

    def close(self) -> None:
        self._close_stream()
        self._close_lane()
        self._lane_port = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> "PlaneClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
