"""The plane inside the trainer's process: one thread, the same Flight server and state.

Single-machine runs need no separate service: ``start_embedded`` builds the plane and serves it
from a daemon thread on loopback; other processes talk to it through the URL exactly as they
would to a standalone plane. Loaders in this very process (rank 0's) connect with
:func:`dataplane.local.connect` and call it directly, without the wire's CPU per step
(:mod:`dataplane.local`; its replies are checked against the wire's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omniscale.dataplane import local
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.dataplane.server import PlaneServer


@dataclass
class EmbeddedPlane:
    """A plane served from this process; ``url`` is where clients connect."""

    plane: DataPlane
    server: PlaneServer

    @property
    def url(self) -> str:
        return self.server.url

    def __str__(self) -> str:
        return self.url

    def stop(self) -> None:
        """Stop serving; the state dir keeps everything a restart needs."""
        local.unregister(self.url)
        self.server.stop()

    def __enter__(self) -> "EmbeddedPlane":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_embedded(spec: str | Path, state_dir: str | Path, config: PlaneConfig,
                   restore_step: int | None = None, port: int = 0) -> EmbeddedPlane:
    """Start (or resume, from ``state_dir``) a plane in a thread of this process."""
    plane = DataPlane(spec, state_dir, config, restore_step=restore_step)
    embedded = EmbeddedPlane(plane, PlaneServer(plane, "127.0.0.1", port).start())
    local.register(embedded.url, plane)
    return embedded
