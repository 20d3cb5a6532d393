"""The plane's Flight transport: IPC-only requests, one-line refusals, tokens, retry.

The service behind the server here is a small in-test object: what is under test is the wire,
not planning (tests/dataplane/test_plane*.py run the real plane over it).
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from omniscale.dataplane import wire
from omniscale.dataplane.actions import RequestError
from omniscale.dataplane.auth import is_loopback
from omniscale.dataplane.client import PlaneClient, PlaneError
from omniscale.dataplane.server import PlaneServer
from omniscale.errors import UserError


class EchoService:
    def __init__(self):
        self.commits = []

    def get_plan(self, step, rank):
        if rank > 3:
            raise RequestError(f"rank {rank}: the job has 4 ranks (0..3)")
        return pa.table({"step": [step] * 3, "rank": [rank] * 3, "sample": [0, 1, 2]})

    def commit(self, step, rank=None):
        self.commits.append((step, rank))
        return {"step": step, "rank": rank, "committed": True}

    def status(self):
        return {"sources": [{"name": "text", "target": 0.5, "realized": 0.49}], "ahead": 3}

    def snapshot(self, step=None):
        return {"path": "snapshots/000000008.json", "step": 8 if step is None else step}

    def reload(self, spec):
        raise RequestError(f"{spec}: sources[0].path: 'x' does not exist")

    def audit(self):
        raise RuntimeError("boom")


@pytest.fixture()
def served():
    service = EchoService()
    server = PlaneServer(service, token="s3cret").start()
    yield service, server
    server.stop()


def test_wire_round_trip_and_refuses_garbage():
    record = {"step": 3, "rank": None, "nested": [{"a": 1.5}], "name": "text"}
    assert wire.decode(wire.encode(record)) == record
    with pytest.raises(ValueError, match="not an Arrow IPC record"):
        wire.decode(b"\x80\x04pickle")


def test_calls_round_trip(served):
    service, server = served
    with PlaneClient(server.url, token="s3cret") as client:
        plan = client.get_plan(5, 2)
        assert plan.to_pydict() == {"step": [5] * 3, "rank": [2] * 3, "sample": [0, 1, 2]}
        assert client.commit(5, rank=2) == {"step": 5, "rank": 2, "committed": True}
        assert client.commit(6)["rank"] is None
        assert client.status()["sources"][0]["name"] == "text"
        assert client.snapshot()["step"] == 8
    assert service.commits == [(5, 2), (6, None)]


def test_refusals_are_one_line_and_the_server_keeps_serving(served):
    _, server = served
    client = PlaneClient(server.url, token="s3cret", retry_for=0.5)
    with pytest.raises(PlaneError) as bad_rank:
        client.get_plan(1, 9)
    assert str(bad_rank.value).endswith("rank 9: the job has 4 ranks (0..3)")
    with pytest.raises(PlaneError, match=r"reload: new\.yaml: sources\[0\]\.path"):
        client.reload("new.yaml")
    with pytest.raises(PlaneError, match="internal error: RuntimeError: boom"):
        client.audit()
    for message in (str(bad_rank.value),):
        assert "\n" not in message
    assert client.get_plan(1, 0).num_rows == 3  # still serving


@pytest.mark.parametrize("token", [None, "wrong"])
def test_token_is_required(served, token):
    _, server = served
    with pytest.raises(PlaneError, match="missing or wrong token"):
        PlaneClient(server.url, token=token, retry_for=0.5).status()


def test_non_loopback_needs_a_token():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0")
    with pytest.raises(UserError, match="requires --token"):
        PlaneServer(EchoService(), host="0.0.0.0")


def test_client_gives_up_after_its_retry_budget():
    server = PlaneServer(EchoService()).start()
    url = server.url
    server.stop()
    with pytest.raises(PlaneError, match="failed for 0.3 s"):
        PlaneClient(url, retry_for=0.3).status()


def test_client_rides_through_a_restart_on_the_same_port():
    first = PlaneServer(EchoService()).start()
    port = first.port
    client = PlaneClient(first.url, retry_for=30)
    assert client.get_plan(0, 0).num_rows == 3
    first.stop()
    second = PlaneServer(EchoService(), port=port).start()
    try:
        assert client.get_plan(1, 0).num_rows == 3
    finally:
        second.stop()
