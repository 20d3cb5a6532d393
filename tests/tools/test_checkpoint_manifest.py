"""Checkpoints are trusted input (torch DCP unpickles ``.metadata``): ``meta.json`` carries a
manifest of every file's size and SHA-256, and a checkpoint that does not match it is refused
in one line before DCP reads anything (issue #14, item 8).

A real checkpoint is saved once by ``checkpoint.save`` (a one-rank gloo group, a small torch
model with AdamW state, a real embedded plane for the snapshot); each test damages a copy. The
last test resumes a real short ``omniscale train`` run whose checkpoint was changed."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from omniscale.dataplane.client import PlaneClient
from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.plane_config import PlaneConfig
from omniscale.errors import UserError
from omniscale.parallel import load_checkpoint
from omniscale.tools.cli import main
from omniscale.tools.train import checkpoint
from omniscale.tools.train.launch import train

SHARD = "__0_0.distcp"  # the one rank's DCP file
# DCP's notice when it loads in one process (the trainer's own filter, as a pytest mark).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@contextmanager
def _group(tmp):
    """A real one-rank gloo process group (save is collective: barriers around DCP)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(demo, tmp_path_factory):
    """(run directory, checkpoint directory, the saved parameters)."""
    tmp = tmp_path_factory.mktemp("manifest")
    run_dir = tmp / "run"
    model, optimizer = _model(0)
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()  # AdamW state to save too
    config = PlaneConfig(dp=1, micro_batch_tokens=4096, global_batch_tokens=4096)
    with start_embedded(demo / "mix.yaml", run_dir / "plane", config) as plane, \
            PlaneClient(plane.url) as client, _group(tmp):
        path = checkpoint.save(run_dir, 0, model, optimizer, client, rank=0).path
    return run_dir, path, _params(model)


def _copy(saved, tmp_path):
    run_dir = shutil.copytree(saved[0], tmp_path / "run")
    return run_dir, checkpoint.checkpoint_dir(run_dir, 0)


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _refused(path, want):
    """Loading ``path`` is refused with the one line ``{path}: {want} (...)``; nothing loaded."""
    model, optimizer = _model(1)
    before = _params(model)
    with pytest.raises(UserError) as e:
        checkpoint.load(path, model, optimizer)
    message = str(e.value)
    assert message.startswith(f"{path}: {want} (") and "\n" not in message, message
    assert "trusted input" in message and e.value.__cause__ is None
    after = _params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
    assert not optimizer.state
    return message


def test_manifest_lists_every_file_with_its_sha256(saved):
    _, path, _ = saved
    files = json.loads((path / "meta.json").read_text())["files"]
    on_disk = sorted(f.name for f in path.iterdir() if f.name != "meta.json")
    assert sorted(files) == on_disk and ".metadata" in files and SHARD in files
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("in_group", [False, True])
def test_untouched_checkpoint_loads_equal_parameters(saved, tmp_path, in_group):
    _, path, params = saved
    model, optimizer = _model(1)
    assert not torch.equal(model[0].weight, params["0.weight"])
    if in_group:  # the verdicts gathered over the group
        with _group(tmp_path):
            step = checkpoint.load(path, model, optimizer)
    else:
        step = checkpoint.load(path, model, optimizer)
    assert step == 0 and optimizer.state
    loaded = _params(model)
    assert all(torch.equal(loaded[k], params[k]) for k in params)


def test_changed_shard_is_refused(saved, tmp_path):
    _, path = _copy(saved, tmp_path)
    _flip(path / SHARD)
    _refused(path, f"{SHARD}: checksum does not match the manifest")


def test_changed_shard_is_refused_on_every_rank_of_a_group(saved, tmp_path):
    _, path = _copy(saved, tmp_path)
    _flip(path / SHARD)
    with _group(tmp_path):
        _refused(path, f"{SHARD}: checksum does not match the manifest")


def test_changed_metadata_is_refused_before_it_is_unpickled(saved, tmp_path):
    _, path = _copy(saved, tmp_path)
    _flip(path / ".metadata")
    _refused(path, ".metadata: checksum does not match the manifest")


class _Touch:
    """Unpickling it creates a file: a stand-in for what a hostile ``.metadata`` could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_hostile_metadata_is_never_unpickled(saved, tmp_path):
    _, path = _copy(saved, tmp_path)
    marker = tmp_path / "unpickled"
    (path / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    _refused(path, ".metadata: size does not match the manifest")
    assert not marker.exists()
    # Without the manifest check, DCP would have run it: the test's premise holds.
    model, optimizer = _model(1)
    with pytest.raises(CheckpointException):  # DCP then fails on the file object it got
        load_checkpoint(path, model, optimizer)
    assert marker.exists()


def test_missing_shard_is_refused(saved, tmp_path):
    _, path = _copy(saved, tmp_path)
    (path / SHARD).unlink()
    _refused(path, f"{SHARD}: missing")


def test_extra_shard_is_refused(saved, tmp_path):
    _, path = _copy(saved, tmp_path)
    shutil.copy(path / SHARD, path / "__1_0.distcp")
    _refused(path, "__1_0.distcp: not in the manifest")


def test_checkpoint_without_manifest_is_refused(saved, tmp_path):
    _, path = _copy(saved, tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    (path / "meta.json").write_text(json.dumps(meta))
    message = _refused(path, "meta.json: no manifest of checksums")
    assert "older OmniScale" in message


def test_resume_of_a_changed_checkpoint_is_one_line_and_leaves_the_run(demo, tmp_path, capsys):
    run = tmp_path / "run"
    sets = {"data.spec": demo / "mix.yaml", "data.eval_spec": "null", "data.workers": 0,
            "data.global_batch_tokens": 2048, "data.micro_batch_tokens": 2048,
            "eval.enabled": False, "checkpoint_every": 2, "steps": 2, "output_dir": run}
    train("configs/demo_omni.yaml", sets=[f"{k}={v}" for k, v in sets.items()],
          progress=False)
    path = checkpoint.checkpoint_dir(run, 2)
    _flip(path / SHARD)
    kept = {p: p.read_bytes() for p in [*(run / "plane").rglob("*"), run / "metrics.jsonl"]
            if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "steps=4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"omniscale: error: {path}: {SHARD}: checksum does not match the manifest "
                   f"({checkpoint.TAMPERED})")
    # Refused before the plane restored (and rolled back) its state or metrics were trimmed.
    assert {p: p.read_bytes() for p in kept} == kept
    assert sorted(p for p in (run / "plane").rglob("*") if p.is_file()) == sorted(
        p for p in kept if p.name != "metrics.jsonl")
