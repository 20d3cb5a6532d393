"""Every action of the plane, declared once: its name on the wire, its one-line help, its
request (a frozen dataclass: typed fields, in wire order, with defaults), its reply, the checks
a request must pass, and where it travels. Everything else is derived from :data:`ACTIONS`:

- the Flight server (:mod:`dataplane.server`) decodes a request, checks it here and calls the
  service method the action names -- one generic path, no per-action code;
- ``PlaneClient`` (over the wire) and ``LocalPlaneClient`` (in process) get one method per
  action from :func:`client_methods`, with the request's fields as parameters;
- :data:`PlaneService`, the protocol a plane implements, lists every service action's method.

A request's fields are the service method's parameters, in the same order (a test holds
``DataPlane`` to it). The checks here are what a request must satisfy to reach the service at
all -- types and presence, refused with :attr:`Reason.REFUSED`; what depends on the plane's
state (a committed step, an unknown rank) or is a range every caller must respect (costs,
stragglers) is the service's to refuse, with finer reasons, the same in process as remote.
The wire encoding stays :mod:`dataplane.wire`'s one-row Arrow IPC record: a field left None is
left out of it, so a request's bytes are those the clients always sent.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from dataclasses import MISSING, dataclass, fields
from enum import Enum, StrEnum
from typing import Protocol, Union, runtime_checkable

from omniscale.errors import UserError

__all__ = ["ACTIONS", "MAX_COST", "PLAN_STREAM", "REPORT_KINDS", "Action", "Lane",
           "PlaneService", "Reason", "Reply", "RequestError", "check_costs", "check_speeds",
           "check_stragglers",
           "client_methods", "cost_in_range", "refusal", "suspect_sample"]


# -- refusals ---------------------------------------------------------------------------------
class Reason(StrEnum):
    """Why a request failed, for code to branch on (never on the message's words). The plane
    sends it beside its one-line message: as the Flight error's ``extra_info``, in a lane
    refusal's ``reason`` field; the client (PlaneError.reason) adds UNREACHABLE, and without
    a reason on the wire goes by the error's type (UNAUTHENTICATED, INTERNAL, else REFUSED)."""

    REFUSED = "refused"  # nothing more specific: a malformed request, a service's ValueError
    EXHAUSTED = "exhausted"  # past the mixture's last step
    TOO_FAR_AHEAD = "too_far_ahead"  # not planned until earlier steps commit: ask again later
    COMMITTED = "committed"  # the step is already committed
    RANK_COMMITTED = "rank_committed"  # this rank's share of the step is already committed
    REPLANNED = "replanned"  # what was trained is no longer the step's plan: fetch it again
    NOT_SERVED = "not_served"  # a commit without plan_fp of a plan this rank never fetched
    UNKNOWN_RANK = "unknown_rank"  # the rank is outside the step's ranks
    UNKNOWN_SAMPLE = "unknown_sample"  # a corrupt report of a sample not in the rank's plan
    INVALID = "invalid"  # a value out of range: a negative step, costs, a snapshot step …
    SPEC = "spec"  # a reload's spec: unreadable, invalid, outside --spec-root, or incompatible
    UNPLANNABLE = "unplannable"  # a change (reload, costs) the next window does not plan with
    UNREACHABLE = "unreachable"  # the plane did not answer within the client's retry budget
    UNAUTHENTICATED = "unauthenticated"  # a missing or wrong token
    INTERNAL = "internal"  # a bug in the plane (its log has the traceback)


class RequestError(UserError):
    """A request the plane refuses (unknown rank, step already committed, bad spec …);
    ``reason`` says which kind of refusal it is."""

    def __init__(self, message: str, reason: Reason = Reason.REFUSED):
        super().__init__(message)
        self.reason = Reason(reason)

    def __reduce__(self):
        return type(self), (str(self), self.reason)


def refusal(e: Exception) -> Reason | None:
    """The reason a handler's exception refuses its request with; None for a bug. The server
    and the in-process client answer alike through this."""
    if isinstance(e, RequestError):
        return e.reason
    if isinstance(e, (UserError, ValueError)):
        return Reason.REFUSED
    return None


# -- ranges every caller of the service must respect (the service applies them) --------------
MAX_COST = 1e12  # cost coefficients above this overflow the planner's sums long before use


def cost_in_range(value) -> bool:
    """A cost coefficient the planner can use: a finite number in [0, MAX_COST] (a refit's,
    ``set_costs``, or ``plane serve --cost-linear/--cost-quadratic``)."""
    return isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= MAX_COST


def check_costs(linear: float, quadratic: float) -> None:
    if not all(cost_in_range(v) for v in (linear, quadratic)) or not any((linear, quadratic)):
        raise RequestError(f"costs: linear and quadratic must be finite, in [0, {MAX_COST:g}] "
                           f"and not both 0, got {linear!r}, {quadratic!r}", Reason.INVALID)


def check_stragglers(step: int, ranks: list, slowdown: list) -> None:
    if step < 0 or len(ranks) != len(slowdown) or len(set(ranks)) != len(ranks) \
            or any(r < 0 for r in ranks) or not all(math.isfinite(v) and v > 0 for v in slowdown):
        raise RequestError(f"stragglers: step >= 0, distinct ranks >= 0 and as many finite "
                           f"slowdowns > 0, got step {step}, ranks {ranks!r}, slowdown "
                           f"{slowdown!r}"[:500], Reason.INVALID)


MAX_SPEED_RATIO = 100.0  # a rank 100x slower than the fastest is broken, not slow: refuse


def check_speeds(step: int, speeds: list) -> None:
    if step < 0 or not all(math.isfinite(v) and v > 0 for v in speeds) or \
            (speeds and max(speeds) > MAX_SPEED_RATIO * min(speeds)):
        raise RequestError(f"speeds: step >= 0 and one finite speed > 0 per data rank (the "
                           f"slowest at least 1/{MAX_SPEED_RATIO:g} of the fastest; [] for "
                           f"equal ranks), got step {step}, speeds {speeds!r}"[:500],
                           Reason.INVALID)


def suspect_sample(sample) -> tuple[str, str, str, int]:
    """A reported sample as (source, shard, key, epoch); a malformed one is refused."""
    try:
        return (str(sample["source"]), str(sample["shard"]), str(sample["key"]),
                int(sample["epoch"]))
    except (TypeError, KeyError, ValueError):
        raise RequestError(f"report_suspect: a sample must be {{source, shard, key, epoch}}, "
                           f"got {str(sample)[:200]}", Reason.INVALID) from None


# -- requests: fields in wire order = the service method's parameters ---------------------------
@dataclass(frozen=True)
class Together:
    """Fields checked first and refused under one message (the message clients have always
    seen for them); ``nonempty``: an empty value is refused too."""

    fields: tuple[str, ...]
    message: str
    nonempty: bool = False


@dataclass(frozen=True)
class PlanRequest:
    step: int
    rank: int


@dataclass(frozen=True)
class CommitRequest:
    step: int
    rank: int | None = None
    plan_fp: str | None = None


@dataclass(frozen=True)
class CommitManyRequest:
    rank: int
    steps: list[int]
    plan_fps: list[str | None]
    together = Together(("steps", "plan_fps"), "commit_many: 'steps' must be a list of ints "
                        "and 'plan_fps' a list of strings")


@dataclass(frozen=True)
class NoRequest:
    """The request of an action that takes no arguments (an empty body)."""


@dataclass(frozen=True)
class SnapshotRequest:
    step: int | None = None


@dataclass(frozen=True)
class ReloadRequest:
    spec: str
    together = Together(("spec",), "reload: 'spec' (a path) is required", nonempty=True)


@dataclass(frozen=True)
class CostsRequest:
    linear: float
    quadratic: float
    together = Together(("linear", "quadratic"), "costs: 'linear' and 'quadratic' must be numbers")


@dataclass(frozen=True)
class CorruptRequest:
    step: int
    rank: int
    source: str
    shard: str
    key: str
    reason: str
    epoch: int = 0  # the client's default; on the wire it is always sent (and required)
    together = Together(("source", "shard", "key", "reason"),
                        "report_corrupt: source, shard, key, reason must be strings")


@dataclass(frozen=True)
class SuspectRequest:
    step: int
    samples: list  # of {source, shard, key, epoch}: the service checks each (Reason.INVALID)
    reason: str
    together = Together(("samples", "reason"), "report_suspect: 'samples' (a list) and "
                        "'reason' (a string) are required")


@dataclass(frozen=True)
class ReportsRequest:
    kind: str  # one of REPORT_KINDS


REPORT_KINDS = ("corrupt", "suspect")  # the log's records the ``reports`` action lists


@dataclass(frozen=True)
class StragglersRequest:
    step: int
    ranks: list[int]
    slowdown: list[float]
    together = Together(("ranks", "slowdown"), "stragglers: 'ranks' (a list of integers) and "
                        "'slowdown' (a list of numbers) are required")


@dataclass(frozen=True)
class SpeedsRequest:
    step: int
    speeds: list[float]
    from_step: int | None = None  # the first step no rank started (the trainer vouches)


# -- the field types a request may use ---------------------------------------------------------
_KIND = {int: "an integer", float: "a number", str: "a string", list: "a list"}


def _conforms(value, kind) -> bool:
    """Whether a received value is of ``kind`` (bool is no number here, as in JSON)."""
    if kind is type(None):
        return value is None
    if typing.get_origin(kind) in (Union, types.UnionType):
        return any(_conforms(value, k) for k in typing.get_args(kind))
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)  # str, list (free-form items)


