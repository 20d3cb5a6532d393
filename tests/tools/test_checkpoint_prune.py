"""``checkpoint.keep_last``: the newest N complete checkpoints stay, older ones and unfinished
saves older than them go; nothing is deleted with 0."""

from __future__ import annotations

import json

from omniscale.tools.train.checkpoint import prune


def _make(run, step, complete=True):
    d = run / "checkpoints" / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / "shard.distcp").write_bytes(b"x")
    if complete:
        (d / "meta.json").write_text(json.dumps({"step": step}))
    return d


def _left(run):
    return sorted(d.name for d in (run / "checkpoints").iterdir())


def test_keeps_the_newest_complete_ones(tmp_path):
    for step in (10, 20, 30, 40):
        _make(tmp_path, step)
    _make(tmp_path, 15, complete=False)  # an unfinished save older than the kept ones
    _make(tmp_path, 50, complete=False)  # one being written now: never touched
    deleted = prune(tmp_path, 2)
    assert _left(tmp_path) == ["step-000030", "step-000040", "step-000050"]
    assert sorted(d.name for d in deleted) == ["step-000010", "step-000015", "step-000020"]


def test_zero_or_few_deletes_nothing(tmp_path):
    for step in (1, 2):
        _make(tmp_path, step)
    assert prune(tmp_path, 0) == [] and prune(tmp_path, 2) == [] and prune(tmp_path, 5) == []
    assert _left(tmp_path) == ["step-000001", "step-000002"]
