"""The in-process client of an embedded plane answers exactly what the wire answers: two
planes built alike (the plane is deterministic), one driven through ``LocalPlaneClient``, the
other through ``PlaneClient`` over Flight and the plan lane, the same calls in the same order --
the wire is the oracle. Plus which client ``connect`` picks, and what a stopped plane says."""

from __future__ import annotations

import pytest

from omniscale.dataplane import local
from omniscale.dataplane.actions import Reason
from omniscale.dataplane.client import PlaneClient, PlaneError
from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.local import LocalPlaneClient, connect
from omniscale.dataplane.plane import PlaneConfig
from omniscale.errors import UserError
from omniscale.plan import fingerprint

CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=2, snapshot_every=4)


def _outcome(client, url, call):
    """A call's reply, or its refusal as (message without the URL, reason)."""
    try:
        return "ok", call(client)
    except PlaneError as e:
        return "refused", str(e).replace(url, "URL"), e.reason


def _script():
    """Calls to make, each a function of the client; plans are compared as tables."""
    calls = []
    for step in range(6):
        for rank in (0, 1):
            calls.append(lambda c, s=step, r=rank: c.get_plan(s, r).to_pylist())
            calls.append(lambda c, s=step, r=rank: c.get_plan(s, r).schema.metadata)
        calls.append(lambda c, s=step: c.commit_many(
            0, [s], [fingerprint(c.get_plan(s, 0))]))
        calls.append(lambda c, s=step: c.commit(s, 1, fingerprint(c.get_plan(s, 1))))
    calls += [
        lambda c: c.get_plan(-1, 0),  # invalid
        lambda c: c.get_plan(2, 0),  # committed
        lambda c: c.get_plan(400, 0),  # too far ahead
        lambda c: c.get_plan(7, 9),  # unknown rank
        lambda c: c.commit(3, 0, "not-the-plan"),  # repeated commit, wrong print
        lambda c: c.commit_many(0, [7], ["not-the-plan"]),  # a plan that is not the rank's
        lambda c: c.set_costs(-1.0, 0.0),
        lambda c: c.reload("/nonexistent/mix.yaml"),
        lambda c: c.report_stragglers(6, [1], [2.5]),
        lambda c: c.report_suspect(6, [{"source": "text", "shard": "x", "key": "k",
                                        "epoch": 0}], "spike"),
        lambda c: c.audit(),
        lambda c: sorted(c.status()),
    ]
    return calls


def test_local_client_answers_what_the_wire_answers(demo, tmp_path):
    spec = demo / "mix.yaml"
    with start_embedded(spec, tmp_path / "a", CONFIG) as a, \
            start_embedded(spec, tmp_path / "b", CONFIG) as b, PlaneClient(b.url) as wire, \
            PlaneClient(b.url, stream=True) as lane:
        mine = connect(a.url)
        assert isinstance(mine, LocalPlaneClient)
        outcomes = {"ok": 0, "refused": 0}
        for i, call in enumerate(_script()):
            got = _outcome(mine, a.url, call)
            want = _outcome(lane if i % 2 else wire, b.url, call)
            assert got == want, f"call {i}"
            outcomes[got[0]] += 1
        assert outcomes["refused"] >= 7, outcomes  # the refusals were exercised


@pytest.mark.parametrize("error, reason", [(KeyError("boom"), Reason.INTERNAL),
                                           (UserError("bad input"), Reason.REFUSED),
                                           (ValueError("out of range"), Reason.REFUSED)])
def test_other_errors_of_the_plane_map_alike(demo, tmp_path, monkeypatch, error, reason):
    with start_embedded(demo / "mix.yaml", tmp_path, CONFIG) as plane, \
            PlaneClient(plane.url) as wire:
        def broken():
            raise error
        monkeypatch.setattr(plane.plane, "audit", broken)
        got = _outcome(connect(plane.url), plane.url, lambda c: c.audit())
        want = _outcome(wire, plane.url, lambda c: c.audit())
    assert got == want
    assert got[2] == reason and str(error).strip("'") in got[1]


def test_connect_is_local_only_in_the_process_that_serves_the_plane(demo, tmp_path,
                                                                    monkeypatch):
    with start_embedded(demo / "mix.yaml", tmp_path, CONFIG) as plane:
        assert isinstance(connect(plane.url), LocalPlaneClient)
        assert type(connect("grpc://127.0.0.1:1")) is PlaneClient  # not served here
        with monkeypatch.context() as m:  # a forked child sees the registry, not the plane
            m.setattr(local.os, "getpid", lambda: -1)
            assert type(connect(plane.url)) is PlaneClient
        mine = connect(plane.url)
        assert mine.get_plan(0, 0).num_rows > 0
    assert type(connect(plane.url)) is PlaneClient  # stopped: unregistered
    with pytest.raises(PlaneError) as e:
        mine.get_plan(0, 0)
    assert e.value.reason == Reason.UNREACHABLE and "stopped" in str(e.value)
