"""Restore when the log and the newest snapshot disagree on where the run stands
(``dataplane.restore.open_state``, issue #46 item 2):

- the log ends exactly where the newest snapshot was taken (no record after it): the plane
  stands at the snapshot's step and plans what the plane that never stopped plans;
- the log ends BEFORE the newest snapshot's step, and that snapshot does not verify (so the
  journal's own "the snapshot follows more log than there is" check never sees it): an older
  snapshot or the whole log replays to an earlier step, which would silently train committed
  steps again -- refused in one line naming both steps.

Oracles: the committed steps are counted from the log by hand (``committed_steps``), and plans
are compared with those of a plane that never restarted."""

from __future__ import annotations

import shutil

import pytest

from omniscale.dataplane.plane import DataPlane
from omniscale.errors import UserError
from tests.dataplane.plane_steps import commit_step
from tests.dataplane.test_plane_durability import CONFIG, assert_clean, committed_steps, logged

SNAPPED = 5  # the newest snapshot's step


def _trained_and_snapshotted(demo, state):
    """A plane that committed SNAPPED steps and then took a snapshot (the log ends there)."""
    plane = DataPlane(demo / "mix.yaml", state, CONFIG)
    for step in range(SNAPPED):
        commit_step(plane, step)
    plane.snapshot()
    return plane


def _plans(plane, steps):
    return [plane.get_plan(s, r) for s in steps for r in range(CONFIG.dp)]


def _corrupt(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


def _cut_log_to_commits(state, commits: int) -> None:
    """Keep the log's records up to and including its ``commits``-th commit (whole lines)."""
    wal = state / "wal.jsonl"
    lines = wal.read_bytes().split(b"\n")[:-1]
    records = logged(state)
    last = [i for i, r in enumerate(records) if r["t"] == "commit"][commits - 1]
    wal.write_bytes(b"".join(line + b"\n" for line in lines[:last + 1]))
    assert committed_steps(logged(state)) == commits


def test_a_log_ending_at_the_newest_snapshot_restores_its_step(demo, tmp_path):
    plane = _trained_and_snapshotted(demo, tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    snaps = sorted((tmp_path / "b" / "snapshots").glob("snap-*.json"))
    assert snaps[-1].name == f"snap-{SNAPPED:010d}.json"
    reopened = DataPlane(demo / "mix.yaml", tmp_path / "b", CONFIG)
    assert reopened.next_step == SNAPPED == committed_steps(logged(tmp_path / "b"))
    ahead = range(SNAPPED, SNAPPED + 3)
    assert _plans(reopened, ahead) == _plans(plane, ahead)
    for step in ahead:  # and it goes on past the snapshot; a restart replays those too
        commit_step(reopened, step)
    again = DataPlane(demo / "mix.yaml", tmp_path / "b", CONFIG)
    assert again.next_step == SNAPPED + 3
    assert_clean(tmp_path / "b", SNAPPED + 3)


@pytest.mark.parametrize("older_snapshot", [True, False], ids=["older-snapshot", "whole-log"])
def test_a_log_ending_before_the_newest_snapshot_is_refused(demo, tmp_path, older_snapshot):
    state = tmp_path / "state"
    _trained_and_snapshotted(demo, state)
    newest, *older = sorted((state / "snapshots").glob("snap-*.json"), reverse=True)
    assert newest.name == f"snap-{SNAPPED:010d}.json" and older  # step 0's is there too
    _corrupt(newest)  # it does not verify: the restore falls back past it
    if not older_snapshot:
        for path in older:
            _corrupt(path)
    _cut_log_to_commits(state, 2)  # steps 2..4 were committed, their records are lost
    with pytest.raises(UserError) as refused:
        DataPlane(demo / "mix.yaml", state, CONFIG)
    line = str(refused.value)
    assert "\n" not in line
    assert "replays to step 2, but a snapshot of step 5 exists" in line
