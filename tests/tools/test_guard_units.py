"""The update guard's rules one by one (``tools.train.guard``), on a real one-rank gloo group
(the verdict is an all-reduce): a non-finite gradient norm with a finite loss is not applied,
the skip streak restarts after an applied step, and a resumed run's guard judges its first
step against the losses of the steps before the crash, as the uninterrupted run's guard did
(issue #46, item 1). The edges after them (a streak from the first step, a step with one or no
target tokens, the median's index, a resume at step 1 or without metrics, the stop line, which
rank reports suspects) are each a case the mutation run (issue #46, item 3) found no test for.
The router-bias rule is in ``test_guard_router_bias.py`` (a real run)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from omniscale.errors import UserError
from omniscale.refs import SampleRef
from omniscale.tools.train.config import GuardSection, load_config
from omniscale.tools.train.guard import (
    UpdateGuard,
    guarded_update,
    report_suspects,
    seeded,
    step_samples,
)
from omniscale.tools.train.step import RunState, StepEnv

FINITE_NORM = torch.tensor(0.5)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    """A real one-rank gloo process group for the guard's all-reduce."""
    store = tmp_path_factory.mktemp("guard-group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _judge(guard: UpdateGuard, loss: float, grad_norm: torch.Tensor = FINITE_NORM):
    """The verdict on a step whose mean loss is ``loss`` (a loss sum of ``loss * 10`` over 10
    target tokens)."""
    return guard.judge(torch.tensor(loss * 10.0), 10, grad_norm)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


@pytest.mark.parametrize("bad_norm", [float("inf"), float("nan")])
def test_a_non_finite_gradient_norm_with_a_finite_loss_is_not_applied(bad_norm):
    guard = UpdateGuard(GuardSection(min_history=2))
    for loss in (1.0, 1.1, 0.9):
        assert _judge(guard, loss) is None
    model, optimizer = _model_and_optimizer()
    model(torch.ones(3, 4)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # the loss is ordinary (no spike, finite): only the gradient norm says no
    reason = guarded_update(guard, optimizer, torch.tensor(10.0), 10,
                            torch.tensor(bad_norm))
    assert reason is not None and reason.startswith("gradient norm ")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert optimizer.state == {}  # no AdamW moments, no step count
    assert all(p.grad is None for p in model.parameters())  # the step's gradients dropped
    assert guard.skipped_in_a_row == 1
    assert list(guard.losses) == [1.0, 1.1, 0.9]  # the loss of a skipped step is not history


def test_a_finite_gradient_norm_and_loss_are_applied():
    """The other side of the test above: the same step with a finite norm is applied."""
    guard = UpdateGuard(GuardSection(min_history=2))
    model, optimizer = _model_and_optimizer()
    model(torch.ones(3, 4)).sum().backward()
    before = model.weight.detach().clone()
    assert guarded_update(guard, optimizer, torch.tensor(10.0), 10, FINITE_NORM) is None
    assert not torch.equal(before, model.weight)
    assert guard.skipped_in_a_row == 0 and list(guard.losses) == [1.0]


def test_the_skip_streak_restarts_after_an_applied_step():
    guard = UpdateGuard(GuardSection(min_history=1, max_skipped_steps=2))
    assert _judge(guard, 1.0) is None
    assert _judge(guard, math.nan) is not None  # skip
    assert guard.skipped_in_a_row == 1 and not guard.stops_run
    assert _judge(guard, 1.0) is None  # apply
    assert guard.skipped_in_a_row == 0
    assert _judge(guard, 1.0, torch.tensor(math.inf)) is not None  # skip again
    # one skip in a row, not two: the limit of 2 is not reached
    assert guard.skipped_in_a_row == 1 and not guard.stops_run
    assert _judge(guard, math.nan) is not None  # a second skip in a row does reach it
    assert guard.skipped_in_a_row == 2 and guard.stops_run


LOSSES = [2.0, 1.9, 1.8, 30.0, 1.7, 1.6, 1.5, 1.5, 1.4, 1.4, 1.3, 1.3]
CRASH = 10  # the resumed run starts at this step (its checkpoint's): 2 steps replayed,
# fewer than min_history, so only a seeded history can judge the first step after them
AFTER = [7.5, 1.2, 1.2, 6.8, 1.1]  # steps CRASH.. of both runs


def _uninterrupted(cfg) -> tuple[list, list]:
    """The metrics rows the uninterrupted run logs for LOSSES (as ``records`` writes them: a
    skipped step keeps its loss and says why) and the guard's verdicts on AFTER after it."""
    guard = UpdateGuard(cfg)
    rows = []
    for step, loss in enumerate(LOSSES):
        reason = _judge(guard, loss)
        rows.append({"step": step, "loss": loss, "tokens": 10,
                     **({"update_skipped": reason} if reason else {})})
    return rows, [_judge(guard, loss) for loss in AFTER]


def _resumed_verdicts(guard: UpdateGuard) -> list:
    return [_judge(guard, loss) for loss in LOSSES[CRASH:] + AFTER][len(LOSSES) - CRASH:]


def test_a_resumed_guard_judges_as_the_uninterrupted_one(tmp_path):
    cfg = GuardSection(min_history=3, spike_window=4)
    rows, expected = _uninterrupted(cfg)
    assert "update_skipped" in rows[3]  # the 30.0 spike was skipped there
    # the crashed run had logged steps past its last checkpoint: the resume replays them
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    guard = seeded(cfg, metrics, CRASH)
    # hand-computed: the last 4 applied losses before step CRASH (step 3's spike excluded)
    assert list(guard.losses) == [1.5, 1.5, 1.4, 1.4]
    verdicts = _resumed_verdicts(guard)
    assert verdicts == expected
    assert [v is not None for v in expected] == [True, False, False, True, False]


def test_the_first_step_after_a_resume_is_judged_against_the_history(tmp_path):
    """Through ``RunState.start``, as the trainer starts a resumed run: a spike at the
    resumed step itself is caught at once, not after ``min_history`` new steps."""
    cfg, _ = load_config(None, ["data.spec=unused.yaml", "guard.min_history=3"])
    env = StepEnv(cfg=cfg, world=1, rank=0, sources=("text",), flops_alpha=0.0,
                  flops_beta=0.0, peak_flops=None)
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(5)))
    guard = RunState.start(env, tmp_path, start_step=5).guard
    reason = _judge(guard, 5.5)  # 5.5 > 5 x the median 1.0 of steps 0-4
    assert reason is not None and "above 5 x the median 1" in reason
    # a fresh run (step 0) has no history: the same loss is applied
    fresh = RunState.start(env, tmp_path, start_step=0).guard
    assert _judge(fresh, 5.5) is None