def _received(value, kind):
    """A conforming value as the service gets it: numbers of a float field as floats."""
    if kind is float:
        return float(value)
    if typing.get_origin(kind) is list and typing.get_args(kind)[0] is float:
        return [float(v) for v in value]
    return value


def _sent(value, kind):
    """A caller's argument as the clients send it: converted to the field's type, as they
    always did (``int(step)``), so a numpy integer or a Path goes as an int or a str."""
    if value is None:
        return None
    if typing.get_origin(kind) in (Union, types.UnionType):
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        return [_sent(v, item) for v in value]
    return list(value) if kind is list else kind(value)


# -- actions -----------------------------------------------------------------------------------
class Reply(Enum):
    RECORD = "record"  # a dict as a one-row Arrow IPC record (dataplane.wire)
    PLAN = "plan"  # a plan table as an Arrow IPC stream, cached per (step, rank) by the server


class Lane(Enum):
    """Where a request reaches the server."""

    ACTION = "Flight do_action"
    DO_GET = "Flight do_get (the ticket: the request)"
    EXCHANGE = "Flight do_exchange, command PLAN_STREAM (app metadata: the request)"
    PLAN_LANE = "the plan lane's TCP frames (dataplane.lane)"


PLAN_STREAM = b"plans"  # do_exchange command of the plan stream (PlaneClient(stream=True))


