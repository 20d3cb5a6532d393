"""``PlaneClient``: the trainer's side of the plane's wire.

Every call has a timeout. While the plane is unreachable (restarting after a crash, not up
yet) calls retry with exponential backoff for up to ``retry_for`` seconds, so a trainer rides
through a plane restart; a refusal (bad rank, committed step, wrong token) is raised at once as
:class:`PlaneError` carrying the plane's one-line message.
"""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pyarrow.flight as flight

from dataplane import wire
from dataplane.errors import UserError
from dataplane.server import PLAN_STREAM


class PlaneError(UserError):
    """The plane refused a request, or stayed unreachable past the retry budget."""


_RETRYABLE = (flight.FlightUnavailableError, flight.FlightTimedOutError,
              flight.FlightCancelledError, ConnectionError)


def _message(e: Exception) -> str:
    """The server's own message, without gRPC's decorations."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = text.split(". Detail:")[0]
    if ", with message: " in text:  # "Flight returned <kind> error, with message: ..."
        text = text.split(", with message: ", 1)[1]
    return text


class PlaneClient:
    """``stream=True``: ``get_plan`` sends its requests over one long-lived Flight
    ``do_exchange`` stream instead of one ``plan`` action call each (same plans, same errors,
    about a third of the per-fetch CPU on both sides). The stream is reopened every
    ``stream_s`` seconds and given ``stream_s + timeout`` to live, so every request keeps at
    least ``timeout``; a server's shutdown waits for open streams, so close idle clients (or
    expect it to wait up to that long)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0,
                 retry_for: float = 60.0, stream: bool = False, stream_s: float = 5.0):
        self.url, self.timeout, self.retry_for = url, timeout, retry_for
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(headers=headers, timeout=timeout)
        self._client: flight.FlightClient | None = None
        self._plan_actions: dict[tuple[int, int], flight.Action] = {}
        self.stream, self.stream_s = stream, stream_s
        self._stream_options = flight.FlightCallOptions(headers=headers,
                                                        timeout=stream_s + timeout)
        self._stream: tuple | None = None  # (writer, reader, opened at)
        self._stream_lock = threading.Lock()

    def _connect(self) -> flight.FlightClient:
        if self._client is None:
            self._client = flight.FlightClient(self.url)
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
                                     f"{self.retry_for:g} s: {_message(e)}") from None
                self.close()  # a fresh channel after a server restart
                time.sleep(delay)  # backoff between attempts, not synchronisation
                delay = min(delay * 2, 2.0)
            except flight.FlightError as e:
                raise PlaneError(f"plane at {self.url}: {what}: {_message(e)}") from None

    def get_plan(self, step: int, rank: int) -> pa.Table:
        """This rank's plan for ``step``: one row per LLM placement or encoder item."""
        key = int(step), int(rank)
        action = self._plan_actions.get(key)
        if action is None:  # the request bytes are the same every time: encode them once
            if len(self._plan_actions) > 4096:
                self._plan_actions.clear()
            action = self._plan_actions[key] = flight.Action(
                "plan", wire.encode({"step": key[0], "rank": key[1]}))

        def fetch(client):  # one IPC stream in one result ("plan" action; see server.py)
            if self.stream and self._stream_lock.acquire(blocking=False):
                try:  # the stream serves one request at a time; other threads use actions
                    return pa.ipc.open_stream(self._stream_fetch(client, action.body)).read_all()
                finally:
                    self._stream_lock.release()
            results = list(client.do_action(action, options=self._options))
            return pa.ipc.open_stream(results[0].body).read_all()
        return self._retrying(f"get_plan(step={step}, rank={rank})", fetch)

    def _stream_fetch(self, client: flight.FlightClient, body: pa.Buffer) -> pa.Buffer:
        """One plan request over the plans stream (opened or renewed as needed)."""
        now = time.monotonic()
        if self._stream is not None and now - self._stream[2] > self.stream_s:
            self._close_stream()
        if self._stream is None:
            writer, reader = client.do_exchange(
                flight.FlightDescriptor.for_command(PLAN_STREAM), options=self._stream_options)
            self._stream = (writer, reader, now)
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
        action = flight.Action(kind, wire.encode(body) if body else b"")

        def run(client):
            results = list(client.do_action(action, options=self._options))
            return wire.decode(results[0].body) if results else {}
        return self._retrying(kind, run)

    def commit(self, step: int, rank: int | None = None, plan_fp: str | None = None) -> dict:
        """Mark ``step`` (or ``rank``'s share of it) trained. ``plan_fp``,
        ``plan_table.fingerprint`` of the plan the rank trained, lets the plane refuse the
        commit if that step was re-planned since (a resize): the rank then fetches again."""
        body = {"step": int(step)} | ({} if rank is None else {"rank": int(rank)})
        if plan_fp is not None:
            body["plan_fp"] = str(plan_fp)
        return self._action("commit", body)

    def report_corrupt(self, step: int, rank: int, source: str, shard: str, key: str,
                       reason: str, epoch: int = 0):
        """Report a planned sample that does not decode; returns the replacement SampleRef the
        plane drew from the same source (None when it has none). Idempotent, so retries and
        every rank holding the sample get the same replacement."""
        from dataplane.corrupt import ref_from_json

        reply = self._action("report_corrupt", {
            "step": int(step), "rank": int(rank), "source": str(source), "shard": str(shard),
            "key": str(key), "reason": str(reason), "epoch": int(epoch)})
        return ref_from_json(reply.get("replacement") or "")

    def status(self) -> dict:
        return self._action("status", {})

    def snapshot(self, step: int | None = None) -> dict:
        return self._action("snapshot", {} if step is None else {"step": int(step)})

    def reload(self, spec: str) -> dict:
        return self._action("reload", {"spec": str(spec)})

    def audit(self) -> dict:
        return self._action("audit", {})

    def close(self) -> None:
        self._close_stream()
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> "PlaneClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
