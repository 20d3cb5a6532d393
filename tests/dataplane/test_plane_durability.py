"""The plane never loses a committed step: torn logs, corrupt snapshots and logs, poisoned
requests and edited specs, on real state dirs (issue 14's list, one test each).

Oracles the plane did not produce: the log is parsed here with plain ``json`` (each line's
``r``), and which steps are committed is counted from those records by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omniscale.dataplane.actions import RequestError
from omniscale.dataplane.audit import audit_state_dir
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.errors import UserError
from omniscale.plan import fingerprint
from tests.dataplane.plane_steps import commit_step

ROOT = Path(__file__).resolve().parents[2]
CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=2, global_batch_tokens=12288,
                     sp_max=2, snapshot_every=100)


def logged(state: Path) -> list[dict]:
    """The log's records, read independently of the journal (complete lines only)."""
    data = (state / "wal.jsonl").read_bytes()
    return [json.loads(line)["r"] for line in data.split(b"\n")[:-1]]


def committed_steps(records: list[dict]) -> int:
    """The next step to train after ``records``: commits counted by hand."""
    done, step = {r["step"] for r in records if r["t"] == "commit"}, 0
    while step in done:
        step += 1
    return step


def assert_clean(state: Path, next_step: int) -> None:
    report = audit_state_dir(state)
    assert report["next_step"] == next_step
    assert (report["duplicated"], report["missing"], report["fingerprint_mismatches"]) == \
        (0, 0, [])


def trained(demo: Path, state: Path, steps: int, config: PlaneConfig = CONFIG) -> DataPlane:
    plane = DataPlane(demo / "mix.yaml", state, config)
    for step in range(plane.next_step, plane.next_step + steps):
        commit_step(plane, step)
    return plane


def test_torn_tail_is_cut_kept_aside_and_later_records_stay_readable(demo, tmp_path):
    plane = trained(demo, tmp_path, 3)
    plane.get_plan(3, 0)
    whole = (tmp_path / "wal.jsonl").read_bytes()
    with open(tmp_path / "wal.jsonl", "ab") as f:
        f.write(b'{"c":"0000abcd","r":{"t":"comm')  # a crash mid-write
    again = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    assert again.next_step == 3
    assert (tmp_path / "wal.jsonl").read_bytes() == whole  # cut before anything appended
    assert (tmp_path / "wal.torn-0.bin").read_bytes().endswith(b'"t":"comm')
    commit_step(again, 3)
    third = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)  # the restart after that
    assert third.next_step == 4 == committed_steps(logged(tmp_path))
    assert_clean(tmp_path, 4)


def test_a_record_whose_newline_was_lost_is_kept(demo, tmp_path):
    trained(demo, tmp_path, 3)
    wal = tmp_path / "wal.jsonl"
    data = wal.read_bytes()
    wal.write_bytes(data[:-1] + b"X")  # the last commit's newline damaged
    assert DataPlane(demo / "mix.yaml", tmp_path, CONFIG).next_step == 3
    assert wal.read_bytes() == data