@dataclass(frozen=True)
class Action:
    """One action; see the module docstring."""

    name: str  # on the wire (the Flight action's type)
    method: str  # the method serving it, and the clients' method
    help: str  # one line (list_actions)
    request: type  # a frozen dataclass; its fields are the method's parameters
    replies: str  # the reply's shape, for readers
    reply: Reply = Reply.RECORD
    lanes: tuple[Lane, ...] = (Lane.ACTION,)
    by_server: bool = False  # the server answers it itself (no service method, no client one)
    client_reply: typing.Callable | None = None  # the clients' value from the reply record

    @property
    def fields(self) -> tuple:
        """(name, type, default) of each request field, in order."""
        return _FIELDS[self.request]

    @property
    def free_form(self) -> bool:
        """Whether a field holds free-form records (a bare ``list``, such as a suspect's
        samples), which only the wire's encoding brings to the types the service gets."""
        return any(kind is list for _, kind, _ in self.fields)

    def from_call(self, *args, **kwargs):
        """The request a client sends for a call of its method (arguments as the signature
        binds them, converted to the fields' types)."""
        given = self.request(*args, **kwargs)
        return self.request(*(_sent(getattr(given, name), kind)
                              for name, kind, _ in self.fields))

    def to_body(self, request) -> dict:
        """The wire record of ``request``: its fields in order, those left None left out."""
        return {name: value for name, _, _ in self.fields
                if (value := getattr(request, name)) is not None}

    def from_body(self, body: dict):
        """The request a received record makes, checked: the fields ``together`` first, then
        each in order; a missing field is None, refused unless its type allows it. A refusal is
        a RequestError with Reason.REFUSED."""
        together = getattr(self.request, "together", None)
        if together is not None and not all(
                _conforms(body.get(name), kind) and (body.get(name) or not together.nonempty)
                for name, kind, _ in self.fields if name in together.fields):
            raise RequestError(together.message)
        for name, kind, _ in self.fields:
            value = body.get(name)
            if not _conforms(value, kind):
                raise RequestError(f"{name}: expected {_kind_name(kind)}, got {value!r}")
        return self.request(*(_received(body.get(name), kind) for name, kind, _ in self.fields))

    def arguments(self, request) -> tuple:
        """The service method's positional arguments, trailing ones left None not passed (so a
        service may leave out optional parameters it has no use for)."""
        values = [getattr(request, name) for name, _, _ in self.fields]
        while values and values[-1] is None:
            values.pop()
        return tuple(values)

    def call(self, target, request):
        """Run ``request`` on ``target`` (the service, or the server for its own actions)."""
        return getattr(target, self.method)(*self.arguments(request))

    def label(self, request) -> str:
        """What a refusal names: the action, or for a plan the (step, rank) asked -- a loader
        has several plans in flight."""
        if self.reply is Reply.PLAN:
            given = ", ".join(f"{name}={getattr(request, name)}" for name, _, _ in self.fields)
            return f"{self.method}({given})"
        return self.name

    def signature(self) -> inspect.Signature:
        """The method's signature (self first): the request's fields and defaults."""
        params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        params += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                     default=default, annotation=kind)
                   for name, kind, default in self.fields]
        return inspect.Signature(params)


