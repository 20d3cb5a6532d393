"""The embedded plane's own process talks to it without a transport.

An embedded plane (:func:`dataplane.embedded.start_embedded`) lives in the trainer's process,
and so does rank 0's loader. Over the URL every step of that loader cost a gRPC commit and a
plan-lane fetch: Arrow IPC encoding on one side, decoding on the other, socket round trips and
thread hand-offs -- about 1.5 ms of CPU per step on the trainer's interpreter lock, more than
the plane's own work (``tools/bench/loader.py``, text workload). :func:`connect` hands such a
caller a :class:`LocalPlaneClient` instead: the same methods as ``PlaneClient``, calling the
``DataPlane`` directly (it is thread-safe: one lock around its state). Both clients get their
methods from the action registry (:mod:`dataplane.actions`).

The two modes must not drift apart, so the local client answers exactly what the wire would:
action replies go through the wire's encoding and back (the same types), refusals become
``PlaneError`` with the plane's one-line message and reason, bugs ``Reason.INTERNAL``
(tests/dataplane/test_local_client.py compares both on the same plane). Plans are the plane's
own immutable Arrow tables. Other processes -- ranks started by torchrun, DataLoader workers
forked from this one, Ray actors -- are not in the registry (it is keyed by process id) and get
a ``PlaneClient`` over the URL as before.
"""

from __future__ import annotations

import logging
import os
import threading

from omniscale.dataplane import wire
from omniscale.dataplane.actions import Action, Reason, Reply, client_methods, refusal
from omniscale.dataplane.client import PlaneClient, PlaneError

log = logging.getLogger(__name__)

_planes: dict[str, tuple[int, object]] = {}  # url -> (pid that serves it, its DataPlane)
_planes_lock = threading.Lock()


def register(url: str, plane) -> None:
    """``plane`` (a DataPlane) is served at ``url`` from this process."""
    with _planes_lock:
        _planes[url] = (os.getpid(), plane)


def unregister(url: str) -> None:
    with _planes_lock:
        _planes.pop(url, None)


def local_plane(url: str):
    """The DataPlane this process serves at ``url``, else None."""
    entry = _planes.get(url)
    return entry[1] if entry is not None and entry[0] == os.getpid() else None


def connect(url: str, token: str | None = None, **options) -> PlaneClient | LocalPlaneClient:
    """A client of the plane at ``url``: in-process when this process serves it, else a
    ``PlaneClient(url, token=token, **options)``."""
    if local_plane(url) is not None:
        return LocalPlaneClient(url)
    return PlaneClient(url, token=token, **options)


@client_methods
class LocalPlaneClient:
    """``PlaneClient``'s methods on the plane this process serves at ``url`` (the same action
    registry makes both). Once the plane stops serving, calls fail as a client's would when its
    retries ran out (``Reason.UNREACHABLE``)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _invoke(self, action: Action, request):
        """Run one action as the server would: check the request as it arrives over the wire,
        call the plane's method; a record reply goes through the wire's encoding and back (the
        same types), a plan is the plane's own immutable table."""
        what = action.label(request)
        plane = local_plane(self.url)
        if plane is None:
            raise PlaneError(f"plane at {self.url}: {what}: the embedded plane has stopped",
                             Reason.UNREACHABLE)
        try:
            body = action.to_body(request)
            if action.free_form:  # records as the wire would deliver them
                body = wire.decode(wire.encode(body))
            reply = action.call(plane, action.from_body(body))
        except Exception as e:  # noqa: BLE001 -- as the server: a bug is logged, then refused
            reason = refusal(e)
            if reason is not None:
                raise PlaneError(f"plane at {self.url}: {what}: {_one_line(e)}", reason) from None
            log.exception("plane: internal error in %s", action.method)
            raise PlaneError(f"plane at {self.url}: {what}: internal error: "
                             f"{type(e).__name__}: {_one_line(e)}", Reason.INTERNAL) from None
        if action.reply is Reply.PLAN:
            return reply
        reply = wire.decode(wire.encode(reply))  # what a reply over the wire would be
        return reply if action.client_reply is None else action.client_reply(reply)

    def close(self) -> None:
        pass  # nothing held: the plane belongs to whoever started it

    def __enter__(self) -> LocalPlaneClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