def test_corruption_inside_the_log_is_refused_in_one_line(demo, tmp_path):
    trained(demo, tmp_path, 3)
    wal = tmp_path / "wal.jsonl"
    data = bytearray(wal.read_bytes())
    second = data.index(b"\n") + 1
    data[second + 30] ^= 0x01  # a flipped bit in record 2 of several
    wal.write_bytes(bytes(data))
    for open_it in (lambda: DataPlane(demo / "mix.yaml", tmp_path, CONFIG),
                    lambda: audit_state_dir(tmp_path)):
        with pytest.raises(UserError, match=r"wal.jsonl: record 2 \(byte \d+\) is corrupt"):
            open_it()
    for command in (["plane", "serve", "--state-dir", str(tmp_path), "--dp", "2",
                     "--global-batch-tokens", "12288", "--micro-batch-tokens", "8192",
                     "--window", "2", "--sp-max", "2"],
                    ["plane", "audit", str(tmp_path)]):
        done = subprocess.run([sys.executable, "-m", "omniscale", *command], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "record 2" in lines[0] and "Traceback" not in done.stderr


def test_every_snapshot_corrupt_replays_the_whole_log(demo, tmp_path, caplog):
    trained(demo, tmp_path, 3)
    [snapshot] = (tmp_path / "snapshots").glob("snap-*.json")  # only step 0's
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0x04
    snapshot.write_bytes(bytes(data))
    again = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    assert "no snapshot verifies; replaying the whole log" in caplog.text
    assert again.next_step == 3  # not step 0 again
    with pytest.raises(RequestError, match="step 0 is already committed"):
        again.get_plan(0, 0)
    commit_step(again, 3)
    assert_clean(tmp_path, 4)


def test_the_committed_step_count_never_goes_backwards(demo, tmp_path):
    plane = trained(demo, tmp_path, 5)
    plane.snapshot()  # the snapshot of step 5 knows 5 steps were committed
    wal = tmp_path / "wal.jsonl"
    lines = wal.read_bytes().split(b"\n")
    wal.write_bytes(b"\n".join(lines[:3]) + b"\n")  # records lost: only 2 commits left
    with pytest.raises(UserError, match="the log lost"):
        DataPlane(demo / "mix.yaml", tmp_path, CONFIG)


def test_poisoned_cost_model_is_refused_before_the_log(demo, tmp_path):
    plane = trained(demo, tmp_path, 2)
    size = (tmp_path / "wal.jsonl").stat().st_size
    for values in ((1e308, 1e308), (float("nan"), 1.0), (-1.0, 1.0), (0.0, 0.0)):
        with pytest.raises(RequestError, match="costs: linear and quadratic must be"):
            plane.set_costs(*values)
    assert (tmp_path / "wal.jsonl").stat().st_size == size
    for step in range(2, 8):  # every later window still plans
        commit_step(plane, step)
    assert DataPlane(demo / "mix.yaml", tmp_path, CONFIG).next_step == 8
    assert_clean(tmp_path, 8)


def test_reload_of_a_source_without_index_changes_nothing(demo, tmp_path):
    plane = trained(demo, tmp_path, 2)
    spec = yaml.safe_load((demo / "mix.yaml").read_text())
    (demo / "train" / "unindexed").mkdir(exist_ok=True)
    spec["sources"].append({**spec["sources"][0], "name": "unindexed",
                            "path": "train/unindexed"})
    (demo / "unindexed.yaml").write_text(yaml.safe_dump(spec))
    before = [plane.get_plan(s, r) for s in range(2, 6) for r in range(2)]
    size = (tmp_path / "wal.jsonl").stat().st_size
    with pytest.raises(RequestError, match="reload .*unindexed.yaml: refused.*no index"):
        plane.reload(str(demo / "unindexed.yaml"))
    assert (tmp_path / "wal.jsonl").stat().st_size == size
    assert [plane.get_plan(s, r) for s in range(2, 6) for r in range(2)] == before
    again = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    assert [again.get_plan(s, r) for s in range(2, 6) for r in range(2)] == before


def test_a_restart_with_an_absurd_dp_is_refused_before_the_log(demo, tmp_path):
    trained(demo, tmp_path, 2)
    size = (tmp_path / "wal.jsonl").stat().st_size
    with pytest.raises(UserError, match="--dp"):
        DataPlane(None, tmp_path, PlaneConfig(**{**CONFIG.__dict__, "dp": 10 ** 9}))
    with pytest.raises(UserError, match="--dp 1: this job plans samples of up to"):
        DataPlane(None, tmp_path, PlaneConfig(**{**CONFIG.__dict__, "dp": 1}))
    assert (tmp_path / "wal.jsonl").stat().st_size == size
    assert DataPlane(None, tmp_path, CONFIG).next_step == 2


def test_a_restart_with_other_planning_settings_is_refused(demo, tmp_path):
    trained(demo, tmp_path, 1)
    with pytest.raises(UserError, match="--micro-batch-tokens 4096: this state dir was "
                                        "planned with 8192"):
        DataPlane(None, tmp_path, PlaneConfig(**{**CONFIG.__dict__,
                                                 "micro_batch_tokens": 4096}))


def test_replay_reads_the_specs_copied_into_the_state_dir(demo, tmp_path):
    spec = tmp_path / "data" / "mix.yaml"
    spec.parent.mkdir()
    text = (demo / "mix.yaml").read_text().replace("path: train/", f"path: {demo}/train/")
    spec.write_text(text.replace("tokenizer: tokenizer.json",
                                 f"tokenizer: {demo}/tokenizer.json"))
    reloaded = spec.with_name("reloaded.yaml")
    doc = yaml.safe_load(spec.read_text())
    doc["schedule"]["segments"] = [{"kind": "const", "start": 0,
                                    "weights": {"text": 1, "image_caption": 3}}]
    reloaded.write_text(yaml.safe_dump(doc))
    hashes = sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in (spec, reloaded))
    state = tmp_path / "state"
    plane = DataPlane(spec, state, CONFIG)
    for step in range(2):
        commit_step(plane, step)
    plane.reload(str(reloaded))
    plans = [plane.get_plan(s, r) for s in range(2, 8) for r in range(2)]
    for step in range(2, 6):
        commit_step(plane, step)
    report = audit_state_dir(state)
    spec.write_text("seed: 99\n")  # history must not change with the files
    reloaded.unlink()
    assert sorted(p.name for p in (state / "specs").iterdir()) == [f"{h}.yaml" for h in hashes]
    again = DataPlane(None, state, CONFIG)
    assert [again.get_plan(s, r) for s in range(6, 8) for r in range(2)] == plans[8:]
    assert audit_state_dir(state) == report


