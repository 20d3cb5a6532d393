"""The trainer's other two tasks end to end: ``lm`` (the MoE decoder alone on the demo's text)
and ``video_gen`` (the rectified-flow DiT on the demo's clips, FSDP over two processes)."""

from __future__ import annotations

import math

from omniscale.tools.train.config import load_config
from omniscale.tools.train.evaluate import evaluate_run
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics


def _run(demo, task, spec, out, nproc, steps=8):
    sets = {"data.spec": demo / spec, "data.eval_spec": demo / "eval.yaml",
            "data.workers": 0, "steps": steps, "checkpoint_every": steps, "output_dir": out,
            "eval.max_samples": 4, "optim.warmup_steps": 2}
    result = train(f"configs/demo_{task}.yaml", nproc=nproc,
                   sets=[f"{k}={v}" for k, v in sets.items()], progress=False)
    return read_metrics(out / "metrics.jsonl"), result["eval"]


def test_lm_task_trains_the_decoder_on_text(demo, tmp_path):
    rows, results = _run(demo, "lm", "lm.yaml", tmp_path / "lm", 1)
    assert [r["step"] for r in rows] == list(range(8))
    assert set().union(*(r["mix_samples"] for r in rows)) <= {"text", "docs"}
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert set(results) == {"text"} and results["text"]["tokens"] > 0
    assert "media_items_moved" in rows[0] and rows[0]["media_items_moved"] == 0


def test_video_gen_task_trains_the_dit_on_two_processes(demo, tmp_path):
    rows, results = _run(demo, "video_gen", "video.yaml", tmp_path / "vg", 2, steps=6)
    assert [r["step"] for r in rows] == list(range(6))
    assert all(math.isfinite(r["loss"]) and r["tokens"] > 0 for r in rows)
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3])
    held_out = results["video_caption"]
    assert held_out["n_targets"] > 0 and math.isfinite(held_out["loss"])
    # the two ranks' evaluation of their halves (tools.train.held_out) is one process's of
    # the whole held-out set, the same noise per clip (up to the order of the sums)
    cfg, _ = load_config(tmp_path / "vg" / "config.yaml")
    one = evaluate_run(cfg, tmp_path / "vg", verbose=False)["video_caption"]
    assert one.keys() == held_out.keys() and one["samples"] == held_out["samples"]
    for key, value in one.items():
        assert math.isclose(held_out[key], value, rel_tol=1e-9), key
