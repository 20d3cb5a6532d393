"""The data plane in one process: restart, resize, roll back, reload, refuse -- and the audit
proves nothing was lost or repeated. (tests/dataplane/test_plane_faults.py does the same with
real processes and kill -9.)"""

from __future__ import annotations

import dataclasses
import json

import pytest

from omniscale.dataplane.actions import RequestError
from omniscale.dataplane.audit import audit_state_dir
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.errors import UserError
from omniscale.plan import plan_metadata
from tests.dataplane.plane_steps import commit_step

CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=2, snapshot_every=4)



def train(plane: DataPlane, start: int, stop: int) -> dict[int, list]:
    """Fetch every rank's plan of steps [start, stop) and commit them; returns the plans."""
    plans = {}
    for step in range(start, stop):
        plans[step] = [plane.get_plan(step, r) for r in range(plane.dp_at(step))]
        commit_step(plane, step)
    return plans


def keys(tables) -> list:
    """The samples the tables train (an SP-split sample once)."""
    return sorted({(t["source"], t["shard"], t["key"])
                   for table in tables for t in table.to_pylist() if t["role"] == "llm"})


def assert_exactly_once(state_dir):
    report = audit_state_dir(state_dir)
    assert (report["duplicated"], report["missing"], report["fingerprint_mismatches"]) == \
        (0, 0, []), report
    return report


def test_restart_serves_the_same_plans(demo, tmp_path):
    first = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    train(first, 0, 6)
    ahead = {s: [first.get_plan(s, r) for r in range(2)] for s in range(6, 12)}
    again = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)  # as after a crash
    assert again.next_step == 6
    for step, tables in ahead.items():
        assert [again.get_plan(step, r) for r in range(2)] == tables
    train(again, 6, 40)
    report = assert_exactly_once(tmp_path)
    assert report["next_step"] == 40 and any(r["epoch"] > 0 for r in report["rows"])


def test_resize_mid_window_keeps_every_sample_once(demo, tmp_path):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    train(plane, 0, 6)  # window 1 is half trained
    rest_of_window = keys(t for s in (6, 7) for t in [plane.get_plan(s, r) for r in range(2)])
    bigger = DataPlane(demo / "mix.yaml", tmp_path, dataclasses.replace(CONFIG, dp=3))
    assert bigger.next_step == 6 and bigger.dp_at(6) == 3 and bigger.dp_at(5) == 2
    replanned = train(bigger, 6, 8)
    assert keys(t for s in (6, 7) for t in replanned[s]) == rest_of_window
    train(bigger, 8, 30)
    with pytest.raises(UserError, match="--dp 1: this job plans samples of up to 16384 tokens"):
        DataPlane(demo / "mix.yaml", tmp_path, dataclasses.replace(CONFIG, dp=1))
    smaller = DataPlane(demo / "mix.yaml", tmp_path, dataclasses.replace(CONFIG, dp=2))
    train(smaller, 30, 41)
    assert_exactly_once(tmp_path)


@pytest.mark.parametrize("policy", ["strided", "first_fit", "token_lpt", "kk_cost"])
def test_baseline_policies_plan_through_the_same_plane(demo, tmp_path, policy):
    """``--balance``: a baseline places each global batch as drawn; restart, resize and the
    audit hold as for the planner, and a restart may not change the policy."""
    config = dataclasses.replace(CONFIG, balance=policy)
    ours = train(DataPlane(demo / "mix.yaml", tmp_path / "ours", CONFIG), 0, 8)
    plane = DataPlane(demo / "mix.yaml", tmp_path / "base", config)
    theirs = train(plane, 0, 6)
    ahead = {s: [plane.get_plan(s, r) for r in range(2)] for s in (6, 7)}
    theirs.update(ahead)
    # the same global batches (the mixer draws them), placed otherwise
    for first in (0, 4):
        window = range(first, first + 4)
        assert keys(t for s in window for t in ours[s]) == \
            keys(t for s in window for t in theirs[s])
    assert any(ours[s] != theirs[s] for s in range(8))
    # ours carry what the best baseline would predict for each global batch as drawn: never
    # more than this baseline's own plan of it, the same when it is the best
    for s in range(8):
        side, plan = plan_metadata(ours[s][0]), plan_metadata(theirs[s][0])
        assert "baseline" not in plan
        assert side["baseline_step_cost"] <= plan["step_max_cost"] * (1 + 1e-12)
        if side["baseline"] == policy:
            assert side["baseline_step_cost"] == pytest.approx(plan["step_max_cost"])
    again = DataPlane(demo / "mix.yaml", tmp_path / "base", config)  # as after a crash
    assert {s: [again.get_plan(s, r) for r in range(2)] for s in (6, 7)} == ahead
    bigger = DataPlane(demo / "mix.yaml", tmp_path / "base", dataclasses.replace(config, dp=3))
    replanned = train(bigger, 6, 8)  # mid-window, on 3 ranks: the same samples per step
    for s in (6, 7):
        assert keys(replanned[s]) == keys(ahead[s])
    train(bigger, 8, 20)
    assert_exactly_once(tmp_path / "base")
    with pytest.raises(UserError, match=f"^--balance omniscale: this state dir was planned "
                                        f"with {policy} "):
        DataPlane(demo / "mix.yaml", tmp_path / "base", dataclasses.replace(CONFIG, dp=3))


