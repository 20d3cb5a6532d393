"""The order of a step's collectives across ranks (tools/train/collectives.py): a real 2-rank
run of each task records every rank's collectives (``step_audit.CollectiveRecorder``, switched
on by ``OMNISCALE_RECORD_COLLECTIVES``): the ranks must issue the same ones in the same order
(op, group, the shapes every member passes alike; pipeline sends matched with receives), and
the named ones in the order ``collectives``' docstring lists. One run per task serves every
assertion about it.

The recorder compares after the run, so a rank-dependent collective is reported, not waited
for: the negative test issues one that cannot hang (on a group of one rank) and sees it
caught."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from omniscale.tools.train import collectives
from omniscale.tools.train.launch import train
from omniscale.tools.train.step_audit import (
    RECORD_ENV,
    CollectiveRecorder,
    disagreements,
)
from tests.parallel.multiproc import run_ranks
from tests.tools.train_runs import every_source

STEPS = 2


def _record(demo, out: Path, config: str, spec, **extra) -> list[list[dict]]:
    """Each rank's recorded collectives of a 2-step, 2-rank run: one log interval of two steps,
    a synchronous checkpoint after the last, the guard on."""
    sets = {"data.spec": spec, "data.eval_spec": demo / "eval.yaml", "data.workers": 0,
            "steps": STEPS, "checkpoint_every": 10, "checkpoint.final": True,
            "log_every": STEPS, "output_dir": out, "eval.enabled": False,
            "optim.warmup_steps": 1, "data.global_batch_tokens": 8192,
            "data.micro_batch_tokens": 4096, **extra}
    before = os.environ.get(RECORD_ENV)
    os.environ[RECORD_ENV] = str(out / "collectives")
    try:
        train(config, nproc=2, sets=[f"{k}={v}" for k, v in sets.items()], progress=False)
    finally:
        if before is None:
            os.environ.pop(RECORD_ENV)
        else:
            os.environ[RECORD_ENV] = before
    return [json.loads((out / "collectives" / f"collectives-rank-{r}.json").read_text())
            for r in range(2)]


def _named_per_step(calls: list[dict]) -> list[list[str]]:
    """The ``collectives`` functions each step issued, in order (one name per call of one: a
    function issuing several ops is named once)."""
    steps: list[list[str]] = []
    for call in calls:
        if "mark" in call:
            steps.append([])
            last = None
            continue
        if call["by"] is not None and call["by"] != last:
            steps[-1].append(call["by"])
        last = call["by"]
    return steps


# What each task's step issues by name in these runs (collectives' docstring: 1, 2, 5, 6, then
# at the end of the log interval the flush and the checkpoint's two barriers).
END = ["flush_metrics", "checkpoint_barrier", "checkpoint_barrier"]
EXPECTED = {
    "omni": [["reshard_embeddings", "sum_step_counts", "clip_grad_norm", "guard_verdict"],
             ["reshard_embeddings", "sum_step_counts", "clip_grad_norm", "guard_verdict",
              *END]],
    # the poisoned step 1 is skipped: its samples gathered, no bias update
    "lm_ep": [["sum_step_counts", "clip_grad_norm", "guard_verdict", "sum_expert_loads"],
              ["sum_step_counts", "clip_grad_norm", "guard_verdict", "gather_suspect_samples",
               *END]],
    "lm_pp": [["sum_step_counts", "clip_grad_norm", "guard_verdict"],
              ["sum_step_counts", "clip_grad_norm", "guard_verdict", *END]],
    "video_gen": [["sum_step_counts", "clip_grad_norm", "guard_verdict"],
                  ["sum_step_counts", "clip_grad_norm", "guard_verdict", *END]],
}


@pytest.fixture(scope="module")
def recorded(demo, tmp_path_factory):
    """One recorded run per task, made when a test first asks for it."""
    runs: dict[str, list[list[dict]]] = {}
    root = tmp_path_factory.mktemp("collectives")

    def get(task: str) -> list[list[dict]]:
        if task not in runs:
            out = root / task
            if task == "omni":  # every source: the reshard moves video and audio
                runs[task] = _record(demo, out, "configs/demo_omni.yaml",
                                     every_source(demo, root / "every.yaml"))
            elif task == "lm_ep":
                runs[task] = _record(demo, out, "configs/demo_lm.yaml", demo / "lm.yaml", **{
                    "parallel.ep": 2, "model.overrides.moe.bias_update_rate": 0.001,
                    "debug.poison": "{step: 1, rank: 1, kind: nan}"})
            elif task == "lm_pp":
                runs[task] = _record(demo, out, "configs/demo_lm.yaml", demo / "lm.yaml",
                                     **{"parallel.pp": 2})
            else:
                runs[task] = _record(demo, out, "configs/demo_video_gen.yaml",
                                     demo / "video.yaml")
        return runs[task]
    return get


@pytest.mark.parametrize("task", list(EXPECTED))
def test_ranks_issue_the_same_collectives_in_the_same_order(recorded, task):
    calls = recorded(task)
    assert disagreements(calls) == []
    for rank_calls in calls:
        assert _named_per_step(rank_calls) == EXPECTED[task], task


def test_the_layers_collectives_are_recorded_too(recorded):
    """The recorder sees below the named ones: FSDP's gathers and reduce-scatters, the
    experts' all-to-alls, the pipeline's sends (matched with the peer's receives)."""
    ops = {c["op"] for c in recorded("lm_ep")[0] if "op" in c}
    assert {"_allgather_base_", "_reduce_scatter_base_", "all_to_all_single"} <= ops, ops
    pp = recorded("lm_pp")
    assert any(c.get("op") == "send" for c in pp[0]) and any(c.get("op") == "send"
                                                           for c in pp[1])


_COLLECTIVE_CALL = re.compile(
    r"\bdist\.(all_reduce|all_gather\w*|broadcast\w*|barrier|all_to_all\w*|reduce_scatter\w*"
    r"|gather\w*|scatter\w*|send|recv|isend|irecv|batch_isend_irecv)\(")


def test_step_modules_issue_collectives_only_through_the_named_ones():
    """Outside ``collectives.py`` no trainer module calls a ``torch.distributed`` collective:
    the order stays readable in one place."""
    here = Path(collectives.__file__).parent
    offenders = [f"{path.name}:{n}" for path in sorted(here.glob("*.py"))
                 if path.name != "collectives.py"
                 for n, line in enumerate(path.read_text().splitlines(), start=1)
                 if _COLLECTIVE_CALL.search(line)]
    assert offenders == []


def _rank_dependent_extra(rank, world):
    own = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    recorder = CollectiveRecorder()
    with recorder:
        recorder.mark("step 0")
        dist.all_reduce(torch.ones(2))
        if rank == 1:  # a group of one: returns at once, so nothing waits for it
            dist.all_reduce(torch.ones(3), group=own[rank])
        dist.all_reduce(torch.ones(2))
    return recorder.calls


def test_a_rank_dependent_collective_is_caught_not_waited_for():
    calls = run_ranks(_rank_dependent_extra, 2)
    problems = disagreements(calls)
    assert len(problems) == 1 and "call 2" in problems[0], problems
    assert "ranks [0, 1] [[2]]" in problems[0] and "ranks [1] [[3]]" in problems[0], problems
    # the same sequences on both ranks agree
    assert disagreements([calls[0], calls[0]]) == []
