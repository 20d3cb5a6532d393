"""Checkpoints: ``RUN_DIR/checkpoints/step-NNNNNN/`` = model + optimizer (``parallel.dcp``, so
it loads on any number of ranks) + extras (steps done, torch RNG state) + ``meta.json``, and
the plane snapshot of the same step in ``RUN_DIR/plane``.

A checkpoint at step s means s steps are trained and committed; the plane's snapshot of step s
is "next step to train: s". ``meta.json`` is written last, by rank 0, so a directory without it
(a crash while saving) is never resumed from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from dataplane.errors import UserError
from parallel import load_checkpoint, save_checkpoint


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


def latest(run_dir: Path) -> tuple[int, Path] | None:
    """(step, directory) of the newest complete checkpoint, or None."""
    found = []
    for d in (run_dir / "checkpoints").glob("step-*"):
        if (d / "meta.json").exists():
            found.append((json.loads((d / "meta.json").read_text())["step"], d))
    return max(found) if found else None


def _extra(step: int) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(step, dtype=torch.int64), "rng": torch.get_rng_state()}


def save(run_dir: Path, step: int, model, optimizer, plane_client, rank: int) -> Path:
    """Every rank calls this after committing step ``step - 1``; rank 0 snapshots the plane."""
    path = checkpoint_dir(run_dir, step)
    if rank == 0 and path.exists():  # an earlier attempt that never finished
        shutil.rmtree(path)
    dist.barrier()  # every rank has committed: the plane's next step is ``step``
    snapshot = plane_client.snapshot(step) if rank == 0 else None
    save_checkpoint(path, model, optimizer, extra=_extra(step))
    dist.barrier()
    if rank == 0:
        (path / "meta.json").write_text(json.dumps(
            {"step": step, "plane_snapshot": snapshot["path"] if snapshot else None}) + "\n")
    return path


def load(path: Path, model, optimizer) -> int:
    """Restore model, optimizer and RNG in place; returns the steps done."""
    extra = _extra(0)
    try:
        load_checkpoint(path, model, optimizer, extra=extra)
    except Exception as e:  # noqa: BLE001 -- a foreign or damaged checkpoint: one line
        raise UserError(f"{path}: cannot load checkpoint ({str(e).splitlines()[0]})") from None
    torch.set_rng_state(extra["rng"])
    return int(extra["step"])