def test_interleaved_policies_plan_each_window_as_that_policy_alone(demo, tmp_path):
    """``--interleave``: window k planned by the k-th policy in turn -- exactly the plans a
    plane of that policy alone serves for it (the mixer draws the same windows whoever places
    them); a restart keeps the turns and may not change them."""
    turns = ("token_lpt", "omniscale")
    config = dataclasses.replace(CONFIG, interleave=turns)
    alone = {p: train(DataPlane(demo / "mix.yaml", tmp_path / p,
                                dataclasses.replace(CONFIG, balance=p)), 0, 12) for p in turns}
    plane = DataPlane(demo / "mix.yaml", tmp_path / "ab", config)
    both = train(plane, 0, 6)
    both.update(train(DataPlane(demo / "mix.yaml", tmp_path / "ab", config), 6, 12))
    for step in range(12):
        assert both[step] == alone[turns[step // 4 % 2]][step], step
    assert alone["token_lpt"][4] != alone["omniscale"][4]  # the turns are told apart
    assert_exactly_once(tmp_path / "ab")
    with pytest.raises(UserError, match=r"^--interleave \('omniscale', 'token_lpt'\): this "
                                        r"state dir was planned with \('token_lpt', "):
        DataPlane(demo / "mix.yaml", tmp_path / "ab",
                  dataclasses.replace(CONFIG, interleave=turns[::-1]))
    with pytest.raises(UserError, match="^--interleave omniscale,nope: two or more of "):
        dataclasses.replace(CONFIG, interleave=("omniscale", "nope"))


def test_policy_names_are_the_planner_and_every_baseline():
    import typing

    from omniscale.balancer.baselines import BASELINES_NO_SPLIT, STATIC_LAYOUTS
    from omniscale.dataplane.plane_config import POLICIES
    from omniscale.tools.train.config import DataSection

    assert POLICIES == ("omniscale", *BASELINES_NO_SPLIT, *STATIC_LAYOUTS)
    assert typing.get_args(DataSection.model_fields["balance"].annotation) == POLICIES
    with pytest.raises(UserError, match="^--balance lpt: choose one of omniscale, strided, "):
        dataclasses.replace(CONFIG, balance="lpt")


def test_restore_step_rolls_back_later_commits(demo, tmp_path):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    original = train(plane, 0, 14)  # snapshots at 4, 8, 12
    resumed = DataPlane(demo / "mix.yaml", tmp_path, CONFIG, restore_step=8)
    assert resumed.next_step == 8
    assert train(resumed, 8, 14) == {s: original[s] for s in range(8, 14)}
    assert_exactly_once(tmp_path)
    assert (tmp_path / "snapshots" / "rolled-back").is_dir()


def test_corrupt_latest_snapshot_falls_back(demo, tmp_path, caplog):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    train(plane, 0, 9)
    ahead = plane.get_plan(9, 1)
    latest = max((tmp_path / "snapshots").glob("snap-*.json"))
    latest.write_text(latest.read_text()[:-40])  # half-written
    again = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    assert "corrupt snapshot" in caplog.text
    assert again.next_step == 9 and again.get_plan(9, 1) == ahead


def test_refusals(demo, tmp_path):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    train(plane, 0, 2)
    cases = [(lambda: plane.get_plan(2, 5), "rank 5: step 2 is planned for 2 ranks (0..1)"),
             (lambda: plane.get_plan(1, 0), "step 1 is already committed"),
             (lambda: commit_step(plane, 0), "step 0 is already committed"),
             (lambda: plane.get_plan(500, 0), "step 500 is too far ahead"),
             (lambda: plane.reload(str(demo / "nope.yaml")), "nope.yaml: file not found"),
             (lambda: plane.reload(str(demo / "eval.yaml")), "accounting cannot change"),
             (lambda: plane.snapshot(7), "only the next step to train (2)")]
    for call, message in cases:
        with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
            call()
    # commits must prove the plan: served to the rank, or every rank's fingerprint
    for call, message in [(lambda: plane.commit(2, rank=0), "step 2 was never served to rank 0"),
                          (lambda: plane.commit(2), "a whole-step commit needs plan_fp"),
                          (lambda: plane.commit(2, plan_fp="0" * 16), "plan_fp does not match")]:
        with pytest.raises(RequestError, match=message):
            call()
    assert plane.next_step == 2 and not plane.rank_commits.get(2)
    plane.get_plan(2, 0), plane.get_plan(2, 1)
    plane.commit(2, rank=0)
    with pytest.raises(RequestError, match="rank 0 already committed step 2"):
        plane.commit(2, rank=0)
    assert plane.commit(2, rank=1)["committed"] and plane.next_step == 3


def test_reload_applies_at_a_window_boundary_and_replays(demo, tmp_path):
    spec = json.loads(json.dumps(__import__("yaml").safe_load((demo / "mix.yaml").read_text())))
    spec["sources"] = [s for s in spec["sources"] if s["name"] != "audio_caption"]
    spec.pop("schedule")
    for s in spec["sources"]:
        s["weight"] = 1
    new = demo / "no_audio.yaml"
    new.write_text(__import__("yaml").safe_dump(spec))
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    train(plane, 0, 5)
    reply = plane.reload(str(new))
    assert reply["applies_at_step"] == 8  # step 5 was served: its window (4..7) is kept
    after = train(plane, 5, 16)
    sources = {t["source"] for s in range(8, 16) for table in after[s] for t in table.to_pylist()}
    assert "audio_caption" not in sources and "text" in sources
    ahead = plane.get_plan(16, 0)
    again = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    assert again.get_plan(16, 0) == ahead
    assert_exactly_once(tmp_path)


def test_a_long_run_keeps_only_the_windows_it_still_needs(demo, tmp_path):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    train(plane, 0, 20)  # windows of 4 steps: 0-4 trained
    # the last trained window and those planned ahead; none before it
    assert plane.state.windows and min(plane.state.windows) == 4
    assert plane.state.starts and min(plane.state.starts) == 4