@pytest.mark.timeout(60)
def test_reload_reads_only_small_regular_files_under_the_root_and_echoes_nothing(demo,
                                                                                tmp_path):
    plane = trained(demo, tmp_path / "state", 1)
    fifo = demo / "fifo.yaml"
    if not fifo.exists():
        os.mkfifo(fifo)  # nobody ever writes: opening it to read would block
    big = demo / "big.yaml"
    big.write_bytes(b"#" * (1 << 20) + b"\nseed: 1\n")
    secret = demo / "secret.yaml"
    secret.write_text("hunter2-the-password\n")
    outside = tmp_path / "outside.yaml"
    outside.write_text((demo / "mix.yaml").read_text())
    cases = [(fifo, "not a regular file"), (big, "a spec may have at most 1048576"),
             (outside, "reload reads specs only under"), (demo / "train", "not a regular file"),
             (secret, "secret.yaml: not a valid mixing spec")]
    for path, message in cases:
        with pytest.raises(RequestError) as refused:
            plane.reload(str(path))
        assert message in str(refused.value) and "hunter2" not in str(refused.value)
    bad = demo / "bad-weight.yaml"
    bad.write_text((demo / "mix.yaml").read_text().replace("text: 4", "text: -4", 1))
    with pytest.raises(RequestError, match=r"bad-weight.yaml: schedule\.segments\[0\]\.\S*"
                                           r"text: invalid"):
        plane.reload(str(bad))
    commit_step(plane, 1)  # the plane kept serving


# -- faults at random, over restart cycles ---------------------------------------------------
CYCLE_CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=2, global_batch_tokens=12288,
                           sp_max=2, snapshot_every=3)


def _kept_by_truncation(data: bytes, b: int) -> tuple[list[dict], int]:
    """Records a cut at byte ``b`` leaves, and their bytes (a record cut just before its
    newline is whole)."""
    cut = data[:b]
    end = cut.rfind(b"\n") + 1
    if b < len(data) and data[b:b + 1] == b"\n" and end < b:  # only the newline is gone
        end = b + 1
    text = data[:end]
    return [json.loads(line)["r"] for line in text.split(b"\n")[:-1]], end


def _snapshot_offsets(state: Path) -> list[int]:
    offsets = []
    for path in (state / "snapshots").glob("snap-*.json"):
        try:
            offsets.append(json.loads(json.loads(path.read_text())["body"])["wal_offset"])
        except (ValueError, KeyError):
            pass  # one this test corrupted
    return offsets


