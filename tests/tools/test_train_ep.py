"""``parallel.ep``: the trainer splits every MoE layer's experts over processes. Two processes
with ep=2 train the losses of one process (the gradient norm differs in the 4th digit: the
router's auxiliary loss is a per-rank mean; tests/tools/test_train_sp.py compares EP with one
process on every gradient, aux loss off); their checkpoint of step 2 (all experts,
parallel/dcp.py) resumes in one process without EP and carries on with the same losses; an
impossible ep is one line."""

from __future__ import annotations

import math
import shutil

import pytest

from omniscale.errors import UserError
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import run_omni


def _sets(demo, out, **kw):
    base = {"data.spec": demo / "mix.yaml", "data.eval_spec": demo / "eval.yaml",
            "data.workers": 0, "data.global_batch_tokens": 8192,
            "data.micro_batch_tokens": 4096, "optim.warmup_steps": 1, "optim.decay_steps": 4,
            "eval.enabled": False, "output_dir": out, "steps": 4, "checkpoint_every": 2}
    return [f"{k}={v}" for k, v in {**base, **kw}.items()]


def _close(a, b, loss=1e-5, grad_norm=1e-5):
    for x, y in zip(a, b, strict=True):
        assert math.isclose(x["loss"], y["loss"], rel_tol=loss), (x["loss"], y["loss"])
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=grad_norm), \
            (x["grad_norm"], y["grad_norm"])


def test_expert_parallel_run_matches_and_resumes_in_one_process(demo, tmp_path, omni_one):
    # the one-process reference: run_omni's settings (as _sets, plus a cost refit logged but
    # not applied in a deterministic run, and a gradient dump), shared with test_train_media
    one, _ = omni_one  # 4 steps (tests/tools/conftest.py)
    ep, _ = run_omni(demo, tmp_path / "ep", 2, steps=4, checkpoint_every=2,
                     **{"parallel.ep": 2})
    runs = {"one": one, "ep": ep}
    assert [r["step"] for r in one] == [r["step"] for r in ep] == [0, 1, 2, 3]
    _close(runs["ep"], runs["one"], grad_norm=5e-4)
    # resume the EP run from its step-2 checkpoint in one process without EP
    shutil.rmtree(tmp_path / "ep" / "checkpoints" / "step-000004")
    result = train(None, resume=str(tmp_path / "ep"), sets=["steps=4", "parallel.ep=1"],
                   progress=False)
    assert result["start_step"] == 2
    resumed = read_metrics(tmp_path / "ep" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    _close(resumed, runs["ep"], grad_norm=5e-4)


@pytest.mark.parametrize("nproc, ep, want", [
    (1, 2, "parallel.ep=2: must divide dp_shard·sp = 1"),
    (2, 3, "parallel.ep=3: must divide dp_shard·sp = 2"),
])
def test_impossible_ep_is_one_line(demo, tmp_path, nproc, ep, want):
    with pytest.raises(UserError, match=want.replace("·", ".")):
        train("configs/demo_omni.yaml", nproc=nproc,
              sets=_sets(demo, tmp_path / "bad", **{"parallel.ep": ep}), progress=False)