def _kind_name(kind) -> str:
    if typing.get_origin(kind) in (Union, types.UnionType):
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    return _KIND.get(typing.get_origin(kind) or kind, str(kind))


def _fields_of(request: type) -> tuple:
    """(name, type, default) per field; the default is inspect's ``empty`` when there is none."""
    hints = typing.get_type_hints(request)
    return tuple((f.name, hints[f.name],
                  inspect.Parameter.empty if f.default is MISSING else f.default)
                 for f in fields(request))


def _replacement(reply: dict):
    """report_corrupt's replacement: a SampleRef, or None when the source had none left."""
    from omniscale.dataplane.corrupt import ref_from_json

    return ref_from_json(reply.get("replacement") or "")


def _records(reply: dict) -> list[dict]:
    """reports' records (an empty list crosses the wire as None)."""
    return list(reply.get("records") or [])


ACTIONS: dict[str, Action] = {a.name: a for a in (
    Action("plan", "get_plan", "a rank's plan as an Arrow IPC stream (what do_get serves): "
           "{step, rank}", PlanRequest, "the rank's plan table", Reply.PLAN,
           (Lane.ACTION, Lane.DO_GET, Lane.EXCHANGE, Lane.PLAN_LANE)),
    Action("commit", "commit", "mark a step (or one rank's share of it) as trained: {step, "
           "rank?, plan_fp?}", CommitRequest,
           "{step, committed, next_step} or {step, committed: false, ranks, dp}; repeated?"),
    Action("commit_many", "commit_many", "one rank's commits of several steps, in order, "
           "durable together: {rank, steps: [int], plan_fps: [str]}", CommitManyRequest,
           "{next_step, committed: [bool per step]}"),
    Action("status", "status", "mixture, progress, balance and clients: {}", NoRequest,
           "dataplane.status.plane_status's record"),
    Action("snapshot", "snapshot", "write a snapshot now: {step?}", SnapshotRequest,
           "{step, path}"),
    Action("reload", "reload", "apply a new mixing spec at the next window boundary: {spec}",
           ReloadRequest, "{applies_at_step, spec}"),
    Action("audit", "audit", "samples planned, committed, duplicated and missing per epoch "
           "and source: {}", NoRequest, "dataplane.audit.audit_state_dir's record"),
    Action("costs", "set_costs", "a refitted cost model (c = linear·L + quadratic·L²) for the "
           "windows no rank has seen: {linear, quadratic}", CostsRequest,
           "{applies_at_step}"),
    Action("report_corrupt", "report_corrupt", "a planned sample does not decode: quarantine "
           "it, get a replacement from its source: {step, rank, source, shard, key, reason, "
           "epoch}", CorruptRequest, "{step, source, key, replacement: a ref as JSON or ''}; "
           "clients return the replacement SampleRef (None: none)",
           client_reply=_replacement),
    Action("report_suspect", "report_suspect", "the trainer did not apply a step (a "
           "non-finite or spiking loss): its samples are suspect, quarantined from later "
           "epochs: {step, samples: [{source, shard, key, epoch}], reason}", SuspectRequest,
           "{step, samples: int}"),
    Action("stragglers", "report_stragglers", "the data ranks the trainer finds computing "
           "much slower than planned, as of a step (kept in memory for status, not logged): "
           "{step, ranks: [int], slowdown: [float]}", StragglersRequest, "{step, ranks: int}"),
    Action("speeds", "set_speeds", "the data ranks' measured relative speeds as of a step "
           "(the trainer's honest compute clock): plans from the first step no rank has been "
           "served -- or from from_step, the first no rank started, when the trainer vouches "
           "for it -- give each rank work in proportion; logged: {step, speeds: [float] "
           "([] for equal), from_step: int?}", SpeedsRequest, "{applies_at_step, speeds}"),
    Action("reports", "reports", "every record of one kind of report in the plane's log, read "
           "by the plane (what a launcher lists after a run): {kind: corrupt|suspect}",
           ReportsRequest, "{kind, records: [the log's records]}; clients return the records",
           client_reply=_records),
    Action("lane", "lane_port", "the TCP port of the plan lane (plan fetches without gRPC; see "
           "dataplane.lane): {} -> {port} (0: no lane)", NoRequest, "{port}", by_server=True),
)}
_FIELDS = {a.request: _fields_of(a.request) for a in ACTIONS.values()}
PLAN = ACTIONS["plan"]  # the hot path: do_get, the exchange stream and the lane serve it too
SERVICE_ACTIONS = tuple(a for a in ACTIONS.values() if not a.by_server)


