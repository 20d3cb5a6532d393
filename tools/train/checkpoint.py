"""Checkpoints: ``RUN_DIR/checkpoints/step-NNNNNN/`` = model + optimizer (``parallel.dcp``, so
it loads on any number of ranks) + extras (steps done, torch RNG state) + ``meta.json``, and
the plane snapshot of the same step in ``RUN_DIR/plane``.

A checkpoint at step s means s steps are trained and committed; the plane's snapshot of step s
is "next step to train: s". ``meta.json`` is written last, by rank 0, so a directory without it
(a crash while saving) is never resumed from.

Checkpoints are trusted input: torch DCP unpickles ``.metadata`` when loading. ``meta.json``
therefore carries a manifest (``files``: size and SHA-256 of every other file of the directory)
and :func:`load` checks it before DCP reads anything. The plane snapshot is not in it: it lives
in ``RUN_DIR/plane`` (rewritten there by the plane's own schedule), is JSON, never unpickled, and
carries its own SHA-256, which the plane checks when it restores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from omniscale.errors import UserError
from omniscale.parallel import load_checkpoint, save_checkpoint
from omniscale.parallel.dcp import async_save as async_save_checkpoint
from omniscale.tools.train import collectives
from omniscale.tools.train.faults import NO_FAULTS, Faults


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


LATEST = "latest"  # RUN_DIR/checkpoints/latest: the newest complete checkpoint's name


def latest(run_dir: Path) -> tuple[int, Path] | None:
    """(step, directory) of the newest complete checkpoint, or None. Found by scanning for
    ``meta.json`` (the ``latest`` pointer is for tools outside the trainer: both are written
    after every other file, so neither ever names a half-written checkpoint)."""
    found = []
    for d in (run_dir / "checkpoints").glob("step-*"):
        if (d / "meta.json").exists():
            found.append((_meta(d)["step"], d))
    return max(found) if found else None


# Why a checkpoint that does not match its manifest is refused (the tail of every such error).
TAMPERED = ("the checkpoint was changed after it was written; checkpoints are trusted input: "
            "torch DCP unpickles its metadata")


def _meta(path: Path) -> dict:
    """``meta.json`` of checkpoint ``path`` (JSON: safe to read before the manifest is checked)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        meta["step"] = int(meta["step"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{path}: meta.json: unreadable ({str(e).splitlines()[0]})") from None
    return meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):  # streamed: shards can be many GB
            h.update(chunk)
    return h.hexdigest()


def _manifest(path: Path) -> dict[str, dict]:
    """Size and SHA-256 of every file of checkpoint ``path`` but ``meta.json``."""
    return {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(path.iterdir()) if f.name != "meta.json"}


def _check(path: Path, files: dict, names: list[str]) -> str | None:
    """The first problem with the files ``names`` of the manifest ``files``, or None."""
    for name in names:
        f = path / name
        try:
            if not f.is_file():
                return f"{path}: {name}: missing ({TAMPERED})"
            if f.stat().st_size != files[name]["size"]:
                return f"{path}: {name}: size does not match the manifest ({TAMPERED})"
            if _sha256(f) != files[name]["sha256"]:
                return f"{path}: {name}: checksum does not match the manifest ({TAMPERED})"
        except OSError as e:
            return f"{path}: {name}: cannot read ({e.strerror or e})"
    return None


def verify(path: Path) -> None:
    """Refuse, in one line, checkpoint ``path`` unless its files are exactly its manifest.

    Called by every rank before DCP loads. Under a process group each rank hashes its share of
    the files and the verdicts are gathered, so every rank fails alike (none waits in DCP for
    one that stopped) and the checkpoint is read once. The manifest guards against a checkpoint
    changed, damaged or swapped after it was written; it is no signature: whoever can rewrite
    the run directory can rewrite ``meta.json`` too."""
    group = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    try:
        problem = _problem(path, rank, world)
    except UserError as e:  # meta.json unreadable: still join the gather below
        problem = str(e)
    if group:
        verdicts = collectives.gather_checkpoint_verdicts(problem)
        problem = next((v for v in verdicts if v is not None), None)
    if problem is not None:
        raise UserError(problem)


def _problem(path: Path, rank: int, world: int) -> str | None:
    files = _meta(path).get("files")
    if not isinstance(files, dict) or not files:
        return (f"{path}: meta.json: no manifest of checksums (a checkpoint of an older "
                f"OmniScale, or changed after it was written; checkpoints are trusted input: "
                f"torch DCP unpickles its metadata, so it is not loaded)")
    for name, entry in files.items():
        if ("/" in name or name in ("", ".", "..") or not isinstance(entry, dict)
                or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str)):
            return f"{path}: meta.json: malformed manifest entry {name!r} ({TAMPERED})"
    try:
        extra = sorted(f.name for f in path.iterdir() if f.name != "meta.json"
                       and f.name not in files)
    except OSError as e:
        return f"{path}: cannot list ({e.strerror or e})"
    if extra:
        return f"{path}: {extra[0]}: not in the manifest ({TAMPERED})"
    return _check(path, files, sorted(files)[rank::world])


