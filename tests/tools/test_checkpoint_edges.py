"""Edges of ``tools/train/checkpoint`` at unit level (issue #46 item 3): what ``verify`` says of a
checkpoint whose ``meta.json`` or manifest is damaged or whose files cannot be read, that a rank
which cannot read ``meta.json`` still joins the verdict gather, which directories ``prune``
deletes (and that it never deletes through a link), what ``save`` and ``finish`` leave on disk,
and the one line ``load`` gives for a checkpoint DCP cannot load.

Oracles the code under test did not produce: checkpoints and manifests are written here by
hand (sizes and SHA-256 from ``hashlib``), the expected lines are written out, and which
directories stay is listed by hand. ``save`` and ``finish`` run in a real one-rank gloo group
(their barriers are collectives); nothing here starts a process."""

from __future__ import annotations

import errno
import hashlib
import json
import pathlib

import pytest
import torch

from omniscale.errors import UserError
from omniscale.tools.train import checkpoint, collectives
from tests.tools.test_checkpoint_manifest import _group  # a real one-rank gloo group

SHARD = "__0_0.distcp"  # one rank's DCP file
# DCP's notice when it loads in one process (the trainer's own filter, as a pytest mark).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _written(path, files: dict[str, bytes], step: int = 3, manifest=None):
    """A checkpoint directory holding ``files`` and a ``meta.json`` whose manifest is theirs
    (or ``manifest``)."""
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    if manifest is None:
        manifest = {name: _entry(data) for name, data in files.items()}
    (path / "meta.json").write_text(json.dumps({"step": step, "files": manifest}))
    return path


def _refusal(path) -> str:
    with pytest.raises(UserError) as refused:
        checkpoint.verify(path)
    assert "\n" not in str(refused.value)
    return str(refused.value)


# -- verify ------------------------------------------------------------------------------------

@pytest.mark.parametrize("meta, why", [
    (None, "[Errno 2] No such file or directory"),  # no meta.json at all
    ("{", "Expecting property name enclosed in double quotes"),
    ('{"step": "three"}', "invalid literal for int() with base 10: 'three'"),
    ('{"step": null}', "int() argument must be"),
    ('{"files": {}}', "'step'"),
], ids=["missing", "not-json", "step-not-a-number", "step-null", "no-step"])
def test_an_unreadable_meta_json_is_refused_in_one_line(tmp_path, meta, why):
    path = tmp_path / "step-000003"
    path.mkdir()
    (path / SHARD).write_bytes(b"x")
    if meta is not None:
        (path / "meta.json").write_text(meta)
    line = _refusal(path)
    assert line.startswith(f"{path}: meta.json: unreadable ({why}") and line.endswith(")")


@pytest.mark.parametrize("files", [{}, [SHARD]], ids=["empty", "a-list"])
def test_a_manifest_that_lists_nothing_or_is_no_mapping_is_refused(tmp_path, files):
    path = _written(tmp_path / "c", {SHARD: b"x"}, manifest=files)
    assert _refusal(path).startswith(f"{path}: meta.json: no manifest of checksums (")


GOOD = _entry(b"x")


@pytest.mark.parametrize("name, entry", [
    ("sub/x", GOOD), ("", GOOD), (".", GOOD), ("..", GOOD),  # a path outside the file list
    ("x", [1, GOOD["sha256"]]), ("x", {"size": "1", "sha256": GOOD["sha256"]}),
    ("x", {"size": 1, "sha256": 7}), ("x", {"size": 1}),
], ids=["slash", "empty", "dot", "dotdot", "not-a-mapping", "size-text", "sha-number",
        "no-sha"])
def test_a_malformed_manifest_entry_is_refused(tmp_path, name, entry):
    path = _written(tmp_path / "c", {"x": b"x"}, manifest={"x": GOOD, name: entry})
    assert _refusal(path) == (f"{path}: meta.json: malformed manifest entry {name!r} "
                              f"({checkpoint.TAMPERED})")


