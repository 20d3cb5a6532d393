"""The plane as a Ray actor (``omniscale plane serve --ray``), for jobs whose data side already
runs on a Ray cluster.

The actor holds the same :class:`DataPlane` and :class:`PlaneServer` a standalone plane does;
trainers reach it through its Flight URL with :class:`dataplane.client.PlaneClient`, never
through Ray calls, so plans still cross the wire as Arrow IPC only and the trainer side does
not depend on Ray. Ray only places the process and keeps it alive.

A plane actor whose process dies is started again by Ray (``max_restarts``) from its state
dir, on the same port, so trainers carry on: their clients retry, and the plans are the
same.

Placement: a plane bound to loopback is pinned to the caller's node (its URL is only reachable
there). Bound to another address (with a token, and TLS unless ``insecure``), it may run on any
node; bound to all interfaces (``0.0.0.0``), it advertises its node's IP (which its TLS
certificate must then name). Its state dir, and its certificate and key files, must then be
storage that node can reach: a plane restarted where its state dir holds no log refuses to
start fresh (that would repeat the run's data). Ray is imported lazily: it takes seconds to import.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import asdict
from pathlib import Path

from omniscale.dataplane.auth import check_bind, is_loopback
from omniscale.dataplane.journal import WAL_NAME
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.dataplane.server import PlaneServer
from omniscale.errors import UserError

ENDPOINT = "ray-endpoint.json"  # in the state dir: the port a restarted actor serves on again


class PlaneActor:
    """Runs a plane and its Flight server inside a Ray actor process (wrapped with
    ``ray.remote`` by :func:`start_on_ray`; a plain class so it can be read and tested
    without Ray)."""

    def __init__(self, spec: str | None, state_dir: str, config: dict, host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None, restore_step: int | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 insecure: bool = False, spec_root: str | None = None):
        # config travels as a plain dict: Ray ships arguments between processes, and a dict
        # does not tie the actor to this module's dataclass pickling.
        endpoint = Path(state_dir) / ENDPOINT
        if _restarted():  # by Ray, after its process died: from the state dir, on the same
            restore_step = None  # port (rolling back again would lose committed steps)
            _check_state_survived(state_dir)
            if port == 0 and endpoint.is_file():
                port = json.loads(endpoint.read_text())["port"]
        self.plane = DataPlane(spec, state_dir, PlaneConfig(**config),
                               restore_step=restore_step, spec_root=spec_root)
        self.plane.ray_namespace = _namespace()
        self.server = PlaneServer(self.plane, host, port, token, tls_cert=tls_cert,
                                  tls_key=tls_key, insecure=insecure).start()
        self._url = self.server.url
        tmp = endpoint.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": self.server.port}))
        tmp.replace(endpoint)
        if _unspecified(host):
            import ray  # inside the actor, Ray is already imported

            scheme = self._url.split("://", 1)[0]
            self._url = f"{scheme}://{_bracket(ray.util.get_node_ip_address())}:" \
                        f"{self.server.port}"

    def url(self) -> str:
        return self._url

    def pid(self) -> int:
        return os.getpid()

    def status(self) -> dict:
        return self.plane.status()

    def stop(self) -> dict:
        """Stop serving and write a snapshot; returns where the plane stopped."""
        self.server.stop()
        self.plane.snapshot()
        return {"next_step": self.plane.next_step, "state_dir": str(self.plane.journal.dir)}


def start_on_ray(spec: str | Path | None, state_dir: str | Path, config: PlaneConfig,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 restore_step: int | None = None, num_cpus: float = 1,
                 timeout: float = 300.0, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, insecure: bool = False,
                 spec_root: str | Path | None = None, max_restarts: int = 3,
                 name: str | None = None):
    """Start a plane actor on the Ray cluster this process is connected to (``ray.init``
    first), named ``name`` in this process's namespace when given (one plane of that name a
    namespace: the job's); returns ``(actor_handle, url)`` once the plane is serving. Its
    status names the namespace (``ray_namespace``): trainers put their decoding pools there.
    Stop it with ``ray.get(actor.stop.remote())`` then ``ray.kill(actor)``.

    If its process dies, Ray starts it again (up to ``max_restarts`` times): the plane
    resumes from its state dir (snapshot and log: every committed step) and serves on the
    same URL, so trainers' clients, which retry, carry on with the same plans."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    check_bind(host, token, tls_cert is not None, insecure)
    options: dict = {"num_cpus": num_cpus, "max_restarts": max_restarts}
    if name is not None:
        options["name"] = name
    if is_loopback(host):
        here = ray.get_runtime_context().get_node_id()
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
    paths = [None if p is None else str(Path(p).resolve())
             for p in (spec, state_dir, tls_cert, tls_key, spec_root)]
    try:
        actor = ray.remote(PlaneActor).options(**options).remote(
            paths[0], paths[1], asdict(config), host, port, token, restore_step, paths[2],
            paths[3], insecure, paths[4])
    except ValueError:  # the name is taken in this namespace
        namespace = ray.get_runtime_context().namespace
        raise UserError(f"a plane actor named {name!r} already runs in Ray namespace "
                        f"{namespace!r}: stop it, or give another --namespace") from None
    try:
        url = ray.get(actor.url.remote(), timeout=timeout)
    except ray.exceptions.RayActorError as e:
        # The plane's own one-line error (bad spec, wrong --window …) is the useful part.
        raise UserError(f"plane actor failed to start: {_reason(e)}") from None
    except BaseException:
        ray.kill(actor)
        raise
    return actor, url


def _check_state_survived(state_dir: str) -> None:
    """A plane restarted by Ray must find the job's log in its state dir. It is not there when
    Ray restarted it on a node that cannot reach the first one's state dir (a local disk):
    starting fresh would serve step 0 again, repeating every sample trained. (A first process
    that died before it wrote its start record is refused too; nothing was served, so running
    the job again is safe.)"""
    wal = Path(state_dir) / WAL_NAME
    if not wal.is_file() or wal.stat().st_size == 0:
        raise UserError(f"{state_dir}: the plane actor was restarted by Ray on node "
                        f"{_node_ip()}, but its state dir there holds no plane state; a "
                        "fresh start would repeat the run's data, so it refuses. Put the state "
                        "dir on storage every node reaches, or bind the plane to 127.0.0.1 "
                        "(pinned to the node it started on)")


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except (ImportError, RuntimeError):
        return "?"


def _namespace() -> str | None:
    """The Ray namespace this actor runs in (None outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().namespace if ray.is_initialized() else None
    except ImportError:
        return None


def _restarted() -> bool:
    """Whether this is a Ray actor process that Ray started again after the first died."""
    try:
        import ray

        return ray.is_initialized() and \
            ray.get_runtime_context().was_current_actor_reconstructed
    except (ImportError, RuntimeError, AssertionError):  # no Ray, or not in an actor
        return False


def _reason(error: BaseException) -> str:
    """The last line of Ray's report (the exception itself), without its class name."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^[\w.]+(Error|Exception): ", "", lines[-1]) if lines else \
        type(error).__name__


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
