"""The action registry (``dataplane.actions``) drives the server, both clients and the service
protocol: every action it declares is reachable through ``PlaneClient`` and
``LocalPlaneClient`` with the same answers, a malformed request to any of them is refused in
one line with ``Reason.REFUSED``, ``DataPlane`` implements every action with the request's
parameters, and the requests' bytes are those the clients always sent."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from omniscale.dataplane import server, wire
from omniscale.dataplane.actions import (
    ACTIONS,
    PLAN,
    SERVICE_ACTIONS,
    PlaneService,
    Reason,
    RequestError,
)
from omniscale.dataplane.client import PlaneClient, PlaneError
from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.local import LocalPlaneClient, connect
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.plan import fingerprint

CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=2, snapshot_every=4)
SAMPLE = {"source": "text", "shard": "x", "key": "k", "epoch": 0}
# One call per service action, in this order, on a plane at step 0 (replies compared whole).
EXAMPLES = {
    "plan": lambda c: c.get_plan(0, 1).to_pylist(),
    "commit": lambda c: c.commit(0, 1),  # a plan this plane served rank 1: no plan_fp needed
    "commit_many": lambda c: c.commit_many(0, [0, 1], [fingerprint(c.get_plan(s, 0))
                                                       for s in (0, 1)]),
    "status": lambda c: sorted(c.status()),
    "snapshot": lambda c: c.snapshot(7),  # not the next step: refused
    "reload": lambda c: c.reload("/nonexistent/mix.yaml"),
    "audit": lambda c: c.audit(),
    "costs": lambda c: c.set_costs(-1.0, 0.0),
    "report_corrupt": lambda c: c.report_corrupt(2, 0, "text", "s.tar", "k", "bad"),
    "report_suspect": lambda c: c.report_suspect(2, [SAMPLE], "spike"),
    "stragglers": lambda c: c.report_stragglers(2, [1], [2.5]),
    "speeds": lambda c: c.set_speeds(1, [1.0, 0.5]),  # from the first step no rank was served
    "reports": lambda c: (c.reports("corrupt"), c.reports("suspect")),  # those reported above
}
WRONG = {int: "x", float: "x", str: 5, list: "x"}  # a value of another type, per field type


def _valid(kind):
    """A value ``kind`` (a field's type) accepts: None where it may be left out."""
    if type(None) in getattr(kind, "__args__", ()):
        return None
    return {int: 0, float: 0.5, str: "s"}.get(kind, [])


def _outcome(client, url, call):
    try:
        return "ok", call(client)
    except PlaneError as e:
        return "refused", str(e).replace(url, "URL"), e.reason


def _wrong(kind):
    """A value ``kind`` (a field's type) refuses."""
    for base, value in WRONG.items():
        if base is kind or base in getattr(kind, "__args__", ()) or \
                getattr(kind, "__origin__", None) is base:
            return value
    raise AssertionError(f"no wrong value for {kind}")


@pytest.fixture(scope="module")
def planes(demo, tmp_path_factory):
    """Two planes built alike: ``a`` served in process, ``b`` over the wire."""
    spec, tmp = demo / "mix.yaml", tmp_path_factory.mktemp("actions")
    with start_embedded(spec, tmp / "a", CONFIG) as a, \
            start_embedded(spec, tmp / "b", CONFIG) as b:
        yield a, b


def test_every_action_is_reachable_through_both_clients_alike(planes):
    a, b = planes
    assert set(EXAMPLES) == {action.name for action in SERVICE_ACTIONS}
    mine = connect(a.url)
    assert isinstance(mine, LocalPlaneClient)
    with PlaneClient(b.url) as remote:
        outcomes = {}
        for name, call in EXAMPLES.items():
            got = _outcome(mine, a.url, call)
            assert got == _outcome(remote, b.url, call), name
            outcomes[name] = got[0]
    assert outcomes["plan"] == outcomes["commit_many"] == outcomes["stragglers"] == "ok"
    assert outcomes["speeds"] == "ok"
    assert outcomes["costs"] == outcomes["snapshot"] == "refused"


@pytest.mark.parametrize("action", [a for a in SERVICE_ACTIONS if a.fields],
                         ids=lambda a: a.name)
def test_a_malformed_request_is_refused_in_one_line(planes, action):
    _, b = planes
    valid = {name: _valid(kind) for name, kind, _ in action.fields}
    with PlaneClient(b.url, retry_for=5) as client:
        for name, kind, _ in action.fields:
            body = valid | {name: _wrong(kind)}
            with pytest.raises(PlaneError) as refused:
                client._action(action.name, body)
            together = getattr(action.request, "together", None)
            expected = together.message if together and name in together.fields else \
                f"{name}: expected"
            assert refused.value.reason == Reason.REFUSED, (action.name, name)
            assert f"{action.name}: {expected}" in str(refused.value)
            assert "\n" not in str(refused.value)
            with pytest.raises(RequestError, match="^" + re.escape(expected)):  # in process too
                action.from_body(body)


def test_every_action_has_a_plane_method_with_the_requests_parameters():
    members = {name for name in vars(PlaneService) if not name.startswith("_")}
    assert members >= {action.method for action in SERVICE_ACTIONS}
    for action in SERVICE_ACTIONS:
        fields = [name for name, _, _ in action.fields]
        for implementation in (DataPlane, PlaneService, PlaneClient, LocalPlaneClient):
            method = getattr(implementation, action.method)
            assert list(inspect.signature(method).parameters)[1:] == fields, \
                (implementation.__name__, action.name)
    assert issubclass(DataPlane, PlaneService)  # runtime-checkable: every member present


def test_the_server_dispatches_from_the_registry_without_fallbacks():
    tree = ast.parse(Path(server.__file__).read_text(encoding="utf-8"))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    assert not [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "getattr"
                and len(c.args) == 3 and "service" in ast.unparse(c.args[0])]
    named = {c.value for c in ast.walk(tree) if isinstance(c, ast.Constant)}
    assert not named & {a.name for a in ACTIONS.values() if a.name != "lane"} - {"plan"}


def test_requests_are_the_bytes_the_clients_always_sent():
    assert wire.encode(PLAN.to_body(PLAN.from_call(3, 1))) == wire.plan_request(3, 1)
    many = ACTIONS["commit_many"]
    assert wire.encode(many.to_body(many.from_call(1, [4, 5], ["a", None]))) == \
        wire.encode({"rank": 1, "steps": [4, 5], "plan_fps": ["a", None]})
    commit = ACTIONS["commit"]
    assert commit.to_body(commit.from_call(6)) == {"step": 6}  # None fields left out
    assert commit.arguments(commit.from_call(6, 2)) == (6, 2)  # trailing Nones not passed
    assert ACTIONS["status"].to_body(ACTIONS["status"].from_call()) == {}
