"""The update guard (``tools.train.guard``) in real training runs: a NaN injected into one
rank's loss at step 2 of a 2-process run is not applied on either rank (the checkpoints after
steps 2 and 3 hold the same parameters and optimizer state: the run is the one that never
trained step 2), its samples are reported to the plane as suspect (``result.json``, ``plane
status``, quarantined), and training goes on; a poisoned batch (a loss spike) is skipped too,
and ``guard.max_skipped_steps`` of them stop the run with one line."""

from __future__ import annotations

import json

import pytest
import torch

from omniscale.errors import UserError
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import demo_sets

BAD = 2  # the poisoned step


def _sets(demo, out, **extra) -> list[str]:
    return demo_sets(demo, out, **{"data.global_batch_tokens": 4096,
                                   "data.micro_batch_tokens": 2048, **extra})


def _state(run, step: int, tmp_path) -> dict:
    """The whole training state of a checkpoint (every rank's shards), as one dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp_path / f"step-{step}.pt"
    dcp_to_torch_save(run / "checkpoints" / f"step-{step:06d}", flat)
    state = torch.load(flat, weights_only=True)["train"]
    return {**{f"model.{k}": v for k, v in state["model"].items()},
            **{f"optimizer.{k}": v for k, v in state["optimizer"].items()}}


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                 else a[k] == b[k])]


def _reopened_plane(run, nproc: int):
    """The run's plane, opened again from its state dir with the run's own settings."""
    from omniscale.dataplane.plane import DataPlane
    from omniscale.tools.train.config import load_config
    from omniscale.tools.train.loop import layout, plane_config

    cfg, _ = load_config(run / "config.yaml")
    _, mcfg, dims, groups = layout(cfg, nproc)
    return DataPlane(None, run / "plane", plane_config(cfg, dims.dp_sp, mcfg.cost_coefficients(),
                                                       groups.frozen_kinds))


def test_a_nan_on_one_rank_is_skipped_everywhere_and_its_samples_are_suspect(demo, tmp_path):
    run = tmp_path / "run"
    result = train("configs/demo_omni.yaml", nproc=2, progress=False, sets=_sets(
        demo, run, steps=BAD + 2, checkpoint_every=1,
        **{"debug.poison": "{step: %d, rank: 1, kind: nan}" % BAD}))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(BAD + 2))
    assert [("update_skipped" in r) for r in rows] == [s == BAD for s in range(BAD + 2)]
    assert "nan" in rows[BAD]["update_skipped"]
    # the parameters and AdamW's state after the skipped step are those before it (both
    # ranks' shards are in the checkpoint); the next step trains
    before, after, next_ = (_state(run, s, tmp_path) for s in (BAD, BAD + 1, BAD + 2))
    # (the learning rate AdamW's param groups hold is the schedule's of the step last run)
    assert all(k.startswith("optimizer.param_groups.") and k.endswith(".lr")
               for k in _differ(before, after))
    assert any(k.startswith("model.") for k in _differ(after, next_))
    assert all(torch.isfinite(v).all() for k, v in next_.items()
               if k.startswith("model.") and v.is_floating_point())
    # its samples: suspect, with source and key, in result.json and the plane's state
    suspect = result["suspect"]
    assert [s["step"] for s in suspect["steps"]] == [BAD]
    listed = suspect["steps"][0]["samples"]
    assert len(listed) == sum(rows[BAD]["mix_samples"].values()) == suspect["samples"]
    assert {s["source"] for s in listed} == set(rows[BAD]["mix_samples"])
    assert json.loads((run / "result.json").read_text())["suspect"] == suspect
    plane = _reopened_plane(run, nproc=2)
    status = plane.status()["suspect"]
    assert status["steps"] == 1 and status["samples"] == len(listed)
    # quarantined from the first window drawn after the report (windows ahead were drawn)
    plane.state.plan_through(plane.suspects.events[0]["before_window"] * plane.config.window)
    quarantined = {(q[0], q[1]) for name in plane.mixer.catalog.names
                   for q in plane.mixer.catalog[name].state_dict()["quarantine"]}
    assert {(s["shard"], s["key"]) for s in listed} <= quarantined


def test_a_loss_spike_is_skipped_and_repeated_skips_stop_the_run(demo, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(UserError) as stopped:
        train("configs/demo_omni.yaml", progress=False, sets=_sets(
            demo, run, steps=6, checkpoint_every=6, **{
                "guard.min_history": 2, "guard.max_skipped_steps": 1,
                "debug.poison": "{step: 3, kind: spike, factor: 50}"}))
    line = str(stopped.value)
    assert "\n" not in line
    assert line.startswith("guard: 1 steps in a row not applied (step 3: loss ")
    assert "above 5 x the median" in line and "plane status" in line
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the stopping step is logged
    assert "update_skipped" in rows[3] and rows[3]["loss"] > 5 * rows[2]["loss"]
