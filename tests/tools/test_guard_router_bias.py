"""A step the update guard does not apply leaves the MoE routers' aux-loss-free balancing bias
where it was (issue #46, item 1d): a real one-process demo run with ``bias_update_rate`` on and
a NaN loss at step BAD. The checkpoints before and after step BAD hold the same biases; the
applied steps around it move them (the rate is really on)."""

from __future__ import annotations

import torch

from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import TINY_MOE, demo_sets

BAD = 1  # the poisoned step
STEPS = BAD + 2


def _biases(run, step: int, tmp_path) -> dict[str, torch.Tensor]:
    """Every MoE layer's selection bias in the checkpoint taken after ``step`` steps."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp_path / f"step-{step}.pt"
    dcp_to_torch_save(run / "checkpoints" / f"step-{step:06d}", flat)
    model = torch.load(flat, weights_only=True)["train"]["model"]
    return {k: v for k, v in model.items() if k.endswith("expert_bias_E")}


def test_a_skipped_step_does_not_move_the_router_bias(demo, tmp_path):
    run = tmp_path / "run"
    train("configs/demo_omni.yaml", progress=False, sets=demo_sets(
        demo, run, steps=STEPS, checkpoint_every=1, **{
            "data.global_batch_tokens": 4096, "data.micro_batch_tokens": 4096,
            "model.overrides.moe": TINY_MOE + ", bias_update_rate: 0.01}",
            "debug.poison": "{step: %d, rank: 0, kind: nan}" % BAD}))
    rows = read_metrics(run / "metrics.jsonl")
    assert [("update_skipped" in r) for r in rows] == [s == BAD for s in range(STEPS)]
    before, after, next_ = (_biases(run, s, tmp_path) for s in (BAD, BAD + 1, BAD + 2))
    assert before, "no MoE bias in the checkpoint"
    # the biases start at 0; an applied step moves each by +-rate (sign of mean - load)
    assert all(before[k].abs().max() == torch.tensor(0.01) for k in before)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the skipped step
    assert all(not torch.equal(after[k], next_[k]) for k in before)
