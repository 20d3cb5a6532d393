"""Restore when the log and the newest snapshot disagree on where the run stands
(``dataplane.restore.open_state``, issue #46 items 2 and 3):

- the log ends exactly where the newest snapshot was taken (no record after it): the plane
  stands at the snapshot's step and plans what the plane that never stopped plans;
- the log ends BEFORE the newest snapshot's step, and that snapshot does not verify (so the
  journal's own "the snapshot follows more log than there is" check never sees it): an older
  snapshot or the whole log replays to an earlier step, which would silently train committed
  steps again -- refused in one line naming both steps;
- a restore to a given step (a trainer's checkpoint, ``plane serve --restore-step``) whose
  snapshot does not verify replays the log to exactly that step -- at step 0, just past it,
  and far enough that CPython no longer shares the int objects -- and a step the log jumps
  over (an out-of-order commit) or never reaches is refused, saying where the log stands;
- a state dir whose log holds only the start (a crash before step 0's snapshot) reopens;
  one whose log starts with any other record is refused; a restart that changes a planning
  setting is refused naming that setting as the user sets it.

Oracles: the committed steps are counted from the log by hand (``committed_steps``), log offsets
are the ends of its lines (``_line_ends``), and plans are compared with those of a plane that
never restarted."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from omniscale.dataplane.journal import Journal
from omniscale.dataplane.plane import DataPlane
from omniscale.dataplane.restore import check_settings, open_state
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


# -- a restore to a given step, the start record, the planning settings (issue #46 item 3) --

def _line_ends(state) -> list[int]:
    """The byte offset after each line of the log, read independently of the journal."""
    data = (state / "wal.jsonl").read_bytes()
    return [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]


def _started_with_commits(demo, state, steps) -> Journal:
    """A new plane's state dir (its start record and step 0's snapshot), then a commit record
    for each of ``steps`` in that order, appended as the plane logs them (``t``, ``step``,
    ``fp``): a replay only counts them, so no plan needs computing."""
    DataPlane(demo / "mix.yaml", state, CONFIG)
    journal = Journal(state)
    for step in steps:
        journal.append({"t": "commit", "step": step, "fp": []}, sync=False)
    journal.sync_to(journal.written)
    return journal


def _tear_snapshot(state, step) -> None:
    """Step ``step``'s snapshot as a crash while writing it leaves it (half its bytes)."""
    path = state / "snapshots" / f"snap-{step:010d}.json"
    text = path.read_text() if path.exists() else '{"sha256": "00", "body": "{}"}'
    path.write_text(text[:len(text) // 2])


@pytest.mark.parametrize("step", [0, 1, 300])
def test_a_restore_to_a_step_whose_snapshot_is_torn_replays_the_log_to_exactly_it(demo, tmp_path,
                                                                                    step):
    journal = _started_with_commits(demo, tmp_path, range(step + 5))
    _tear_snapshot(tmp_path, step)
    state, offset = open_state(journal, CONFIG, restore_step=step)
    assert state.next_step == step
    # line 0 is the start, line k the commit of step k-1: step `step` is next after line `step`
    assert offset == _line_ends(tmp_path)[step]


def test_a_restore_to_a_step_the_log_jumps_over_or_never_reaches_is_refused(demo, tmp_path):
    # step 2 committed before step 1: the log goes from step 1 straight to step 3, then 4
    journal = _started_with_commits(demo, tmp_path, [0, 2, 1, 3])
    size = (tmp_path / "wal.jsonl").stat().st_size
    for step, reaches in [(2, 3), (9, 4), (-1, 0)]:  # plane serve --restore-step takes any int
        with pytest.raises(UserError) as refused:
            DataPlane(demo / "mix.yaml", tmp_path, CONFIG, restore_step=step)
        assert str(refused.value) == (
            f"{journal.wal}: no snapshot of step {step} verifies and the log does not stop at "
            f"it (it reaches step {reaches})")
    assert (tmp_path / "wal.jsonl").stat().st_size == size  # nothing rolled back


def test_a_log_holding_only_the_start_reopens_at_step_0(demo, tmp_path):
    """A crash between the start record and step 0's snapshot: nothing was committed."""
    plane = DataPlane(demo / "mix.yaml", tmp_path / "a", CONFIG)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for snapshot in (tmp_path / "b" / "snapshots").glob("snap-*.json"):
        snapshot.unlink()
    reopened = DataPlane(demo / "mix.yaml", tmp_path / "b", CONFIG)
    assert reopened.next_step == 0
    assert _plans(reopened, [0, 1]) == _plans(plane, [0, 1])


@pytest.mark.parametrize("kind", ["commit", "suspect"])  # sorting before and after "start"
def test_a_log_that_does_not_begin_with_the_start_is_refused(tmp_path, kind):
    Journal(tmp_path).append({"t": kind, "step": 0})
    with pytest.raises(UserError) as refused:
        DataPlane(None, tmp_path, CONFIG)
    assert str(refused.value) == (f"{tmp_path / 'wal.jsonl'}: the first record is {kind!r}, "
                                  "not the job's start (written by an older OmniScale?)")


@pytest.mark.parametrize("name, value, flag", [
    ("balance", "strided", "--balance"),
    ("epsilon", 0.1, "--epsilon"),
    ("micro_batch_tokens", 4096, "--micro-batch-tokens"),
    ("frozen_encoders", ("image",), "frozen encoders (optim.groups)"),
])
def test_a_changed_planning_setting_is_refused_naming_it_as_the_user_sets_it(name, value, flag):
    start = {"config": json.loads(json.dumps(dataclasses.asdict(CONFIG)))}  # as logged
    check_settings(start, CONFIG)
    with pytest.raises(UserError) as refused:
        check_settings(start, dataclasses.replace(CONFIG, **{name: value}))
    was = getattr(CONFIG, name)
    assert str(refused.value) == (f"{flag} {value}: this state dir was planned with {was} "
                                  "(only --dp may change on a restart)")


def test_a_state_dir_planned_before_heads_by_speed_says_how_to_resume_it():
    """A start record without ``attention_heads`` (written before it existed) was planned with
    H/k heads: a trainer's plane that would size heads by speed is refused in one line naming
    the run setting that resumes it; with heads left to H/k it is accepted."""
    start = {"config": json.loads(json.dumps(dataclasses.asdict(CONFIG)))}
    del start["config"]["attention_heads"]
    check_settings(start, CONFIG)
    with pytest.raises(UserError) as refused:
        check_settings(start, dataclasses.replace(CONFIG, attention_heads=4))
    assert str(refused.value) == (
        "--attention-heads 4: this state dir was planned with 0 (only --dp may change on a "
        "restart; a run's plane: --set data.heads_by_speed=false resumes it with H/k heads)")