# -- what the registry generates ----------------------------------------------------------------
def _method(action: Action, body):
    """A function named and signed as ``action``'s method, doing ``body(self, action, request)``
    (or nothing, for a protocol's member)."""
    def method(self, *args, **kwargs):
        return body(self, action, action.from_call(*args, **kwargs))
    method.__name__ = method.__qualname__ = action.method
    method.__doc__ = f"The ``{action.name}`` action: {action.help}; replies {action.replies}."
    method.__signature__ = action.signature()
    return method


def client_methods(cls: type) -> type:
    """Class decorator: a method per service action on a client whose ``_invoke(action,
    request)`` runs one -- the call path the whole client shares."""
    for action in SERVICE_ACTIONS:
        if action.method in vars(cls):
            raise TypeError(f"{cls.__name__}.{action.method}: defined by the action registry")
        setattr(cls, action.method, _method(action, lambda self, a, r: self._invoke(a, r)))
    return cls


def _service_protocol() -> type:
    namespace = {a.method: _method(a, lambda self, a, r: ...) for a in SERVICE_ACTIONS}
    namespace["__doc__"] = ("What a plane serves: a method per action of the registry, its "
                            "parameters the request's fields (DataPlane implements it).")
    namespace["__module__"] = __name__
    return runtime_checkable(types.new_class("PlaneService", (Protocol,),
                                             exec_body=lambda ns: ns.update(namespace)))


PlaneService = _service_protocol()
