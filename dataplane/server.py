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
no gRPC and no thread hand-off per fetch. It binds where the Flight server binds, asks for the
same token (the first frame of a connection), and is TLS when Flight is (same certificate);
refusals are the same one-line messages. Everything else stays on Flight. The lane itself, its
frames and its limits (connection cap, hello and idle time-outs) are in :mod:`dataplane.lane`.

Transport only: a :class:`PlaneService` (the data plane itself) does the work. Every action is
declared in :mod:`dataplane.actions`, and ``do_action`` serves them all alike from there:
decode the request, check it, call the method the action names, encode the reply. Requests and
replies are Arrow IPC (:mod:`dataplane.wire`). The server binds loopback unless told otherwise;
binding anything else requires a bearer token that every call must present, and TLS
(``tls_cert``/``tls_key``: ``grpc+tls://``) unless ``insecure``. Flight methods the plane does
not serve answer a one-line refusal.
"""

from __future__ import annotations

import hmac
import logging
import ssl
import threading

import pyarrow as pa
import pyarrow.flight as flight

from omniscale.dataplane import wire
from omniscale.dataplane.actions import (
    ACTIONS,
    PLAN,
    PLAN_STREAM,
    PlaneService,
    Reason,
    Reply,
    refusal,
)
from omniscale.dataplane.auth import check_bind, read_pem
from omniscale.dataplane.lane import LaneLimits, PlanLane
from omniscale.errors import UserError

__all__ = ["PlaneServer"]

log = logging.getLogger(__name__)

PLAN_CACHE_STEPS = 32  # steps whose served plans' IPC bytes are kept
_NO_PLANS: dict = {}


class _Gate(flight.ServerMiddlewareFactory):
    """Runs before every call's handler: checks the token (if the server has one), then refuses
    the Flight methods the plane does not serve -- here, because pyarrow wraps what a
    ``get_schema`` handler raises, a FlightError included, with its traceback."""

    UNSERVED = {flight.FlightMethod.LIST_FLIGHTS: "list_flights",
                flight.FlightMethod.GET_FLIGHT_INFO: "get_flight_info",
                flight.FlightMethod.GET_SCHEMA: "get_schema",
                flight.FlightMethod.DO_PUT: "do_put"}

    def __init__(self, token: str | None):
        super().__init__()
        self._expected = None if token is None else f"Bearer {token}".encode()

    def start_call(self, info, headers):
        if self._expected is not None:
            given = (headers.get("authorization") or [""])[0]
            given = given.encode() if isinstance(given, str) else given
            if not hmac.compare_digest(given, self._expected):
                raise flight.FlightUnauthenticatedError("missing or wrong token")
        name = self.UNSERVED.get(info.method)
        if name is not None:
            raise _not_served(name)
        return None


class PlaneServer(flight.FlightServerBase):
    """Serves one :class:`PlaneService`; ``url`` is where clients connect."""

    def __init__(self, service: PlaneService, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, lane: bool = True, *, tls_cert: str | None = None,
                 tls_key: str | None = None, insecure: bool = False,
                 lane_limits: LaneLimits | None = None):
        """``lane``: also open the plan lane (a second, ephemeral port on ``host``), within
        ``lane_limits``. ``tls_cert``/``tls_key`` (PEM files): serve ``grpc+tls://``, and the
        lane over TLS with the same pair. Off loopback a token is required, and TLS unless
        ``insecure`` (see :func:`dataplane.auth.check_bind`)."""
        if (tls_cert is None) != (tls_key is None):
            raise UserError("--tls-cert and --tls-key go together (a certificate and its key)")
        check_bind(host, token, tls_cert is not None, insecure)
        middleware = {"gate": _Gate(token or None)}
        shown = f"[{host}]" if ":" in host else host  # an IPv6 address goes in brackets
        scheme, options, context = "grpc+tcp", {}, None
        if tls_cert is not None:
            pair = read_pem(tls_cert, "--tls-cert"), read_pem(tls_key, "--tls-key")
            context = _server_context(tls_cert, tls_key)
            scheme, options = "grpc+tls", {"tls_certificates": [flight.CertKeyPair(*pair)]}
        super().__init__(f"{scheme}://{shown}:{port}", middleware=middleware, **options)
        self.service = service
        self.url = f"{scheme}://{shown}:{self.port}"
        self._thread: threading.Thread | None = None
        # step -> rank -> (the table the service returned, its IPC bytes)
        self._plans: dict[int, dict[int, tuple[pa.Table, pa.Buffer]]] = {}
        self._plans_lock = threading.Lock()
        self.lane: PlanLane | None = PlanLane(self._plan_ipc, host, token, context,
                                              lane_limits) if lane else None

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
        request = _call(PLAN.from_body, _call(wire.decode, ticket.ticket))
        return flight.RecordBatchStream(_call(PLAN.call, self.service, request, what=PLAN.method))

    def _plan_ipc(self, body: bytes) -> pa.Buffer:
        """The plan a request names, as IPC bytes; the bytes are reused while the service
        returns the very same table object (a re-plan makes a new one). The cache keeps the
        plans of the latest PLAN_CACHE_STEPS steps served (a job serves a few windows ahead of
        its trainers and never an already committed step again)."""
        key = wire.read_plan_request(body)  # what PlaneClient sends, without decoding it
        if key is None:
            request = _call(PLAN.from_body, _call(wire.decode, body))
            key = request.step, request.rank
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
                f"do_exchange: unknown command {descriptor.command!r:.60} (the plane serves "
                f"only {PLAN_STREAM!r})")
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
        """Any action of the registry: decode its request, check it, call the method it names
        (the service's, or this server's own for ``lane``), encode the reply."""
        served = ACTIONS.get(action.type)
        if served is None:
            raise flight.FlightServerError(
                f"unknown action {action.type!r} (one of {', '.join(sorted(ACTIONS))})")
        if served.reply is Reply.PLAN:  # the plan's IPC bytes, cached per (step, rank)
            return [flight.Result(self._plan_ipc(action.body.to_pybytes()))]
        body = _call(wire.decode, action.body) if action.body.size else {}
        request = _call(served.from_body, body)
        reply = _call(served.call, self if served.by_server else self.service, request,
                      what=served.method)
        return [flight.Result(pa.py_buffer(wire.encode(reply)))]

    def lane_port(self) -> dict:
        """The ``lane`` action: the plan lane's port, 0 when it does not serve."""
        return {"port": self.lane.port if self.lane is not None and self.lane.running else 0}

    def list_actions(self, context):
        return [(a.name, a.help) for a in ACTIONS.values()]

    # Flight methods the plane has no use for: a one-line refusal (from _Gate, before
    # these run), not pyarrow's NotImplementedError, whose traceback would reach the client.
    def list_flights(self, context, criteria):
        raise _not_served("list_flights")

    def get_flight_info(self, context, descriptor):
        raise _not_served("get_flight_info")

    def get_schema(self, context, descriptor):
        raise _not_served("get_schema")

    def do_put(self, context, descriptor, reader, writer):
        raise _not_served("do_put")


def _not_served(method: str) -> flight.FlightServerError:
    return flight.FlightServerError(f"{method}: not served by the OmniScale plane (use the plan "
                                    f"action or do_get; list_actions names the actions)")


def _server_context(cert: str, key: str) -> ssl.SSLContext:
    """The lane's TLS context: the Flight port's certificate and key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise UserError(f"--tls-cert {cert} / --tls-key {key}: not a certificate and its key "
                        f"({getattr(e, 'reason', None) or e})") from None
    return context


def _call(fn, *args, what: str | None = None):
    """Run a handler; refusals become one-line Flight errors carrying their Reason (as
    ``extra_info``), bugs are logged with traceback."""
    try:
        return fn(*args)
    except flight.FlightError:
        raise
    except Exception as e:  # noqa: BLE001 -- the server must keep serving other requests
        reason = refusal(e)
        if reason is not None:
            raise flight.FlightServerError(str(e), extra_info=reason.encode()) from None
        log.exception("plane: internal error in %s", what or getattr(fn, "__name__", fn))
        raise flight.FlightInternalError(f"internal error: {type(e).__name__}: {e}",
                                         extra_info=Reason.INTERNAL.encode()) from None