def test_a_file_the_manifest_names_but_the_system_cannot_stat_is_refused(tmp_path):
    name = "x" * 300  # longer than a file name may be: stat fails (not "no such file")
    path = _written(tmp_path / "c", {}, manifest={name: GOOD})
    assert _refusal(path) == f"{path}: {name}: cannot read (File name too long)"


def test_a_directory_that_cannot_be_listed_is_refused(tmp_path, monkeypatch):
    path = _written(tmp_path / "c", {SHARD: b"x"})

    def failing_disk(self):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(pathlib.Path, "iterdir", failing_disk)
    assert _refusal(path) == f"{path}: cannot list (Input/output error)"


def test_a_rank_that_cannot_read_meta_json_still_joins_the_verdict_gather(tmp_path, monkeypatch):
    """Its peers wait in the gather for its verdict: a rank that raised before it would leave
    them waiting forever (a 2-rank run would hang, not fail)."""
    path = tmp_path / "c"
    path.mkdir()
    joined = []
    gather = collectives.gather_checkpoint_verdicts

    def watched(problem):
        joined.append(problem)
        return gather(problem)

    monkeypatch.setattr(collectives, "gather_checkpoint_verdicts", watched)
    with _group(tmp_path):
        line = _refusal(path)
    assert joined == [line] and line.startswith(f"{path}: meta.json: unreadable (")


# -- prune -------------------------------------------------------------------------------------

def _made(run, step, complete=True):
    d = run / "checkpoints" / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / SHARD).write_bytes(b"x")
    if complete:
        (d / "meta.json").write_text(json.dumps({"step": step}))
    return d


def _left(run):
    return sorted(d.name for d in (run / "checkpoints").iterdir())


def test_prune_keeps_the_newest_and_deletes_unfinished_saves_older_than_every_kept_one(tmp_path):
    for step in (10, 20, 30, 40, 50):
        _made(tmp_path, step)
    _made(tmp_path, 35, complete=False)  # older than both kept ones: nothing resumes from it
    _made(tmp_path, 60, complete=False)  # being written now
    deleted = sorted(d.name for d in checkpoint.prune(tmp_path, 2))
    assert deleted == ["step-000010", "step-000020", "step-000030", "step-000035"]
    assert _left(tmp_path) == ["step-000040", "step-000050", "step-000060"]


def test_prune_keeping_one_keeps_only_the_newest(tmp_path):
    for step in (1, 2, 3):
        _made(tmp_path, step)
    checkpoint.prune(tmp_path, 1)
    assert _left(tmp_path) == ["step-000003"]


def test_prune_keeping_all_leaves_unfinished_saves_too(tmp_path):
    _made(tmp_path, 1, complete=False)  # a crashed save, older than every complete one
    for step in (2, 3):
        _made(tmp_path, step)
    assert checkpoint.prune(tmp_path, 0) == []
    assert _left(tmp_path) == ["step-000001", "step-000002", "step-000003"]


def test_prune_never_deletes_through_a_link_and_never_stops_the_run(tmp_path):
    """An old checkpoint moved elsewhere and linked back: what it points to is kept, and the
    save that prunes still completes."""
    moved = tmp_path / "archive" / "step-000001"
    moved.mkdir(parents=True)
    (moved / SHARD).write_bytes(b"x")
    (moved / "meta.json").write_text(json.dumps({"step": 1}))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-000001").symlink_to(moved)
    _made(tmp_path / "run", 2)
    checkpoint.prune(tmp_path / "run", 1)
    assert (moved / SHARD).read_bytes() == b"x" and (moved / "meta.json").is_file()


# -- save, finish, load ------------------------------------------------------------------------

class _Plane:
    """The plane's part in a save: rank 0 asks it for its snapshot of the step."""

    def __init__(self):
        self.asked = []

    def snapshot(self, step: int) -> dict:
        self.asked.append(step)
        return {"path": f"plane/snapshots/snap-{step:010d}.json"}


def _model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _on_disk(path) -> dict:
    return {f.name: _entry(f.read_bytes()) for f in path.iterdir() if f.name != "meta.json"}


