"""The plane's Arrow Flight front: plans by ``do_get`` or the ``plan`` action, the rest by
``do_action``; plus the *plan lane*, a plain TCP port that serves only plan fetches.

The ``plan`` action returns the plan as one Arrow IPC stream in a single result, serialised
once per (step, rank) and cached: a fetch is then one small gRPC message and a dict lookup, about
twice as fast as ``do_get``'s record-batch stream (which stays for generic Flight clients).

The plan lane (``PlaneClient(stream=True)``; its port is what the ``lane`` action returns) is
the hot path of a job: every rank fetches a plan per step. Over gRPC each fetch costs thread
hand-offs in gRPC's event engine and a GIL hand-off to the Python handler thread of the call or
stream, on both sides: at hundreds of ranks on a few cores the transport, not the plane, was the
bottleneck (tools/bench/plane.py measures the CPU per fetch of each transport). The lane carries
the very same bytes -- the ``plan`` action's request (a one-row Arrow IPC record) and its reply
(the plan's IPC stream, cached per (step, rank)) -- over one persistent TCP connection per
client, framed by a 4-byte length, and one thread serves every connection from a selector loop:
no gRPC and no thread hand-off per fetch. It binds where the Flight server binds and asks for the
same token (the first frame of a connection); refusals are the same one-line messages.
Everything else stays on Flight.

Transport only: a :class:`PlaneService` (the data plane itself) does the work. Requests and
replies are Arrow IPC (:mod:`dataplane.wire`). The server binds loopback unless told otherwise,
and binding anything else requires a bearer token that every call must present.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import selectors
import socket
import struct
import threading
from typing import Protocol

import pyarrow as pa
import pyarrow.flight as flight

from dataplane import wire
from dataplane.errors import UserError

log = logging.getLogger(__name__)

ACTIONS = {
    "plan": "a rank's plan as an Arrow IPC stream (what do_get serves): {step, rank}",
    "commit": "mark a step (or one rank's share of it) as trained: {step, rank?, plan_fp?}",
    "status": "mixture, progress, balance and clients: {}",
    "snapshot": "write a snapshot now: {step?}",
    "reload": "apply a new mixing spec at the next window boundary: {spec}",
    "audit": "samples planned, committed, duplicated and missing per epoch and source: {}",
    "costs": "a refitted cost model (c = linear·L + quadratic·L²) for the windows no rank has "
             "seen: {linear, quadratic}",
    "report_corrupt": "a planned sample does not decode: quarantine it, get a replacement from "
                      "its source: {step, rank, source, shard, key, reason, epoch}",
    "lane": "the TCP port of the plan lane (plan fetches without gRPC; see dataplane.server): "
            "{} -> {port} (0: no lane)",
}


PLAN_STREAM = b"plans"  # do_exchange command of the plan stream (PlaneClient(stream=True))
PLAN_CACHE_STEPS = 32  # steps whose served plans' IPC bytes are kept
_NO_PLANS: dict = {}


class RequestError(UserError):
    """A request the plane refuses (unknown rank, step already committed, bad spec …)."""


class PlaneService(Protocol):
    def get_plan(self, step: int, rank: int) -> pa.Table: ...
    def commit(self, step: int, rank: int | None = None, plan_fp: str | None = None
               ) -> dict: ...
    def status(self) -> dict: ...
    def snapshot(self, step: int | None = None) -> dict: ...
    def reload(self, spec: str) -> dict: ...
    def audit(self) -> dict: ...


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


class _TokenCheck(flight.ServerMiddlewareFactory):
    def __init__(self, token: str):
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info, headers):
        given = (headers.get("authorization") or [""])[0]
        given = given.encode() if isinstance(given, str) else given
        if not hmac.compare_digest(given, self._expected):
            raise flight.FlightUnauthenticatedError("missing or wrong token")
        return None


class PlaneServer(flight.FlightServerBase):
    """Serves one :class:`PlaneService`; ``url`` is where clients connect."""

    def __init__(self, service: PlaneService, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, lane: bool = True):
        """``lane``: also open the plan lane (a second, ephemeral port on ``host``)."""
        if not is_loopback(host) and not token:
            raise UserError(f"--host {host}: binding anything but loopback requires --token")
        middleware = {"auth": _TokenCheck(token)} if token else None
        shown = f"[{host}]" if ":" in host else host  # an IPv6 address goes in brackets
        super().__init__(f"grpc+tcp://{shown}:{port}", middleware=middleware)
        self.service = service
        self.url = f"grpc+tcp://{shown}:{self.port}"
        self._thread: threading.Thread | None = None
        # step -> rank -> (the table the service returned, its IPC bytes)
        self._plans: dict[int, dict[int, tuple[pa.Table, pa.Buffer]]] = {}
        self._plans_lock = threading.Lock()
        self.lane: PlanLane | None = PlanLane(self._plan_ipc, host, token) if lane else None

    def start(self) -> "PlaneServer":
        """Serve from a daemon thread (the embedded mode); returns self."""
        self._thread = threading.Thread(target=self.serve, name="omniscale-plane", daemon=True)
        self._thread.start()
        if self.lane is not None:
            self.lane.start()
        return self

    def stop(self) -> None:
        if self.lane is not None:
            self.lane.stop()
        self.shutdown()
        if self._thread is not None:
            self._thread.join()

    # -- Flight handlers ------------------------------------------------------------------
    def do_get(self, context, ticket):
        request = _call(wire.decode, ticket.ticket)
        step, rank = _int(request, "step"), _int(request, "rank")
        table = _call(self.service.get_plan, step, rank)
        return flight.RecordBatchStream(table)

    def _plan_ipc(self, body: bytes) -> pa.Buffer:
        """The plan a request names, as IPC bytes; the bytes are reused while the service
        returns the very same table object (a re-plan makes a new one). The cache keeps the
        plans of the latest PLAN_CACHE_STEPS steps served (a job serves a few windows ahead of
        its trainers and never an already committed step again)."""
        key = wire.read_plan_request(body)  # what PlaneClient sends, without decoding it
        if key is None:
            request = _call(wire.decode, body)
            key = _int(request, "step"), _int(request, "rank")
        table = _call(self.service.get_plan, *key)
        cached = self._plans.get(key[0], _NO_PLANS).get(key[1])
        if cached is not None and cached[0] is table:
            return cached[1]
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        data = sink.getvalue()
        with self._plans_lock:  # readers never iterate: only writers need the lock
            ranks = self._plans.get(key[0])
            if ranks is None:
                ranks = self._plans[key[0]] = {}
                while len(self._plans) > PLAN_CACHE_STEPS:
                    del self._plans[min(self._plans)]
            ranks[key[1]] = (table, data)
        return data

    def do_exchange(self, context, descriptor, reader, writer):
        """The ``plans`` stream: each message the client writes (app metadata: the ``plan``
        action's request bytes) is answered by one message carrying the plan's IPC bytes --
        the ``plan`` action without a gRPC call per fetch. A refusal ends the stream with the
        same Flight error the action raises (the client opens a new one)."""
        if descriptor.command != PLAN_STREAM:
            raise flight.FlightServerError(
                f"do_exchange: unknown command {descriptor.command!r} (expected {PLAN_STREAM!r})")
        plan_ipc, write = self._plan_ipc, writer.write_metadata
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                return
            body = chunk.app_metadata
            if body is None:
                raise flight.FlightServerError("plans: each message's app metadata must be a "
                                               "plan request")
            write(plan_ipc(body.to_pybytes()))

    def do_action(self, context, action):
        kind = action.type
        if kind == "plan":
            return [flight.Result(self._plan_ipc(action.body.to_pybytes()))]
        if kind == "lane":
            port = self.lane.port if self.lane is not None and self.lane.running else 0
            return [flight.Result(pa.py_buffer(wire.encode({"port": port})))]
        return self._other_action(kind, action)

    def _other_action(self, kind, action):
        body = _call(wire.decode, action.body) if action.body.size else {}
        if kind == "commit":
            rank, plan_fp = body.get("rank"), body.get("plan_fp")
            args = [_int(body, "step"), None if rank is None else _int(body, "rank")]
            if plan_fp is not None:  # only then: services without plan checks stay valid
                if not isinstance(plan_fp, str):
                    raise flight.FlightServerError(f"plan_fp: expected a string, got {plan_fp!r}")
                args.append(plan_fp)
            reply = _call(self.service.commit, *args)
        elif kind == "status":
            reply = _call(self.service.status)
        elif kind == "snapshot":
            step = body.get("step")
            reply = _call(self.service.snapshot, None if step is None else _int(body, "step"))
        elif kind == "reload":
            spec = body.get("spec")
            if not isinstance(spec, str) or not spec:
                raise flight.FlightServerError("reload: 'spec' (a path) is required")
            reply = _call(self.service.reload, spec)
        elif kind == "audit":
            reply = _call(self.service.audit)
        elif kind == "costs":
            values = [body.get("linear"), body.get("quadratic")]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise flight.FlightServerError("costs: 'linear' and 'quadratic' must be numbers")
            reply = _call(self.service.set_costs, *map(float, values))
        elif kind == "report_corrupt":
            names = ("source", "shard", "key", "reason")
            if not all(isinstance(body.get(n), str) for n in names):
                raise flight.FlightServerError(f"report_corrupt: {', '.join(names)} must be "
                                               "strings")
            reply = _call(self.service.report_corrupt, _int(body, "step"), _int(body, "rank"),
                          *(body[n] for n in names), _int(body, "epoch"))
        else:
            raise flight.FlightServerError(
                f"unknown action {kind!r} (one of {', '.join(sorted(ACTIONS))})")
        yield flight.Result(pa.py_buffer(wire.encode(reply)))

    def list_actions(self, context):
        return list(ACTIONS.items())


# -- the plan lane -----------------------------------------------------------------------------
# A frame, both ways: u32 little-endian n, then n bytes. Client to server: first a hello (an Arrow
# IPC record {token}), then plan requests (the ``plan`` action's body). Server to client: one
# status byte (LANE_OK or LANE_REFUSED) then Arrow IPC -- the plan's stream, an empty record
# (hello accepted) or {error} (the one-line refusal; after a refused hello the server closes).
LANE_OK, LANE_REFUSED = 0, 1
LANE_MAX_REQUEST = 1 << 16  # a plan request is ~400 bytes; anything bigger is not one
_U32 = struct.Struct("<I")
_REPLY = struct.Struct("<IB")
_LISTENER, _WAKE = object(), object()  # selector keys' data besides connections


def lane_frame(payload: bytes) -> bytes:
    return _U32.pack(len(payload)) + payload


class _Conn:
    __slots__ = ("sock", "inbuf", "out", "authed", "closing")

    def __init__(self, sock: socket.socket):
        self.sock, self.inbuf, self.out = sock, bytearray(), []
        self.authed = self.closing = False


class PlanLane:
    """One thread serving plan requests on every lane connection from a selector loop.

    ``plan_ipc(request bytes) -> IPC bytes`` is the server's own handler (so the lane and the
    ``plan`` action cannot drift apart); Flight errors it raises become refusals. A connection
    is read only while its replies are flushed, so a client that does not read cannot make the
    plane buffer without bound; a malformed frame closes the connection."""

    def __init__(self, plan_ipc, host: str, token: str | None):
        self._plan_ipc, self._token = plan_ipc, token
        family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        self._listener = socket.create_server(address[:2], family=family, backlog=1024)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._thread: threading.Thread | None = None
        self.running = self._closed = False

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
        self._sel.close()
        self._wake_w.close()

    def _run(self) -> None:
        select = self._sel.select
        while True:
            for key, events in select():
                conn = key.data
                if conn is _LISTENER:
                    self._accept()
                elif conn is _WAKE:
                    return
                else:
                    try:
                        if events & selectors.EVENT_READ:
                            self._read(conn)
                        if events & selectors.EVENT_WRITE and conn.sock.fileno() >= 0:
                            self._flush(conn)
                    except Exception:  # noqa: BLE001 -- one bad connection, not the lane
                        log.exception("plan lane: dropping a connection")
                        self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors and such: keep serving the others
                log.warning("plan lane: accept failed: %s", e)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sel.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _drop(self, conn: _Conn) -> None:
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

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
        inbuf = conn.inbuf
        inbuf += data
        while len(inbuf) >= 4 and not conn.closing:
            size = _U32.unpack_from(inbuf)[0]
            if size > LANE_MAX_REQUEST:
                self._drop(conn)
                return
            if len(inbuf) < 4 + size:
                break
            body = bytes(inbuf[4:4 + size])
            del inbuf[:4 + size]
            self._answer(conn, body)
        self._flush(conn)

    def _answer(self, conn: _Conn, body: bytes) -> None:
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
            except flight.FlightError as e:
                self._refuse(conn, str(e))
                return
        conn.out += (_REPLY.pack(reply.size + 1, LANE_OK), memoryview(reply))

    def _refuse(self, conn: _Conn, message: str) -> None:
        reply = wire.encode({"error": message})
        conn.out += (_REPLY.pack(len(reply) + 1, LANE_REFUSED), reply)

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
        wanted = selectors.EVENT_WRITE if out else selectors.EVENT_READ
        if self._sel.get_key(conn.sock).events != wanted:
            self._sel.modify(conn.sock, wanted, conn)


def _int(body: dict, field: str) -> int:
    value = body.get(field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise flight.FlightServerError(f"{field}: expected an integer, got {value!r}")
    return value


def _call(fn, *args):
    """Run a handler; refusals become one-line Flight errors, bugs are logged with traceback."""
    try:
        return fn(*args)
    except (RequestError, UserError, ValueError) as e:
        raise flight.FlightServerError(str(e)) from None
    except flight.FlightError:
        raise
    except Exception as e:  # noqa: BLE001 -- the server must keep serving other requests
        log.exception("plane: internal error in %s", getattr(fn, "__name__", fn))
        raise flight.FlightInternalError(f"internal error: {type(e).__name__}: {e}") from None
