"""The long-tail bench's interleaved schedule (tools/bench/long_tail_turns.py) on hand-made
runs: each policy's figures over its turns in the round's runs, every step's prediction scaled
by the speed of the run it ran in, a contended run run again."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from omniscale.tools.bench import e2e_interleave, long_tail_turns
from omniscale.tools.bench.long_tail_model import AT_RUN_SPEED, RATE

POLICIES = ["omniscale", "static_sp"]
# warm-up 2 (window 0: steps 0-1), window 2, one cycle: windows 1 and 2 measured (steps 2-5)
ARGS = argparse.Namespace(warmup=2, window=2, rounds=1, retries=1, max_foreign=0.1,
                          wait_quiet_s=0.0, rotations=None)
# the prediction per policy: 1 s a measured step (ours) or 2 s (static), 100 tokens (102
# padded by static's splits); the warm-up step 1 predicted at 1 s for both
PREDICTED = {p: {"tokens_per_step": [100] * 4, "tokens_padded_per_step": [pad] * 4,
                 "step_s": [s] * 4, "speed_step_s": [1.0],
                 "speed_tokens_padded_per_step": [pad]}
             for p, s, pad in (("omniscale", 1.0, 100), ("static_sp", 2.0, 102))}
# measured: run 0 runs at the model's speed, run 1 at half of it (every step twice as long)
RUN_SLOWNESS = [1.0, 2.0]


def _rows(order: list[str], slowness: float) -> list[dict]:
    rows = []
    for step in range(6):
        policy = order[(step // 2) % 2]
        pad = PREDICTED[policy]["tokens_padded_per_step"][0]
        predicted = 1.0 if step < 2 else PREDICTED[policy]["step_s"][0]
        rows.append({"step": step, "balance": policy, "step_s": predicted * slowness,
                     "tokens": pad, "loss": 1.0, "imbalance_measured": 1.0,
                     "imbalance_predicted": 1.0, "micro_batches": 2,
                     "rank_compute_s": [predicted * slowness] * 2})
    return rows


def test_each_policy_over_its_turns_with_each_run_s_speed(monkeypatch, tmp_path):
    shares = iter([0.5, 0.0, 0.0])  # the first attempt of run 0 contended: run again

    class Contention:
        def __enter__(self):
            self.share = next(shares)
            return self

        def __exit__(self, *_):
            return False

    monkeypatch.setattr(e2e_interleave, "Contention", Contention)
    monkeypatch.setattr(e2e_interleave, "wait_quiet", lambda *a: {"waited_s": 0.0})
    runs = []

    def train(policy, spec, out, args, sets):
        order = sets["data.balance_interleave"].strip("[]").split(",")
        runs.append(order)
        return _rows(order, RUN_SLOWNESS[0 if len(runs) <= 2 else 1])

    got = long_tail_turns.turns_round(0, POLICIES, Path("spec"), tmp_path, ARGS, PREDICTED,
                                      train)
    assert runs == [POLICIES, POLICIES, POLICIES[::-1]]  # run 0 twice (contended), then run 1
    assert got["runs_each"][0]["discarded_contended_runs"][0]["foreign_cpu_share"] == 0.5
    ours, static = got["runs"]["omniscale"], got["runs"]["static_sp"]
    # run 0 plans window 1 by static, window 2 by ours; run 1 the other way round. Ours:
    # window 1 in run 1 (2 steps of 2 s), window 2 in run 0 (2 steps of 1 s): 6 s
    assert ours["step_s"] == [2.0, 2.0, 1.0, 1.0]
    assert ours[RATE] == pytest.approx(400 / 6)
    assert static[RATE] == pytest.approx(400 / 12)  # 2 s a step in run 0, 4 s in run 1
    assert ours["tokens_as_predicted"] and static["tokens_as_predicted"]
    # as calibrated: 6 s for 4 predicted; at each run's speed (1 and 2): exactly the model
    assert ours["measured_over_predicted"] == pytest.approx(1.5)
    assert ours[f"measured_over_predicted{AT_RUN_SPEED}"] == pytest.approx(1.0)
    assert ours[f"step_measured_over_predicted{AT_RUN_SPEED}"] == pytest.approx([1.0] * 4)
    assert ours["run_speed_scale"] == pytest.approx(1.5)
    # each run's warm-up trained what its first policy's plan predicted (static's padding in
    # run 1)
    assert ours["speed_steps_tokens_as_predicted"] is True
    assert not ours["contended"]


def test_turns_that_cover_other_steps_are_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(e2e_interleave, "wait_quiet", lambda *a: {"waited_s": 0.0})

    def train(policy, spec, out, args, sets):
        rows = _rows(POLICIES, 1.0)
        return [r for r in rows if not (r["balance"] == "static_sp" and r["step"] == 5)]

    with pytest.raises(SystemExit, match="covered different steps"):
        long_tail_turns.turns_round(0, POLICIES, Path("spec"), tmp_path, ARGS, PREDICTED,
                                    train)


class _Quiet:
    """A run during which no other process took the CPUs."""
    share = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def test_one_rotation_is_one_run_each_policy_on_its_own_windows(monkeypatch, tmp_path):
    """``--rotations 1`` (the quick check): the round is the first run alone, so each policy
    holds only the windows that run gave it -- not refused as "other steps"."""
    monkeypatch.setattr(e2e_interleave, "wait_quiet", lambda *a: {"waited_s": 0.0})
    monkeypatch.setattr(e2e_interleave, "Contention", _Quiet)  # no run again, whatever runs
    runs = []

    def train(policy, spec, out, args, sets):
        runs.append(sets["data.balance_interleave"])
        return _rows(sets["data.balance_interleave"].strip("[]").split(","), 1.0)

    args = argparse.Namespace(**{**vars(ARGS), "rotations": 1})
    got = long_tail_turns.turns_round(1, POLICIES, Path("spec"), tmp_path, args, PREDICTED,
                                      train)
    assert runs == ["[static_sp,omniscale]"]  # round 1's first rotation, and no other run
    # window 1 (steps 2-3) by static, window 2 (steps 4-5) by ours
    assert got["runs"]["omniscale"]["step_s"] == [1.0, 1.0]
    assert got["runs"]["static_sp"]["step_s"] == [2.0, 2.0]
    with pytest.raises(SystemExit, match="covered different steps"):  # a whole round still is
        long_tail_turns.turns_round(1, POLICIES, Path("spec"), tmp_path,
                                    argparse.Namespace(**{**vars(ARGS), "rotations": 2}),
                                    PREDICTED, lambda *a, **k: _rows(POLICIES, 1.0))