# -- edges ------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [1, 2, 300])  # 300: past the ints CPython keeps one copy of
def test_a_run_skipping_from_its_first_step_stops_at_exactly_the_limit(limit):
    """No step applied before the skips (nothing reset the streak): the run stops at the
    ``limit``-th skip, not one earlier or later, and stays stopped if judged again."""
    guard = UpdateGuard(GuardSection(max_skipped_steps=limit))
    for _ in range(limit - 1):
        assert _judge(guard, math.nan) is not None and not guard.stops_run
    assert _judge(guard, math.nan) is not None and guard.stops_run
    with pytest.raises(UserError, match=f"^guard: {limit} steps in a row not applied"):
        guard.stop(limit - 1, "loss nan", Path("run"))
    assert _judge(guard, math.inf) is not None and guard.stops_run  # past the limit: still


@pytest.mark.parametrize("target_tokens", [0, 1])
def test_the_loss_of_a_step_with_one_or_no_target_tokens_is_its_sum(target_tokens):
    """A loss sum of 6 over 1 target token is a mean loss of 6, and so is one over none (the
    divisor's floor of 1 keeps it finite): both are above 5 x the median 1 of the history."""
    guard = UpdateGuard(GuardSection(min_history=1), [1.0])
    reason = guard.judge(torch.tensor(6.0), target_tokens, FINITE_NORM)
    assert reason == "loss 6 above 5 x the median 1 of the last 1 steps"


