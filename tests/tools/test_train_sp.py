"""``parallel.sp``: the plane splits samples longer than a micro-batch over an aligned group
of processes and the trainer attends over them with Ulysses. Two processes with micro-batches
of M tokens and sp=2 train what one process with micro-batches of 2M does: both plan
samples of up to 2M tokens, so the plane draws the same global batches (windows of one step:
a longer window deals its samples to steps by the ranks' budgets), and losses and gradient
norms agree: on the demo mix (text samples split) and on its media sources alone (video and
audio blocks cut by the slice boundary; each slice keeps only its own rows of a block), and
with the ranks' speeds known ahead (``data.rank_speeds``: the slow rank holds fewer of a split
sample's tokens where the micro-batch budget leaves room, and attends fewer of its heads where
that finishes the pair sooner). An sp that cannot work is one line."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import yaml

from omniscale.errors import UserError
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics


def _sets(demo, out, **kw):
    base = {"data.spec": demo / "mix.yaml", "data.eval_spec": demo / "eval.yaml",
            "data.workers": 0, "data.global_batch_tokens": 4096, "data.window": 1,
            # no router losses: they are per-micro-batch means, and the two runs' micro-batches
            # differ, which would leave the gradients close rather than equal
            "model.overrides.moe.aux_loss_coef": 0, "model.overrides.moe.z_loss_coef": 0,
            "optim.warmup_steps": 1,
            "optim.decay_steps": 4, "eval.enabled": False, "output_dir": out, "steps": 3}
    return [f"{k}={v}" for k, v in {**base, **kw}.items()]


def media_only(demo, out) -> str:
    """The demo's video, audio and interleaved sources at equal weights: samples whose media
    blocks straddle the slice boundaries when split."""
    spec = yaml.safe_load((demo / "mix.yaml").read_text())
    spec.pop("schedule", None)
    spec["tokenizer"] = str(demo / spec["tokenizer"])
    spec["sources"] = [dict(s, path=str(demo / s["path"]), weight=1) for s in spec["sources"]
                       if s["name"] in ("video_caption", "audio_caption", "interleaved")]
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(out)


# The media sources split over SP pairs: test_four_processes_sp_ep_and_fsdp_train_what_one_does.
@pytest.mark.parametrize("media, micro, speeds", [(False, 256, None), (False, 256, "[1, 0.3]")],
                         ids=["text", "text-by-speed"])
def test_split_samples_train_what_one_process_does(demo, tmp_path, media, micro, speeds):
    spec = {"data.spec": media_only(demo, tmp_path / "media.yaml")} if media else {}
    by_speed = {"data.rank_speeds": speeds} if speeds else {}
    train("configs/demo_omni.yaml", progress=False,
          sets=_sets(demo, tmp_path / "one", **spec, **{"data.micro_batch_tokens": 2 * micro}))
    # with activation checkpointing (the GPU default; it changes no value): the recompute in
    # backward attends over the same SP groups as the forward
    train("configs/demo_omni.yaml", nproc=2, progress=False,
          sets=_sets(demo, tmp_path / "sp", **spec, **by_speed,
                     **{"data.micro_batch_tokens": micro, "parallel.sp": 2,
                        "parallel.activation_checkpoint": "selective"}))
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    sp = read_metrics(tmp_path / "sp" / "metrics.jsonl")
    assert sum(r["sp_split_samples"] for r in sp) > 0  # samples were split over the pair
    assert [r["mix_samples"] for r in one] == [r["mix_samples"] for r in sp]
    # the same trained tokens (a split sample is padded to a multiple of its group size)
    assert [r["target_tokens"] for r in one] == [r["target_tokens"] for r in sp]
    for a, b in zip(one, sp, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=2e-4), \
            (a["grad_norm"], b["grad_norm"])
    if speeds:  # the plans the run trained, replayed from its plane's log: slow rank 1 never
        # held the larger slice of a split sample, and the smaller where the budget let it (a
        # sample of twice the micro-batch budget fills both ranks' budgets: equal slices)
        slices = split_slices(tmp_path / "sp" / "plane", steps=len(sp))
        assert all(on_0 >= on_1 for (on_0, on_1), _ in slices), slices
        assert any(on_0 > on_1 for (on_0, on_1), _ in slices), slices
        # heads sized by speed (the model's 4: 3 and 1) where a sample fills both budgets
        heads = [h for _, h in slices if h is not None]
        assert heads and all(h == (3, 1) for h in heads), slices


def split_slices(state_dir, steps: int) -> list[tuple[tuple[int, int], tuple | None]]:
    """((tokens on rank 0, on rank 1), (heads on rank 0, on rank 1) or None for H/k each) of
    each sample split over the pair in the first ``steps`` steps, from the plane's log
    (``PlaneState`` replays the plans exactly)."""
    from omniscale.dataplane.journal import Journal
    from omniscale.dataplane.plane_state import PlaneState
    from omniscale.dataplane.restore import start_record

    journal = Journal(state_dir, readonly=True)
    state = PlaneState.fresh(start_record(journal)[1], journal)
    out = []
    for step in range(steps):
        state.plan_through(step)
        window, local = state.window_of(step)
        plan = window.plans[local]
        for i in np.unique(plan.sample_P[plan.sp_size_P > 1]).tolist():
            mine = plan.sample_P == i
            by_rank = dict(zip(plan.rank_P[mine].tolist(), plan.sp_tokens_P[mine].tolist()))
            heads = None if plan.sp_heads_P is None else dict(
                zip(plan.rank_P[mine].tolist(), plan.sp_heads_P[mine].tolist()))
            out.append(((by_rank[0], by_rank[1]),
                        (heads[0], heads[1]) if heads and heads[0] else None))
    return out


@pytest.mark.parametrize("nproc, sp, says", [
    (2, 3, "parallel.sp: must be a power of two, got 3"),
    (2, 4, "parallel.dp_shard=-1: world_size=2 is not a multiple of dp_replicate·sp·tp·pp = 4 "
           "(with --nproc 2)")])
def test_impossible_sp_is_one_line(demo, tmp_path, nproc, sp, says):
    with pytest.raises(UserError, match=re.escape(says)):
        train("configs/demo_omni.yaml", nproc=nproc, progress=False,
              sets=_sets(demo, tmp_path / "bad", **{"parallel.sp": sp}))


def test_four_processes_sp_ep_and_fsdp_train_what_one_does(demo, tmp_path):
    """4 processes as dp_shard 2 × sp 2 on the media sources, ep 2 borrowing those ranks: long
    samples split over an SP pair (video and audio blocks cut by the slice boundary), experts
    split over an EP pair and FSDP-sharded over the other 2 (with 128-token micro-batches some
    EP ranks receive no tokens: before the fix in parallel/expert.py this deadlocked in the
    first backward), FSDP over all 4. Against one process with micro-batches twice as long:
    the loss and every parameter's gradient, the aux router loss off (another packing)."""
    import torch

    from tests.tools.train_runs import assert_same_gradients

    spec = {"data.spec": media_only(demo, tmp_path / "media.yaml"),
            "model.overrides.moe.aux_loss_coef": 0, "debug.dump_grads_at_step": 0}
    train("configs/demo_omni.yaml", progress=False,
          sets=_sets(demo, tmp_path / "one", **spec, **{"data.micro_batch_tokens": 256}))
    train("configs/demo_omni.yaml", nproc=4, progress=False,
          sets=_sets(demo, tmp_path / "four", **spec, **{
              "data.micro_batch_tokens": 128, "parallel.sp": 2, "parallel.ep": 2}))
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    four = read_metrics(tmp_path / "four" / "metrics.jsonl")
    assert sum(r["sp_split_samples"] for r in four) > 0
    assert [r["mix_samples"] for r in one] == [r["mix_samples"] for r in four]
    for a, b in zip(one, four, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["loss"], b["loss"])
    grads = [torch.load(tmp_path / run / "grads-step-0.pt", weights_only=True)
             for run in ("one", "four")]
    assert_same_gradients(*grads, trained=("vision.", "audio.", "decoder."), rel=1e-4)


@pytest.mark.parametrize("speeds, got", [("[1]", "[1.0]"), ("[1, 0]", "[1.0, 0.0]")])
def test_rank_speeds_not_one_per_data_rank_are_one_line(demo, tmp_path, speeds, got):
    with pytest.raises(UserError, match=re.escape(
            f"data.rank_speeds: one finite speed > 0 per data rank; this run has 2 data ranks, "
            f"got {got}")):
        train("configs/demo_omni.yaml", nproc=2, progress=False,
              sets=_sets(demo, tmp_path / "bad", **{"data.rank_speeds": speeds}))
