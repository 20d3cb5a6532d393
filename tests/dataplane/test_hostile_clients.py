"""The plane against hostile or broken clients: lane connections that never say hello, go idle,
exceed the cap or exhaust the process's descriptors, and Flight methods the plane does not serve.
Real sockets, real Flight servers and a real child process throughout."""

from __future__ import annotations

import logging
import socket
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from omniscale.dataplane import wire
from omniscale.dataplane.client import PlaneClient, _lane_reply
from omniscale.dataplane.lane import LANE_OK, LaneLimits, lane_frame
from omniscale.dataplane.server import PlaneServer
from tests.procs import Proc

HERE = Path(__file__).resolve().parent


class PlanService:
    def get_plan(self, step, rank):
        return pa.table({"step": [step] * 3, "rank": [rank] * 3, "sample": [0, 1, 2]})

    def status(self):
        return {"ahead": 3}


def serve(**limits) -> PlaneServer:
    return PlaneServer(PlanService(), token="s3cret", lane_limits=LaneLimits(**limits)).start()


def connect(server: PlaneServer, hello: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.lane.port), timeout=10)
    if hello:
        sock.sendall(lane_frame(wire.encode({"token": "s3cret"})))
        assert _lane_reply(sock)[0] == LANE_OK
    return sock


def fetch(sock: socket.socket, step: int, rank: int) -> pa.Table:
    sock.sendall(lane_frame(wire.plan_request(step, rank)))
    status, data = _lane_reply(sock)
    assert status == LANE_OK
    return pa.ipc.open_stream(bytes(data)).read_all()