@pytest.mark.parametrize("history", [[100.0, 3.0, 1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0],
                                     [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]])
def test_the_spike_threshold_is_spike_factor_times_the_upper_median(history):
    """Histories of distinct values, not in order: the median the guard uses is
    ``statistics.median_high`` (for an even count, the upper of the two middle values), so a
    loss just below 5 x it, or exactly at it, is applied and one just above is not."""
    median = statistics.median_high(history)
    cfg = GuardSection(min_history=1)
    assert _judge(UpdateGuard(cfg, history), 5 * median - 0.5) is None
    assert _judge(UpdateGuard(cfg, history), 5 * median) is None  # at it, not above: applied
    reason = _judge(UpdateGuard(cfg, history), 5 * median + 0.5)
    assert reason is not None and f"the median {median:g} of the last {len(history)}" in reason


def test_the_stop_line_names_the_plane_state_dir_of_the_run(tmp_path):
    guard = UpdateGuard(GuardSection(max_skipped_steps=1))
    assert _judge(guard, math.nan) is not None and guard.stops_run
    with pytest.raises(UserError) as stopped:
        guard.stop(7, "loss nan", tmp_path / "run")
    message = str(stopped.value)
    assert "(step 7: loss nan)" in message and "\n" not in message
    assert f"state dir {tmp_path / 'run' / 'plane'})" in message


def test_a_resume_at_step_1_judges_its_first_step_against_step_0(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    guard = seeded(GuardSection(min_history=1), metrics, 1)
    assert _judge(guard, 5.5) is not None  # 5.5 > 5 x step 0's loss 1.0


def test_a_resumed_run_without_metrics_starts_with_no_history(tmp_path):
    """A run dir whose metrics.jsonl is gone (or never written) resumes with an empty
    history, as a fresh run does: no spike verdict until ``min_history`` applied steps."""
    guard = seeded(GuardSection(min_history=1), tmp_path / "metrics.jsonl", 5)
    assert list(guard.losses) == []
    assert _judge(guard, 100.0) is None


def _ref(key: str, epoch: int = 0) -> SampleRef:
    return SampleRef(source_id=0, source="text", shard="shard-0.jsonl", key=key, offset=0,
                     size=10, epoch=epoch)


# One rank's part of a step: a micro-batch with a padding slot (None), a placeholder
# micro-batch (no refs at all) and a sample seen again in a later epoch.
BATCH = SimpleNamespace(micro_batches=[
    SimpleNamespace(seq_refs=[_ref("a"), None, _ref("b")]),
    SimpleNamespace(seq_refs=None),
    SimpleNamespace(seq_refs=[_ref("a", epoch=1)]),
])
BATCH_SAMPLES = [("text", "shard-0.jsonl", "a", 0), ("text", "shard-0.jsonl", "a", 1),
                 ("text", "shard-0.jsonl", "b", 0)]


def test_step_samples_lists_every_sample_of_the_step_and_no_padding():
    assert step_samples(BATCH) == set(BATCH_SAMPLES)


class FakePlane:
    """``PlaneSession.report_suspect``'s side: what it was told."""

    def __init__(self) -> None:
        self.reports = []

    def report_suspect(self, step, samples, reason):
        self.reports.append((step, samples, reason))


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_reports_a_skipped_steps_samples(rank, capsys):
    """Every rank gathers (a collective); rank 0 alone tells the plane, once, so the plane
    hears each suspect sample once however many ranks there are."""
    plane = FakePlane()
    report_suspects(plane, 4, BATCH, "loss nan", rank)
    if rank == 0:
        samples = [dict(zip(("source", "shard", "key", "epoch"), s)) for s in BATCH_SAMPLES]
        assert plane.reports == [(4, samples, "loss nan")]
        assert "its 3 samples reported to the plane as suspect" in capsys.readouterr().out
    else:
        assert plane.reports == [] and capsys.readouterr().out == ""
