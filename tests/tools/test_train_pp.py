"""Pipeline parallelism through ``omniscale train`` (the lm task, parallel.pp > 1): the stages
train what one process does, under both schedules, and a pipelined checkpoint resumes without
pipelining. The pipelined runs log every 2 steps (one reduction per interval), the reference
every step: the rows must agree all the same.

Every micro-batch a stage runs is padded to the token budget and padding tokens reach the
routers, so the router losses are off here (tools/train/pipeline_step.py); the cross-entropy,
the loss per source and every parameter's gradient must match one process."""

from __future__ import annotations

import json
import math

import pytest
import torch

from omniscale.tools.train.config import load_config
from omniscale.tools.train.evaluate import evaluate_run
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import TINY_MOE, assert_same_gradients

DUMP = 1  # a step after one update: the stages' optimizer steps agree too
EVAL = {"eval.enabled": True, "eval.max_samples": 6}  # the held-out text of demo/eval.yaml


def _run(demo, out, nproc, **extra):
    sets = {"data.spec": demo / "lm.yaml", "data.eval_spec": demo / "eval.yaml",
            "data.workers": 0, "steps": 3,
            "checkpoint_every": 3, "output_dir": out, "eval.enabled": False,
            "optim.warmup_steps": 1, "optim.decay_steps": 4, "debug.dump_grads_at_step": DUMP,
            "model.overrides.tie_embeddings": "false",  # stage 0 would hold the LM head
            "model.overrides.moe": TINY_MOE + ", aux_loss_coef: 0, z_loss_coef: 0}", **extra}
    train("configs/demo_lm.yaml", nproc=nproc, sets=[f"{k}={v}" for k, v in sets.items()],
          progress=False)
    return (read_metrics(out / "metrics.jsonl"),
            torch.load(out / f"grads-step-{DUMP}.pt", weights_only=True))


def _evaluated_as_one_process(run, step: int) -> None:
    """The ranks' held-out evaluation of the last step (forward only through the stages,
    ``PipelineRunner.evaluate``) is one process's evaluation of the same checkpoint on the
    whole model (``evaluate_run``)."""
    final = json.loads((run / "eval.json").read_text())
    assert final["step"] == step and final["eval"] and \
        all(r["tokens"] > 0 for r in final["eval"].values())
    cfg, _ = load_config(run / "config.yaml")
    assert evaluate_run(cfg, run, verbose=False) == final["eval"]


@pytest.fixture(scope="module")
def one(demo, tmp_path_factory):
    return _run(demo, tmp_path_factory.mktemp("pp-one") / "one", 1, steps=4)


def _same_rows(one, pp) -> None:
    for a, b in zip(one, pp, strict=False):
        assert a["tokens"] == b["tokens"] and a["mix_samples"] == b["mix_samples"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-6), a["step"]
        assert a["source_loss"].keys() == b["source_loss"].keys()
        for name, value in a["source_loss"].items():
            assert math.isclose(value, b["source_loss"][name], rel_tol=1e-5), name


def test_1f1b_over_pp2_x_dp_shard2_trains_what_one_process_does_and_resumes_without(
        demo, tmp_path, one):
    rows_one, g_one = one
    # log_every 2: steps 0-1 reduced and logged together, step 2 at the checkpoint
    rows, grads = _run(demo, tmp_path / "pp", 4, log_every=2, **{
        "parallel.pp": 2, "parallel.dp_shard": 2, "parallel.pp_schedule": "1f1b",
        "parallel.pp_microbatches": 2, **EVAL})
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["checkpoint"] == 3
    _same_rows(rows_one, rows)
    assert_same_gradients(g_one, grads, trained=("decoder.layers.0.", "decoder.layers.1.",
                                                 "decoder.lm_head.", "decoder.embed_tokens."))
    # expert loads: every MoE layer's, each stage's own rows (padding tokens included)
    assert len(rows[0]["expert_load"]) == len(rows_one[0]["expert_load"])
    _evaluated_as_one_process(tmp_path / "pp", 3)  # each data rank its slice, 1F1B
    result = train(None, resume=str(tmp_path / "pp"), progress=False,
                   sets=["steps=4", "parallel.pp=1", "parallel.dp_shard=-1"])
    assert result["start_step"] == 3
    resumed = read_metrics(tmp_path / "pp" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert math.isclose(resumed[3]["loss"], rows_one[3]["loss"], rel_tol=1e-5), \
        (resumed[3]["loss"], rows_one[3]["loss"])


def test_gpipe_over_two_stages_trains_and_evaluates_what_one_process_does(demo, tmp_path, one):
    """Also the held-out evaluation after each step, forward only through the stages
    (``PipelineRunner.evaluate``): the last stage's counts equal one process's evaluation of
    the same checkpoint on the whole model (``evaluate_run``)."""
    rows_one, g_one = one
    run = tmp_path / "gpipe"
    rows, grads = _run(demo, run, 2, steps=2, checkpoint_every=2, **{
        "parallel.pp": 2, "parallel.pp_schedule": "gpipe", "parallel.pp_microbatches": 3,
        **EVAL, "eval.every": 1})
    _same_rows(rows_one, rows)
    assert_same_gradients(g_one, grads, trained=("decoder.layers.0.", "decoder.layers.1."))
    assert all("eval" in r for r in rows)
    _evaluated_as_one_process(run, 2)


def test_pipeline_stages_refuse_the_omni_task_in_one_line(demo, tmp_path):
    from omniscale.errors import UserError

    with pytest.raises(UserError, match=r"^parallel.pp=2: pipeline stages run the lm task only"):
        train("configs/demo_omni.yaml", nproc=1, progress=False, sets=[
            f"data.spec={demo / 'mix.yaml'}", f"output_dir={tmp_path / 'x'}",
            "parallel.pp=2", "data.workers=0", "eval.enabled=false"])