def _extra(step: int) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(step, dtype=torch.int64), "rng": torch.get_rng_state()}


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0: none deleted); returns
    the deleted directories. Incomplete ones (no ``meta.json``: a save that never finished)
    older than the newest kept one go too: nothing can resume from them."""
    if keep_last <= 0:
        return []
    complete = sorted((s, d) for d in (run_dir / "checkpoints").glob("step-*")
                      if (d / "meta.json").exists() for s in [_meta(d)["step"]])
    if len(complete) <= keep_last:
        return []
    oldest_kept = complete[-keep_last][0]
    doomed = [d for s, d in complete[:-keep_last]]
    doomed += [d for d in (run_dir / "checkpoints").glob("step-*")
               if not (d / "meta.json").exists() and int(d.name.split("-")[1]) < oldest_kept]
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


@dataclass
class PendingSave:
    """A checkpoint whose files are being written (``future``; None once written)."""

    path: Path
    step: int
    snapshot: dict | None
    future: object = None


def save(run_dir: Path, step: int, model, optimizer, plane, rank: int,
         keep_last: int = 0, async_group=None, faults: Faults = NO_FAULTS) -> PendingSave:
    """Every rank calls this after committing step ``step - 1``; rank 0 snapshots the plane
    (``plane``: its ``plane_session.PlaneSession``).
    ``async_group`` (a process group of its own): the files are written in the background and
    the checkpoint is complete after :func:`finish`; otherwise it is finished here. Either way
    ``meta.json`` is written last, by rank 0, then checkpoints beyond ``keep_last`` go."""
    path = checkpoint_dir(run_dir, step)
    if rank == 0 and path.exists():  # an earlier attempt that never finished
        shutil.rmtree(path)
    collectives.checkpoint_barrier()  # every rank has committed: the plane's next step is ``step``
    snapshot = plane.snapshot(step) if rank == 0 else None
    pending = PendingSave(path, step, snapshot)
    if async_group is not None:
        pending.future = async_save_checkpoint(path, model, optimizer, extra=_extra(step),
                                               process_group=async_group)
        return pending
    save_checkpoint(path, model, optimizer, extra=_extra(step))
    finish(pending, run_dir, rank, keep_last, faults)
    return pending


def finish(pending: PendingSave | None, run_dir: Path, rank: int, keep_last: int = 0,
           faults: Faults = NO_FAULTS) -> None:
    """Complete ``pending`` (wait for its files, then rank 0 writes ``meta.json``, points
    ``checkpoints/latest`` at it and prunes); every rank calls it, at the same point. None:
    nothing to do."""
    if pending is None:
        return
    if pending.future is not None:
        pending.future.result()
        pending.future = None
    collectives.checkpoint_barrier()
    if rank == 0:  # every rank's files are written and fsynced (DCP) before the barrier
        meta = {"step": pending.step,
                "plane_snapshot": pending.snapshot["path"] if pending.snapshot else None,
                "files": _manifest(pending.path)}
        tmp = pending.path / "meta.json.tmp"  # renamed into place: a crash leaves none
        with open(tmp, "w") as f:
            f.write(json.dumps(meta, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        faults.in_save(pending.step)  # a test's crash between the files and meta.json
        os.replace(tmp, pending.path / "meta.json")
        _write_atomically(run_dir / "checkpoints" / LATEST, pending.path.name + "\n")
        prune(run_dir, keep_last)


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part (fsync, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path, model, optimizer, verified: bool = False) -> int:
    """Restore model, optimizer and RNG in place; returns the steps done. ``verified``: the
    caller has just run :func:`verify` on every rank (a resume does, before the plane starts)."""
    if not verified:
        verify(path)  # before DCP unpickles anything
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    extra = _extra(0)
    try:
        load_checkpoint(path, model, optimizer, extra=extra)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- foreign or damaged: one line
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if "optimizer.state." in reason:  # trained now, frozen (so stateless) when saved
            reason += (" -- optim.groups must freeze the same parameters as when the "
                       "checkpoint was saved")
        raise UserError(f"{path}: cannot load checkpoint ({reason})") from None
    torch.set_rng_state(extra["rng"])
    return int(extra["step"])
