"""The plan lane (plan fetches over plain TCP, ``PlaneClient(stream=True)``) and the Flight
exchange stream it replaces: same plans and same one-line refusals as the ``plan`` action,
tokens, malformed frames, timeouts, restarts, and the fallbacks when there is no lane."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pyarrow as pa
import pytest

from omniscale.dataplane import wire
from omniscale.dataplane.actions import RequestError
from omniscale.dataplane.client import PlaneClient, PlaneError, _lane_reply
from omniscale.dataplane.lane import LANE_OK, LANE_REFUSED, lane_frame
from omniscale.dataplane.server import PlaneServer


class PlanService:
    """Plans as small tables; ``delay`` makes get_plan slow (a plane busy planning)."""

    def __init__(self):
        self.delay = 0.0
        self.calls = self.returned = 0
        self.idle = threading.Condition()  # notified as each call returns

    def get_plan(self, step, rank):
        with self.idle:
            self.calls += 1
        try:
            return self._plan(step, rank)
        finally:
            with self.idle:
                self.returned += 1
                self.idle.notify_all()

    def _plan(self, step, rank):
        if self.delay:
            time.sleep(self.delay)  # the slow plane itself, not a synchronisation
        if rank > 3:
            raise RequestError(f"rank {rank}: the job has 4 ranks (0..3)")
        if step == 666:
            raise RuntimeError("boom")
        table = pa.table({"step": [step] * 3, "rank": [rank] * 3, "sample": [0, 1, 2]})
        return table.replace_schema_metadata({b"omniscale": f'{{"step": {step}}}'.encode()})

    def status(self):
        return {"ahead": 3}


@pytest.fixture()
def served():
    service = PlanService()
    server = PlaneServer(service, token="s3cret").start()
    yield service, server
    server.stop()


def raw_lane(server: PlaneServer, token: str | None = "s3cret") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.lane.port), timeout=10)
    if token is not None:
        sock.sendall(lane_frame(wire.encode({"token": token})))
        assert _lane_reply(sock)[0] == LANE_OK
    return sock


def test_plan_request_bytes_are_encode_bytes():
    for step, rank in ((0, 0), (7, 3), (-1, 2), (1 << 50, 1023)):
        data = wire.plan_request(step, rank)
        assert data == wire.encode({"step": step, "rank": rank})
        assert wire.read_plan_request(data) == (step, rank)
        assert wire.decode(data) == {"step": step, "rank": rank}
    for other in ({"rank": 1, "step": 2}, {"step": 1, "rank": 2, "more": 3}, {"step": 1}):
        assert wire.read_plan_request(wire.encode(other)) is None
    assert wire.read_plan_request(b"\x80\x04pickle") is None


def test_lane_serves_what_the_action_serves(served):
    _, server = served
    with PlaneClient(server.url, token="s3cret", stream=True) as lane, \
            PlaneClient(server.url, token="s3cret") as action:
        for step, rank in ((0, 0), (5, 2), (5, 3), (0, 0)):
            got = lane.get_plan(step, rank)
            assert got.equals(action.get_plan(step, rank), check_metadata=True)
            assert got.schema.metadata == {b"omniscale": f'{{"step": {step}}}'.encode()}
        assert lane._lane is not None and lane._stream is None  # the lane, not gRPC
        assert lane.status() == {"ahead": 3}  # everything else still goes over Flight


def test_lane_refusals_are_the_actions_one_line_messages(served):
    _, server = served
    with PlaneClient(server.url, token="s3cret", stream=True, retry_for=0.5) as client:
        assert client.get_plan(1, 0).num_rows == 3
        lane = client._lane
        with pytest.raises(PlaneError) as bad_rank:
            client.get_plan(1, 9)
        assert str(bad_rank.value).endswith("get_plan(step=1, rank=9): rank 9: the job has 4 "
                                            "ranks (0..3)")
        with pytest.raises(PlaneError, match="internal error: RuntimeError: boom"):
            client.get_plan(666, 0)
        assert client.get_plan(2, 1).num_rows == 3
        assert client._lane is lane  # a refusal keeps the connection


@pytest.mark.parametrize("token", [None, "wrong"])
def test_lane_needs_the_token(served, token):
    _, server = served
    with pytest.raises(PlaneError, match="missing or wrong token"):
        PlaneClient(server.url, token=token, stream=True, retry_for=0.5).get_plan(0, 0)
    sock = raw_lane(server, token=None)  # straight to the lane port, past Flight's check
    sock.sendall(lane_frame(wire.encode({"token": token or ""})))
    status, data = _lane_reply(sock)
    assert status == LANE_REFUSED and wire.decode(bytes(data)) == {
        "error": "missing or wrong token"}
    assert sock.recv(1) == b""  # and closed
    sock.close()


def test_lane_survives_malformed_and_pipelined_frames(served):
    service, server = served
    sock = raw_lane(server)
    sock.sendall(lane_frame(b"\x80\x04pickle"))  # not Arrow IPC: refused, connection kept
    status, data = _lane_reply(sock)
    assert status == LANE_REFUSED and "not an Arrow IPC record" in wire.decode(bytes(data))[
        "error"]
    sock.sendall(lane_frame(wire.plan_request(1, 1)) + lane_frame(wire.plan_request(2, 2)))
    replies = b""
    while len(replies) < 2:  # two replies, in order (read by hand: _lane_reply wants one)
        replies += sock.recv(1 << 16)
        frames, rest = [], replies
        while len(rest) >= 4 and len(rest) >= 4 + struct.unpack_from("<I", rest)[0]:
            n = struct.unpack_from("<I", rest)[0]
            frames.append(rest[4:4 + n])
            rest = rest[4 + n:]
        if len(frames) == 2:
            break
    plans = [pa.ipc.open_stream(f[1:]).read_all() for f in frames]
    assert [p.column("step")[0].as_py() for p in plans] == [1, 2]
    big = raw_lane(server)
    big.sendall(struct.pack("<I", 1 << 30))  # a frame no request can be: dropped
    assert big.recv(1) == b""
    big.close()
    calls = service.calls
    with PlaneClient(server.url, token="s3cret", stream=True) as client:
        assert client.get_plan(3, 3).num_rows == 3  # still serving
    assert service.calls == calls + 1
    sock.close()


def test_lane_times_out_and_starts_afresh(served):
    service, server = served
    client = PlaneClient(server.url, token="s3cret", stream=True, timeout=0.3, retry_for=0.5)
    assert client.get_plan(0, 0).num_rows == 3
    service.delay = 0.6
    with pytest.raises(PlaneError, match="failed for 0.5 s: plan lane: no reply in 0.3 s"):
        client.get_plan(1, 1)
    service.delay = 0.0
    with service.idle:  # the late replies are answered, on connections the client closed
        assert service.idle.wait_for(lambda: service.returned == service.calls, timeout=30)
    got = client.get_plan(2, 2)  # not a late reply to an earlier request
    assert got.column("step")[0].as_py() == 2 and got.column("rank")[0].as_py() == 2
    client.close()


def test_lane_rides_through_a_restart_on_the_same_port():
    first = PlaneServer(PlanService()).start()
    port = first.port
    client = PlaneClient(first.url, stream=True, retry_for=30)
    assert client.get_plan(0, 0).num_rows == 3
    first.stop()
    second = PlaneServer(PlanService(), port=port).start()
    try:
        assert client.get_plan(1, 0).num_rows == 3
        assert client._lane is not None and client._lane_port == second.lane.port != 0
    finally:
        client.close()
        second.stop()


def test_without_a_lane_the_stream_is_the_flight_exchange():
    server = PlaneServer(PlanService(), lane=False).start()
    try:
        client = PlaneClient(server.url, stream=True, stream_s=0.2)
        opened = time.monotonic()
        assert client.get_plan(0, 1).num_rows == 3
        answered = time.monotonic()
        assert client._lane_port == 0 and client._stream is not None
        # reopened after a random share (1/2 … 1) of stream_s, so clients spread their reopens;
        # the reopen time was set between `opened` and `answered`, so this holds however
        # slow the machine is (a sandwich on the monotonic clock, not a duration)
        assert opened + 0.1 <= client._stream[2] <= answered + 0.2
        for step in range(6):  # alternately reuse the stream and find it due for a reopen
            writer = client._stream[0]
            if step % 2:  # due: as if its time had passed (no waiting)
                client._stream = (*client._stream[:2], float("-inf"))
            assert client.get_plan(step, 2).column("step")[0].as_py() == step
            assert (client._stream[0] is writer) == (step % 2 == 0)
        client.close()
    finally:
        server.stop()


def test_an_unreachable_lane_falls_back_to_the_exchange(served, monkeypatch):
    _, server = served
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    monkeypatch.setattr(PlaneClient, "_ask_lane", lambda self, client: dead_port)
    with PlaneClient(server.url, token="s3cret", stream=True) as client:
        assert client.get_plan(0, 0).num_rows == 3
        assert client._lane_port == 0 and client._stream is not None


def test_one_connection_serves_one_thread_at_a_time(served):
    _, server = served
    client = PlaneClient(server.url, token="s3cret", stream=True)
    errors = []

    def fetch(rank):
        try:
            for step in range(20):
                got = client.get_plan(step, rank)
                assert got.column("step")[0].as_py() == step
                assert got.column("rank")[0].as_py() == rank
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=fetch, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    assert errors == []


def test_lane_on_an_ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server = PlaneServer(PlanService(), host="::1").start()
    try:
        assert server.url.startswith("grpc+tcp://[::1]:")
        with PlaneClient(server.url, stream=True) as client:
            assert client.get_plan(4, 1).num_rows == 3 and client._lane is not None
    finally:
        server.stop()
