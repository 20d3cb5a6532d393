"""The omni step's encoder plan + reshard: two processes train exactly what one does.

With the same spec and global batch size the plane draws the same global batches for 1 and 2
ranks; the 2-rank run encodes each media item on the rank the encoder plan names, moves the
embeddings with the reshard all-to-all and runs backward in fixed phases. Losses and gradient
norms must match the single process (sums in another order: within float tolerance).
"""

from __future__ import annotations

import math

from tools.train.launch import train
from tools.train.metrics import read_metrics


def _run(demo, out, nproc):
    sets = {"data.spec": demo / "mix.yaml", "data.eval_spec": demo / "eval.yaml",
            "data.workers": 0, "data.global_batch_tokens": 8192,
            "data.micro_batch_tokens": 4096, "optim.warmup_steps": 1, "optim.decay_steps": 4,
            "eval.enabled": False, "output_dir": out, "steps": 3,
            "data.refit_costs_every": 3}
    train("configs/demo_omni.yaml", nproc=nproc, sets=[f"{k}={v}" for k, v in sets.items()],
          progress=False)
    return read_metrics(out / "metrics.jsonl")


def test_two_ranks_with_encoder_plan_and_reshard_match_one(demo, tmp_path):
    one, two = _run(demo, tmp_path / "one", 1), _run(demo, tmp_path / "two", 2)
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two]
    assert [r["mix_samples"] for r in one] == [r["mix_samples"] for r in two]
    for a, b in zip(one, two):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4)
        assert a["source_loss"].keys() == b["source_loss"].keys()
        for name, value in a["source_loss"].items():
            assert math.isclose(value, b["source_loss"][name], rel_tol=1e-4), name
    # the 2-rank plan moved media between ranks (otherwise the reshard was not exercised)
    assert sum(r["media_items_moved"] for r in two) > 0
    assert all(r["media_items_moved"] == 0 for r in one)
    # the cost refit ran at step 3 (deterministic run: logged, not sent to the plane)
    assert "cost_refit" in two[2] and "cost_refit" not in two[1]
    assert two[2]["cost_refit"] is None or "applies_at_step" not in two[2]["cost_refit"]
    events = list((tmp_path / "two" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0  # the same metrics for TensorBoard
    row = two[-1]
    assert abs(sum(row["mix_target"].values()) - 1.0) < 1e-5
    assert sum(row["mix_tokens"].values()) == row["tokens"]
