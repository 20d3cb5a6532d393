"""Pipeline parallelism (`parallel.pipeline.apply_pp`) against a single-process run.

Two real gloo ranks run the `tiny` MoE decoder (3 layers: an uneven 2 + 1 split) with GPipe
and with 1F1B over 4 packed micro-batches of different sequence counts and M-RoPE positions;
the loss, every parameter's gradient (each stage's own, gathered here by name) and the expert
loads must match one process accumulating the same micro-batches. A second step feeds a short
micro-batch, which the runner pads to the token budget.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from omniscale.backbone.config import ModelConfig
from omniscale.backbone.decoder import MoEDecoder
from omniscale.parallel.pipeline import apply_pp, default_loss, stack_microbatches, stage_layers
from tests.parallel.multiproc import run_ranks

N_MICRO, TOKENS = 4, 32
SCHEDULES = ("gpipe", "1f1b")


def _model() -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder(ModelConfig.preset("tiny", n_layers=3))


def _microbatch(seed: int, lengths: list[int]) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    ids = torch.randint(0, 1024, (t,), generator=g)
    labels = torch.randint(0, 1024, (t,), generator=g)
    labels[torch.rand(t, generator=g) < 0.2] = -100
    pos = torch.cat([torch.arange(n) for n in lengths])
    mrope = pos.expand(3, t).clone()
    mrope[1:, : lengths[0] // 2] = torch.randint(0, 4, (2, lengths[0] // 2), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return SimpleNamespace(input_ids_T=ids, labels_T=labels, position_ids_T=pos, mrope_3T=mrope,
                           cu_seqlens_S1=cu, max_seqlen=max(lengths))


def _steps() -> list[list[SimpleNamespace]]:
    first = [_microbatch(1, [10, 22]), _microbatch(2, [32]), _microbatch(3, [5, 12, 15]),
             _microbatch(4, [20, 12])]
    second = [_microbatch(5, [16, 16]), _microbatch(6, [7, 13]), _microbatch(7, [32]),
              _microbatch(8, [3, 29])]  # micro-batch 1 holds 20 tokens: padded to 32
    return [first, second]


def _padded(microbatches) -> list[SimpleNamespace]:
    """The micro-batches as the pipeline runs them (padded to TOKENS), one by one."""
    ids, labels, kw = stack_microbatches(microbatches, TOKENS)
    return [SimpleNamespace(input_ids_T=ids[i], labels_T=labels[i],
                            position_ids_T=kw["position_ids"][i], mrope_3T=kw["mrope"][i],
                            cu_seqlens_S1=kw["cu_seqlens"][i], max_seqlen=kw["max_seqlen"])
            for i in range(len(microbatches))]


def _reference() -> list[dict]:
    """One process: each step accumulates `default_loss` over its micro-batches."""
    model, results = _model(), []
    for microbatches in _steps():
        model.zero_grad()
        mbs = _padded(microbatches)
        n_tokens = sum((mb.labels_T != -100).sum() for mb in mbs)
        total, load = torch.zeros(()), 0
        for mb in mbs:
            hidden, aux = model(model.embed_tokens(mb.input_ids_T), mb.position_ids_T,
                                mb.cu_seqlens_S1, mb.max_seqlen, mb.mrope_3T)
            ce_sum, _ = model.loss(hidden, mb.labels_T)
            loss = default_loss(ce_sum, aux["router_loss"], n_tokens, len(mbs))
            loss.backward()
            total, load = total + loss.detach(), load + aux["load_LE"]
        results.append({"loss": total,
                        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                        "load_LE": load})
    return results


def _pipelined(rank, world, schedules):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    out = {}
    for schedule in schedules:
        runner = apply_pp(_model(), mesh["pp"], schedule, N_MICRO, microbatch_tokens=TOKENS)
        steps = []
        for microbatches in _steps():
            runner.module.zero_grad()
            loss = runner.step(microbatches)
            steps.append({"loss": loss, "load_LE": runner.module.load_LE,
                          "layers": runner.module.layer_range,
                          "grads": {n: p.grad.clone()
                                    for n, p in runner.module.named_parameters()}})
        out[schedule] = steps
    # Plain pickle bytes: a tensor put on the harness's queue travels as a shared-memory file
    # descriptor, which is gone once this process exits.
    return pickle.dumps(out)


@pytest.fixture(scope="module")
def runs():
    return _reference(), [pickle.loads(r) for r in run_ranks(_pipelined, 2, SCHEDULES)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp_matches_single_process(runs, schedule):
    reference, ranks = runs
    for step, ref in enumerate(reference):
        stages = [r[schedule][step] for r in ranks]
        assert stages[0]["loss"] is None
        torch.testing.assert_close(stages[-1]["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        names = [set(s["grads"]) for s in stages]
        assert not names[0] & names[1] and names[0] | names[1] == set(ref["grads"])
        assert "embed_tokens.weight" in names[0] and "lm_head.weight" in names[-1]
        for s in stages:
            for name, grad in s["grads"].items():
                torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name: f"step {step} {n}: {m}")
            lo, hi = s["layers"]
            torch.testing.assert_close(s["load_LE"], ref["load_LE"][lo:hi])
        assert [s["layers"] for s in stages] == [(0, 2), (2, 3)]


def test_stage_layers_split_evenly_and_reject_too_many_stages():
    assert stage_layers(4, 2) == [(0, 2), (2, 4)]
    assert stage_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        stage_layers(3, 4)


def test_padding_never_exceeds_the_token_budget():
    with pytest.raises(ValueError, match="micro-batch 0 holds 32 tokens, over "
                                         "microbatch_tokens=16"):
        stack_microbatches([_microbatch(1, [10, 22])], 16)


def _pipelined_bf16(rank, world):
    """`parallelize_lm` with pp=2 under bf16 mixed precision (the CUDA default): the stages
    exchange bf16 activations, which their receive buffers and dtype checks must expect."""
    from omniscale.backbone.omni import OmniModel
    from omniscale.parallel.mesh import ParallelDims
    from omniscale.parallel.parallelize import Settings, parallelize_lm

    torch.manual_seed(0)
    model = OmniModel(ModelConfig.preset("tiny", n_layers=3))
    meshes = parallelize_lm(model, ParallelDims(pp=world, dp_shard=1, world_size=world),
                            Settings(mixed_precision="bf16", pp_schedule="gpipe",
                                     pp_microbatches=N_MICRO), "cpu", microbatch_tokens=TOKENS)
    loss = meshes.pipeline.step(_steps()[0])
    return None if loss is None else float(loss)


def test_pp_runs_in_bf16_mixed_precision():
    reference = float(_reference()[0]["loss"])
    first, last = run_ranks(_pipelined_bf16, 2)
    assert first is None
    assert last == pytest.approx(reference, rel=2e-2)  # bf16 compute, fp32 reference
