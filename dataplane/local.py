"""The embedded plane's own process talks to it without a transport.

An embedded plane (:func:`dataplane.embedded.start_embedded`) lives in the trainer's process,
and so does rank 0's loader. Over the URL every step of that loader cost a gRPC commit and a
plan-lane fetch: Arrow IPC encoding on one side, decoding on the other, socket round trips and
thread hand-offs -- about 1.5 ms of CPU per step on the trainer's interpreter lock, more than
the plane's own work (``tools/bench/loader.py``, text workload). :func:`connect` hands such a
caller a :class:`LocalPlaneClient` instead: the same methods as ``PlaneClient``, calling the
``DataPlane`` directly (it is thread-safe: one lock around its state).

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

import pyarrow as pa

from omniscale.dataplane import wire
from omniscale.dataplane.client import PlaneClient, PlaneError
from omniscale.dataplane.server import Reason, refusal

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


class LocalPlaneClient:
    """``PlaneClient``'s methods on the plane this process serves at ``url``. Once the plane
    stops serving, calls fail as a client's would when its retries ran out
    (``Reason.UNREACHABLE``)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _call(self, what: str, fn_name: str, *args):
        plane = local_plane(self.url)
        if plane is None:
            raise PlaneError(f"plane at {self.url}: {what}: the embedded plane has stopped",
                             Reason.UNREACHABLE)
        try:
            return getattr(plane, fn_name)(*args)
        except Exception as e:  # noqa: BLE001 -- as the server: a bug is logged, then refused
            reason = refusal(e)
            if reason is not None:
                raise PlaneError(f"plane at {self.url}: {what}: {_one_line(e)}", reason) from None
            log.exception("plane: internal error in %s", fn_name)
            raise PlaneError(f"plane at {self.url}: {what}: internal error: "
                             f"{type(e).__name__}: {_one_line(e)}", Reason.INTERNAL) from None

    def _action(self, kind: str, fn_name: str, *args) -> dict:
        reply = self._call(kind, fn_name, *args)
        return wire.decode(wire.encode(reply))  # what a reply over the wire would be

    def get_plan(self, step: int, rank: int) -> pa.Table:
        return self._call(f"get_plan(step={step}, rank={rank})", "get_plan", int(step),
                          int(rank))

    def commit(self, step: int, rank: int | None = None, plan_fp: str | None = None) -> dict:
        args = [int(step), None if rank is None else int(rank)]
        if plan_fp is not None:
            args.append(str(plan_fp))
        return self._action("commit", "commit", *args)

    def commit_many(self, steps: list[int], rank: int, plan_fps: list[str | None]) -> dict:
        return self._action("commit_many", "commit_many", int(rank), [int(s) for s in steps],
                            [None if f is None else str(f) for f in plan_fps])

    def report_corrupt(self, step: int, rank: int, source: str, shard: str, key: str,
                       reason: str, epoch: int = 0):
        from omniscale.dataplane.corrupt import ref_from_json

        reply = self._action("report_corrupt", "report_corrupt", int(step), int(rank),
                             str(source), str(shard), str(key), str(reason), int(epoch))
        return ref_from_json(reply.get("replacement") or "")

    def report_suspect(self, step: int, samples: list[dict], reason: str) -> dict:
        return self._action("report_suspect", "report_suspect", int(step),
                            wire.decode(wire.encode({"s": list(samples)}))["s"], str(reason))

    def report_stragglers(self, step: int, ranks: list[int], slowdown: list[float]) -> dict:
        return self._action("stragglers", "report_stragglers", int(step),
                            [int(r) for r in ranks], [float(v) for v in slowdown])

    def status(self) -> dict:
        return self._action("status", "status")

    def snapshot(self, step: int | None = None) -> dict:
        return self._action("snapshot", "snapshot", None if step is None else int(step))

    def reload(self, spec: str) -> dict:
        return self._action("reload", "reload", str(spec))

    def audit(self) -> dict:
        return self._action("audit", "audit")

    def set_costs(self, linear: float, quadratic: float) -> dict:
        return self._action("costs", "set_costs", float(linear), float(quadratic))

    def close(self) -> None:
        pass  # nothing held: the plane belongs to whoever started it

    def __enter__(self) -> LocalPlaneClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
