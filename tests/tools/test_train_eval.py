"""Evaluation during training (``eval.every``, ``tools.train.held_out``): on 2 processes each
data rank scores its slice of the held-out set on the sharded model (FSDP with sequence and
expert parallelism here; tensor parallelism in test_train_layouts.py, pipeline stages in
test_train_pp.py), and the results equal one process's evaluation of the same checkpoint on
the whole unsharded model (``evaluate.evaluate_run``, the independent path); they are logged
in the metrics rows and are the run's final evaluation; evaluating does not change what the
run trains."""

from __future__ import annotations

import json

import pytest

from omniscale.tools.train.config import load_config
from omniscale.tools.train.evaluate import evaluate_run
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import demo_sets


def _sets(demo, out, **extra) -> list[str]:
    return demo_sets(demo, out, **{"data.global_batch_tokens": 4096,
                                   "data.micro_batch_tokens": 2048, "eval.enabled": True,
                                   "eval.max_samples": 6, **extra})


def test_two_ranks_evaluate_what_one_process_does(demo, tmp_path):
    run = tmp_path / "run"
    result = train("configs/demo_omni.yaml", nproc=2, progress=False, sets=_sets(
        demo, run, steps=4, checkpoint_every=4, **{"eval.every": 2, "parallel.sp": 2,
                                                   "parallel.ep": 2}))
    rows = read_metrics(run / "metrics.jsonl")
    assert ["eval" in r for r in rows] == [False, True, False, True]
    final = result["eval"]
    assert set(final) == {"image_caption", "video_caption", "audio_caption"}
    assert all(r["tokens"] > 0 and r["samples"] >= 6 for r in final.values())
    assert json.loads((run / "eval.json").read_text()) == {"step": 4, "eval": final}
    assert rows[3]["eval"] == {f"{s}/{k}": v for s, r in final.items() for k, v in r.items()}
    # one process, the unsharded model loaded from the step-4 checkpoint, the whole set
    cfg, _ = load_config(run / "config.yaml")
    assert evaluate_run(cfg, run, verbose=False) == final


def test_evaluating_during_training_changes_nothing_trained(demo, tmp_path):
    with_eval, without = tmp_path / "with", tmp_path / "without"
    train("configs/demo_omni.yaml", progress=False, sets=_sets(
        demo, with_eval, steps=3, **{"eval.every": 1}))
    train("configs/demo_omni.yaml", progress=False, sets=_sets(
        demo, without, steps=3, **{"eval.enabled": False}))
    a, b = read_metrics(with_eval / "metrics.jsonl"), read_metrics(without / "metrics.jsonl")
    assert all("eval" in r for r in a) and not any("eval" in r for r in b)
    for x, y in zip(a, b, strict=True):
        assert (x["loss"], x["grad_norm"], x["mix_samples"]) == \
            (y["loss"], y["grad_norm"], y["mix_samples"])


@pytest.mark.parametrize("task, spec", [("omni", "mix.yaml"), ("video_gen", "video.yaml")])
def test_evaluation_runs_under_bf16(demo, tmp_path, task, spec):
    """bf16 parameters (CUDA's default; asked for here on CPU): the evaluation's calls made
    outside a forward method (the head's logits, the DiT's velocity) run too."""
    run = tmp_path / "run"
    result = train(f"configs/demo_{task}.yaml", progress=False, sets=_sets(
        demo, run, steps=1, **{"data.spec": demo / spec, "eval.max_samples": 2,
                               "parallel.mixed_precision": "bf16"}))
    assert result["eval"] and all(r["samples"] >= 2 for r in result["eval"].values())
    assert read_metrics(run / "metrics.jsonl")[0]["eval"]
