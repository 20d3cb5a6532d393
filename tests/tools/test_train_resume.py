"""``omniscale train --resume`` with real runs on the tiny demo (issue #9).

* Same ``--nproc``: on CPU in deterministic mode, the 8 steps after the checkpoint train
  exactly what an uninterrupted run trains -- every row's loss and gradient norm equal, bit for
  bit. The checkpoint is mid-window (the plane's ``data.window`` is 4 steps). The same on 2
  processes under FSDP with DataLoader worker processes decoding (2 → 2).
* Another ``--nproc``, 2 → 1 from a checkpoint at a window boundary and 1 → 2 from one
  mid-window: the plane re-plans the global batches onto the new ranks, so the audit of
  ``RUN_DIR/plane`` finds no sample lost or repeated and every sample trained is a committed
  sample; each step trains the samples the uninterrupted run trains at that step, and the
  losses stay close to its (close, not equal: FSDP sums in another order). Mid-window that
  last part is an expected failure for now: the plane keeps the rest of the window's samples
  but moves them between its steps.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter

import pytest

from omniscale.dataplane.audit import audit_state_dir
from omniscale.dataplane.journal import Journal
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics

WINDOW = 4  # data.window (the default): steps the plane plans together
FIRST = 6  # the checkpoint resumed from: mid-window, so a resize re-plans the rest of a drawn
# window (steps 6, 7) as well as planning later windows for the new ranks
LAST = FIRST + 8  # past two more window starts (8, 12)
CONFIG = "configs/demo_omni.yaml"


def _sets(demo, out, steps, every=FIRST) -> list[str]:
    # Small global batches (one micro-batch per rank at dp 2) keep a step well under a second;
    # decay_steps is fixed so the learning rate does not depend on ``steps``.
    sets = {"data.spec": demo / "mix.yaml", "data.eval_spec": "null", "data.workers": 0,
            "data.global_batch_tokens": 2048, "data.micro_batch_tokens": 2048,
            "optim.warmup_steps": 1, "optim.decay_steps": LAST, "eval.enabled": False,
            "checkpoint_every": every, "steps": steps, "output_dir": out}
    return [f"{k}={v}" for k, v in sets.items()]


@pytest.fixture(scope="module")
def straight(demo, tmp_path_factory):
    """The uninterrupted run: LAST steps on one process."""
    out = tmp_path_factory.mktemp("straight") / "run"
    train(CONFIG, sets=_sets(demo, out, LAST), progress=False)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(LAST))
    return rows


def _audit_clean(run_dir, rows, next_step) -> dict:
    report = audit_state_dir(run_dir / "plane")
    assert report["duplicated"] == 0 and report["missing"] == 0, report
    assert report["fingerprint_mismatches"] == [] and report["next_step"] == next_step, report
    trained = sum(sum(r["mix_samples"].values()) for r in rows)
    assert sum(r["committed"] for r in report["rows"]) == trained > 0, report
    return report


def _fields(row) -> tuple:
    """What one step trained: identical for the same global batch, whatever the ranks."""
    return row["tokens"], row["target_tokens"], row["mix_samples"], row["mix_tokens"]


@pytest.fixture(scope="module")
def part(demo, tmp_path_factory):
    """A run stopped at its checkpoint of step FIRST (one process); tests resume copies."""
    out = tmp_path_factory.mktemp("part") / "run"
    train(CONFIG, sets=_sets(demo, out, FIRST), progress=False)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(FIRST))
    return out


def test_resume_continues_bit_for_bit_over_two_windows(part, straight, tmp_path):
    run = shutil.copytree(part, tmp_path / "run")
    result = train(None, resume=str(run), sets=[f"steps={LAST}"], progress=False)
    assert result["start_step"] == FIRST
    resumed = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(LAST))
    for want, got in zip(straight, resumed):
        assert got["loss"] == want["loss"], (got["step"], got["loss"], want["loss"])
        assert got["grad_norm"] == want["grad_norm"], got["step"]
        assert got["router_loss"] == want["router_loss"], got["step"]
        assert _fields(got) == _fields(want), got["step"]
    _audit_clean(run, resumed, LAST)


def test_two_processes_with_loader_workers_resume_bit_for_bit(demo, tmp_path):
    """2 → 2 processes under FSDP, each rank decoding in a DataLoader worker process
    (``data.loader: workers``): the steps after a mid-window checkpoint equal an uninterrupted
    2-process run's bit for bit (loss, gradient norm, router loss, what each step trained)."""
    first, last = 2, 5  # mid-window, and on past the next window's start (step 4)
    workers = ["data.loader=workers", "data.workers=1"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(CONFIG, nproc=2, sets=_sets(demo, straight, last, first) + workers, progress=False)
    train(CONFIG, nproc=2, sets=_sets(demo, run, first, first) + workers, progress=False)
    result = train(None, nproc=2, resume=str(run), sets=[f"steps={last}"], progress=False)
    assert result["start_step"] == first
    want, got = read_metrics(straight / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(last))
    assert all(len(r["rank_compute_s"]) == 2 for r in got)
    for row in got:  # the step's phases add up to the whole step's clocks, timed apart
        for key, whole in (("rank_phase_wall_s", "rank_wall_s"),
                           ("rank_phase_compute_s", "rank_compute_s")):
            phases = row[key]
            assert list(phases) == ["encode", "backbone", "media_backward", "update"]
            for rank in range(2):
                total = sum(seconds[rank] for seconds in phases.values())
                assert 0.9 * row[whole][rank] - 0.01 <= total <= row[whole][rank] * 1.01 + 0.01, (
                    row["step"], key, rank, total, row[whole][rank])
    for a, b in zip(want, got, strict=True):
        assert (b["loss"], b["grad_norm"], b["router_loss"]) == \
            (a["loss"], a["grad_norm"], a["router_loss"]), b["step"]
        assert _fields(b) == _fields(a), b["step"]
    _audit_clean(run, got, last)


def test_resume_mid_window_from_one_process_on_two(part, straight, tmp_path):
    run = shutil.copytree(part, tmp_path / "run")
    _resume_on_other_nproc(run, FIRST, 2, straight)


def test_resume_from_two_processes_on_one(demo, straight, tmp_path):
    part, first = tmp_path / "part", 4  # a window boundary
    train(CONFIG, nproc=2, sets=_sets(demo, part, first, every=first), progress=False)
    _resume_on_other_nproc(part, first, 1, straight)


def _resume_on_other_nproc(run_dir, first, nproc, straight) -> None:
    end = first + 4
    result = train(None, nproc=nproc, resume=str(run_dir), sets=[f"steps={end}"],
                   progress=False)
    assert result["start_step"] == first
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(end))
    assert [len(r["rank_compute_s"]) for r in rows[first:]] == [nproc] * (end - first)
    dp = [r for _, r in Journal(run_dir / "plane", readonly=True).records() if r["t"] == "dp"]
    assert [(r["step"], r["dp"]) for r in dp] == [(first, nproc)]  # re-planned from there
    _audit_clean(run_dir, rows, end)
    # The rest of the window the checkpoint is in holds the same samples, however re-planned.
    tail = range(first, -(-first // WINDOW) * WINDOW)
    assert _union([rows[s] for s in tail]) == _union([straight[s] for s in tail])
    # ... and each step of it exactly the samples it had (replan_tail keeps steps whole)
    assert [s for s in tail if _fields(rows[s]) != _fields(straight[s])] == []
    # Each step the same samples; losses drift apart only by summation order (measured:
    # relative 3e-4 for the loss by step 7 on 2 → 1). The gradient norm is compared up to the
    # first resumed step: later it drifts by how chaotic the seed's trajectory is (measured
    # at step 7 over seeds 0-5: 0.1-25%), not by what resume restored.
    for want, got in zip(straight, rows):
        assert _fields(got) == _fields(want), got["step"]
        assert math.isclose(got["loss"], want["loss"], rel_tol=2e-3), \
            (got["step"], got["loss"], want["loss"])
        if got["step"] <= first:
            assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=2e-2), got["step"]


def _union(rows) -> tuple:
    samples = Counter()
    for row in rows:
        samples.update(row["mix_samples"])
    return sum(r["tokens"] for r in rows), dict(samples)


def test_resume_auto_continues_a_run_with_a_checkpoint_and_starts_one_without(
        demo, part, straight, tmp_path):
    """``--resume auto`` (what a requeued Slurm job runs): the config's output_dir with a
    checkpoint continues bit for bit; an empty one starts fresh; no CONFIG is one line."""
    from omniscale.errors import UserError

    run = shutil.copytree(part, tmp_path / "run")
    result = train(CONFIG, resume="auto", sets=_sets(demo, run, LAST), progress=False)
    assert result["start_step"] == FIRST
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["loss"] for r in rows] == [r["loss"] for r in straight]

    fresh = tmp_path / "fresh"
    result = train(CONFIG, resume="auto", sets=_sets(demo, fresh, 2), progress=False)
    assert result["start_step"] == 0 and result["steps"] == 2
    with pytest.raises(UserError, match=r"^--resume auto: give CONFIG.yaml too"):
        train(None, resume="auto", progress=False)
