"""The plane's Arrow Flight front: plans by ``do_get`` or the ``plan`` action, the rest by
``do_action``.

The ``plan`` action returns the plan as one Arrow IPC stream in a single result, serialised
once per (step, rank) and cached: a fetch is then one small gRPC message and a dict lookup, about
twice as fast as ``do_get``'s record-batch stream (which stays for generic Flight clients).

Transport only: a :class:`PlaneService` (the data plane itself) does the work. Requests and
replies are Arrow IPC (:mod:`dataplane.wire`). The server binds loopback unless told otherwise,
and binding anything else requires a bearer token that every call must present.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
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
    "report_corrupt": "a planned sample does not decode: quarantine it, get a replacement from "
                      "its source: {step, rank, source, shard, key, reason, epoch}",
}


PLAN_STREAM = b"plans"  # do_exchange command of the plan stream (PlaneClient(stream=True))


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
                 token: str | None = None):
        if not is_loopback(host) and not token:
            raise UserError(f"--host {host}: binding anything but loopback requires --token")
        middleware = {"auth": _TokenCheck(token)} if token else None
        super().__init__(f"grpc+tcp://{host}:{port}", middleware=middleware)
        self.service = service
        shown = f"[{host}]" if ":" in host else host
        self.url = f"grpc+tcp://{shown}:{self.port}"
        self._thread: threading.Thread | None = None
        self._requests: dict[bytes, tuple[int, int]] = {}  # request bytes -> (step, rank)
        self._plans: dict[tuple[int, int], tuple[pa.Table, pa.Buffer]] = {}

    def start(self) -> "PlaneServer":
        """Serve from a daemon thread (the embedded mode); returns self."""
        self._thread = threading.Thread(target=self.serve, name="omniscale-plane", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
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
        returns the very same table object (a re-plan makes a new one)."""
        key = self._requests.get(body)
        if key is None:
            request = _call(wire.decode, body)
            key = _int(request, "step"), _int(request, "rank")
            if len(self._requests) > 1 << 16:
                self._requests.clear()
            self._requests[body] = key
        table = _call(self.service.get_plan, *key)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is table:
            return cached[1]
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        data = sink.getvalue()
        if len(self._plans) > 1 << 16:
            self._plans.clear()
        self._plans[key] = (table, data)
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
