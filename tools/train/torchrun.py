"""``omniscale train`` started by ``torchrun`` (one process per rank, any number of nodes).

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous (``MASTER_ADDR``,
``MASTER_PORT``); each process then runs exactly one rank, and the process group joins through
``env://``. Global rank 0 prepares the run (demo data and index if needed, ``config.yaml``, the
external plane check) *before* it joins the group: the others wait in the rendezvous, so no rank
reads a spec or an index that is still being written.

On one node rank 0 may embed the plane (it binds loopback). Across nodes the ranks of the other
nodes cannot reach loopback, so a multi-node run needs ``--plane URL`` of a plane every node can
reach (``omniscale plane serve --host 0.0.0.0 --token T``, or ``--ray`` on a Ray cluster). The
run directory and the data must be on a filesystem every node sees (checkpoints are written by
every rank).
"""

from __future__ import annotations

import os

from omniscale.dataplane.errors import UserError


def under_torchrun() -> bool:
    """True in a process torchrun (or another launcher with the same variables) started."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def torchrun_layout(nproc: int, plane: str | None) -> tuple[int, int]:
    """(rank, world) from the environment, after checking the flags fit a torchrun launch."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if nproc not in (1, world):
        raise UserError(f"--nproc {nproc}: under torchrun each process is one rank "
                        f"(use torchrun --nproc-per-node; this job has {world} ranks)")
    if local_world != world and plane is None:
        raise UserError(f"{world} ranks on {world // max(local_world, 1)} nodes: give --plane "
                        f"URL (an `omniscale plane serve --host 0.0.0.0 --token T` every node "
                        f"can reach); the embedded plane listens on loopback only")
    return rank, world