def _fault(data_strategy, state: Path) -> tuple[int | None, bool]:
    """Apply one random fault to the stopped plane's state dir. Returns the next step the
    log then implies (None: unchanged) and whether a refusal is the right answer."""
    from hypothesis import strategies as st

    wal = state / "wal.jsonl"
    data = wal.read_bytes()
    kind = data_strategy.draw(st.sampled_from(["kill", "truncate", "flip_log", "flip_snap"]))
    # positions uniform over the file (hypothesis alone would favour its first bytes)
    rng = random.Random(data_strategy.draw(st.integers(0, 2 ** 32)))
    if kind == "truncate":
        # mostly a torn write after the newest snapshot; sometimes anywhere (lost records)
        lo = max(_snapshot_offsets(state), default=0) if rng.random() < 0.7 else 0
        b = rng.randint(lo, len(data))
        records, end = _kept_by_truncation(data, b)
        wal.write_bytes(data[:b])
        lost = not records or any(o > end for o in _snapshot_offsets(state))
        return committed_steps(records), lost
    if kind == "flip_log":
        p = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[p] ^= rng.randint(1, 255)
        wal.write_bytes(bytes(flipped))
        return None, p != len(data) - 1  # only the last newline can be told from damage
    if kind == "flip_snap":
        snaps = sorted((state / "snapshots").glob("snap-*.json"))
        path = data_strategy.draw(st.sampled_from(snaps))
        body = bytearray(path.read_bytes())
        body[rng.randrange(len(body))] ^= rng.randint(1, 255)
        path.write_bytes(bytes(body))
    return None, False


def test_random_kills_truncations_and_flips_never_lose_a_committed_step(demo, tmp_path_factory):
    """Each restart cycle ends in recovery (nothing committed lost, audit clean) or in a
    one-line refusal -- never a traceback, never silent loss."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def cycles(data):
        state = tmp_path_factory.mktemp("cycles")
        expected, refuse = 0, False
        for _ in range(3):
            try:
                plane = DataPlane(demo / "mix.yaml", state, CYCLE_CONFIG)
            except UserError as e:
                assert refuse and "\n" not in str(e), str(e)
                return
            assert not refuse, "a damaged log was accepted"
            assert plane.next_step == expected
            assert_clean(state, expected)
            for step in range(expected, expected + data.draw(st.integers(0, 4))):
                commit_step(plane, step)
            if data.draw(st.booleans()):  # a rank's share of the next step, then a crash
                plan = plane.get_plan(plane.next_step, 0)  # a retry after a restart: same
                plane.commit(plane.next_step, rank=0, plan_fp=fingerprint(plan))
            expected = committed_steps(logged(state))
            implied, refuse = _fault(data, state)
            expected = expected if implied is None else implied

    cycles()


def test_audit_mid_epoch_accounts_for_every_sample_ahead_of_the_cursor(demo, tmp_path):
    """Mid-epoch, "missing 0" must mean something: every servable sample of the epoch is
    committed, in flight or still ahead of the cursor -- counted from the index here."""
    from omniscale.index_schema import read_index

    trained(demo, tmp_path, 6)
    report = audit_state_dir(tmp_path)
    rows = {(r["source"], r["epoch"]): r for r in report["rows"]}
    text = rows[("text", 0)]
    assert text["complete"] is False and text["not_drawn"] > 0 and text["missing"] == 0
    index = read_index(demo / "train" / "text").to_pylist()
    servable = sum(1 for row in index if row["error"] is None)
    assert text["committed"] + text["in_flight"] + text["not_drawn"] == servable


def test_restore_to_a_step_whose_snapshot_is_corrupt_replays_the_log_to_it(demo, tmp_path):
    import shutil

    config = PlaneConfig(**{**CONFIG.__dict__, "snapshot_every": 4})
    trained(demo, tmp_path / "a", 7, config)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    good = DataPlane(None, tmp_path / "a", config, restore_step=4)
    snap = tmp_path / "b" / "snapshots" / "snap-0000000004.json"
    snap.write_bytes(snap.read_bytes()[:-20])  # torn
    replayed = DataPlane(None, tmp_path / "b", config, restore_step=4)
    assert replayed.next_step == good.next_step == 4
    assert [replayed.get_plan(s, r) for s in range(4, 8) for r in range(2)] == \
        [good.get_plan(s, r) for s in range(4, 8) for r in range(2)]
    assert committed_steps(logged(tmp_path / "b")) == 4  # later commits rolled back
    with pytest.raises(UserError, match="no snapshot of step 9 .*reaches step 4"):
        DataPlane(None, tmp_path / "b", config, restore_step=9)