def closed_by_server(sock: socket.socket) -> bool:
    """Blocks until the server closes ``sock`` (True), or 10 s pass (False)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)  # polling a condition with a deadline
    return True


def test_a_client_that_never_says_hello_is_closed_after_the_hello_timeout():
    server = serve(hello_timeout_s=0.3)
    try:
        authed = connect(server)  # said hello at once: the hello timeout is not for it
        silent = connect(server, hello=False)
        slow = connect(server, hello=False)
        slow.sendall(lane_frame(wire.encode({"token": "s3cret"}))[:6])  # half a hello
        opened = time.monotonic()
        assert closed_by_server(silent) and closed_by_server(slow)
        assert time.monotonic() - opened >= 0.25
        assert fetch(authed, 4, 1).column("step")[0].as_py() == 4
        assert wait_until(lambda: server.lane.connections == 1)
        for sock in (authed, silent, slow):
            sock.close()
    finally:
        server.stop()


def test_an_idle_client_is_closed_and_a_plane_client_reconnects():
    server = serve(idle_timeout_s=0.4)
    try:
        sock = connect(server)
        assert fetch(sock, 1, 0).num_rows == 3
        quiet_since = time.monotonic()
        assert closed_by_server(sock)
        assert time.monotonic() - quiet_since >= 0.35
        sock.close()
        with PlaneClient(server.url, token="s3cret", stream=True, retry_for=10) as client:
            assert client.get_plan(2, 0).num_rows == 3
            first = client._lane
            assert wait_until(lambda: server.lane.connections == 0)  # closed as idle
            assert client.get_plan(3, 0).column("step")[0].as_py() == 3
            assert client._lane is not None and client._lane is not first
    finally:
        server.stop()


def test_connections_beyond_the_cap_are_closed_at_once(caplog):
    server = serve(max_connections=3)
    try:
        kept = [connect(server) for _ in range(3)]
        with caplog.at_level(logging.WARNING, logger="omniscale.dataplane.lane"):
            extra = [connect(server, hello=False) for _ in range(5)]
            for sock in extra:
                assert closed_by_server(sock)
        cap = [r for r in caplog.records if "max_connections" in r.getMessage()]
        assert len(cap) == 1  # rate-limited: one warning for five refusals
        for rank, sock in enumerate(kept):
            assert fetch(sock, 7, rank).column("rank")[0].as_py() == rank
        kept.pop().close()
        assert wait_until(lambda: server.lane.connections == 2)
        kept.append(connect(server))  # room again
        assert fetch(kept[-1], 8, 2).num_rows == 3
        for sock in kept + extra:
            sock.close()
    finally:
        server.stop()


@pytest.mark.slow
def test_out_of_descriptors_backs_off_instead_of_spinning():
    child = Proc([sys.executable, str(HERE / "lane_fd_child.py")], timeout=60)
    socks: list[socket.socket] = []
    try:
        port = int(child.wait_for(r"^port (\d+)").group(1))
        for _ in range(40):  # far more than the child has descriptors for
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        child.popen.stdin.write("measure 1.0\n")
        child.popen.stdin.flush()
        cpu = child.wait_for(r"^cpu (\S+)").group(1)
        assert cpu != "never-failed", "".join(child.output)
        assert float(cpu) < 0.3, f"the lane thread spun: {cpu} s of CPU in 1 s"
        child.popen.stdin.write("warnings\n")
        child.popen.stdin.flush()
        warnings = int(child.wait_for(r"^warnings (\d+)").group(1))
        assert 1 <= warnings <= 3, "".join(child.output)
        for sock in socks:  # descriptors freed (the lane closes what it sees closed) …
            sock.close()
        socks.clear()
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        socks.append(sock)
        sock.sendall(lane_frame(wire.encode({"token": ""})))
        assert _lane_reply(sock)[0] == LANE_OK  # … and it accepts again
        sock.sendall(lane_frame(wire.plan_request(0, 0)))
        status, data = _lane_reply(sock)
        assert status == LANE_OK and bytes(data) == b"plan"
        child.popen.stdin.write("quit\n")
        child.popen.stdin.flush()
        child.finish()
    finally:
        for sock in socks:
            sock.close()
        child.kill()


UNSERVED = {
    "list_flights": lambda c: list(c.list_flights()),
    "get_flight_info": lambda c: c.get_flight_info(flight.FlightDescriptor.for_command(b"x")),
    "get_schema": lambda c: c.get_schema(flight.FlightDescriptor.for_command(b"x")),
    "do_put": lambda c: _put(c),
    "do_exchange": lambda c: _exchange(c),
}


def _put(client):
    writer, _ = client.do_put(flight.FlightDescriptor.for_command(b"x"),
                              pa.schema([("a", pa.int64())]))
    writer.write_table(pa.table({"a": [1]}))
    writer.close()


def _exchange(client):
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(b"rows\n" * 40))
    writer.begin(pa.schema([("a", pa.int64())]))
    writer.write_table(pa.table({"a": [1]}))
    writer.done_writing()
    reader.read_all()


@pytest.mark.parametrize("method", sorted(UNSERVED))
def test_unserved_flight_methods_answer_one_line(method):
    server = PlaneServer(PlanService()).start()
    try:
        client = flight.FlightClient(server.url)
        # pyarrow's client raises get_schema's refusal as a plain OSError
        with pytest.raises(OSError if method == "get_schema" else flight.FlightServerError
                           ) as refused:
            UNSERVED[method](client)
        message = str(refused.value)
        assert "Traceback" not in message and "\n" not in message
        expected = "unknown command" if method == "do_exchange" else "not served by the " \
                                                                      "OmniScale plane"
        assert message.startswith(f"{method}: ") and expected in message
        client.close()
        with PlaneClient(server.url) as plane:  # still serving
            assert plane.get_plan(0, 0).num_rows == 3
    finally:
        server.stop()


def test_without_the_token_even_unserved_methods_say_only_that():
    server = PlaneServer(PlanService(), token="s3cret").start()
    try:
        client = flight.FlightClient(server.url)
        for method in ("get_schema", "list_flights"):  # get_schema: a plain OSError here too
            with pytest.raises((OSError, flight.FlightError), match="^missing or wrong token"):
                UNSERVED[method](client)
        client.close()
    finally:
        server.stop()