def test_save_replaces_an_unfinished_attempt_and_names_the_planes_snapshot(tmp_path):
    run = tmp_path / "run"
    stale = checkpoint.checkpoint_dir(run, 4)
    stale.mkdir(parents=True)
    (stale / "__1_0.distcp").write_bytes(b"an earlier 2-rank attempt's shard")
    model, optimizer = _model()
    plane = _Plane()
    with _group(tmp_path):
        path = checkpoint.save(run, 4, model, optimizer, plane, rank=0).path
    assert path == stale and plane.asked == [4]
    assert sorted(_on_disk(path)) == [".metadata", SHARD]  # what DCP wrote, nothing stale
    meta = json.loads((path / "meta.json").read_text())
    assert meta == {"step": 4, "plane_snapshot": "plane/snapshots/snap-0000000004.json",
                    "files": _on_disk(path)}
    assert (run / "checkpoints" / "latest").read_text() == "step-000004\n"
    fresh, fresh_optimizer = _model(seed=1)
    assert checkpoint.load(path, fresh, fresh_optimizer) == 4
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values()))


def test_finish_lists_every_file_whatever_its_name_and_by_default_deletes_nothing(tmp_path):
    run = tmp_path / "run"
    for step in (2, 4):
        _made(run, step)
    files = {".metadata": b"m", SHARD: b"shard", "model.safetensors": b"weights",
             "zz-notes.txt": b"written by a storage plugin"}  # names on both sides of meta.json
    path = checkpoint.checkpoint_dir(run, 6)
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    pending = checkpoint.PendingSave(path, 6, {"path": "plane/snap-6.json"})
    with _group(tmp_path):
        checkpoint.finish(pending, run, 0)
    meta = json.loads((path / "meta.json").read_text())
    assert meta == {"step": 6, "plane_snapshot": "plane/snap-6.json",
                    "files": {name: _entry(data) for name, data in files.items()}}
    checkpoint.verify(path)
    assert _left(run) == ["latest", "step-000002", "step-000004", "step-000006"]
    assert (run / "checkpoints" / "latest").read_text() == "step-000006\n"


def test_a_checkpoint_dcp_cannot_load_is_refused_with_dcps_last_line(tmp_path):
    """Another model's checkpoint (its manifest intact): the line gives DCP's reason, the last
    line of its multi-line error, not the error's type or its traceback."""
    model, optimizer = _model()
    with _group(tmp_path):
        path = checkpoint.save(tmp_path / "run", 1, model, optimizer, _Plane(), rank=0).path
    other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
    with pytest.raises(UserError) as refused:
        checkpoint.load(path, other, torch.optim.AdamW(other.parameters()))
    line = str(refused.value)
    assert line.startswith(f"{path}: cannot load checkpoint (") and "\n" not in line
    assert "Size mismatch" in line and "Traceback" not in line, line
    assert "optim.groups" not in line  # the frozen-parameters hint is for another refusal


def _stepped(model, optimizer):
    """The optimizer after one step: state for every parameter that had a gradient."""
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_parameter_frozen_when_saved_but_trained_now_is_refused_with_the_groups_hint(tmp_path):
    """A checkpoint saved with the first layer frozen holds no optimizer state for it; resuming
    with that layer trained asks DCP for state it lacks. The line says why (optim.groups must
    freeze the same parameters), a hint other refusals do not carry."""
    model, optimizer = _model()
    model[0].requires_grad_(False)
    with _group(tmp_path):
        path = checkpoint.save(tmp_path / "run", 2, *_stepped(model, optimizer), _Plane(),
                               rank=0).path
        trained, trained_optimizer = _stepped(*_model())
        with pytest.raises(UserError) as refused:
            checkpoint.load(path, trained, trained_optimizer)
    line = str(refused.value)
    assert line.startswith(f"{path}: cannot load checkpoint (") and "\n" not in line
    assert "optimizer.state." in line, line
    assert line.endswith("-- optim.groups must freeze the same parameters as when the "
                         "checkpoint was saved)"), line
