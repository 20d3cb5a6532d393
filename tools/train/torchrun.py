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

With ``data.loader: ray`` and no ``data.ray_address``, a one-node job's rank 0 starts the job's
Ray instance and the other ranks join it (:func:`shared_ray`), as under ``omniscale train
--nproc``; a job over several nodes joins a cluster every node reaches.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

from omniscale.errors import UserError


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


@contextlib.contextmanager
def shared_ray(cfg, job, rank: int):
    """``job`` with the Ray cluster its ranks share: under torchrun on one node with
    ``data.loader: ray`` and no address, rank 0 starts a Ray instance for the job and hands
    its address to the others (a broadcast in the process group, which must be up); on the
    way out the others leave it first, then rank 0 stops it. Otherwise ``job`` as it is."""
    if cfg.data.loader != "ray" or job.ray_address or cfg.data.ray_address:
        yield job
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        raise UserError("data.loader=ray on several nodes: set data.ray_address (a cluster "
                        "every node joins: `ray start` on each, then HOST:PORT of the head)")
    import ray

    from omniscale.loaders.ray_cluster import job_namespace, start_local
    from omniscale.tools.train import collectives

    address = collectives.share_ray_address(
        start_local(job_namespace(job.run_dir)) if rank == 0 else None)
    finished = False
    try:
        yield replace(job, ray_address=address)
        finished = True
    finally:
        if rank != 0:
            ray.shutdown()
        if finished:  # a failed rank's peers are stopped by torchrun: nobody to wait for
            collectives.ray_leave_barrier()
        if rank == 0:
            ray.shutdown()
