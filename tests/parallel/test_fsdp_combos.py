"""FSDP combined with expert, sequence and pipeline parallelism on 4 real gloo ranks, each against
one process (loss and every gradient), in one set of processes (spawning ranks dominates):

- EP × FSDP, the tiny omni MoE: `ParallelDims(dp_shard=4, ep=2)` — experts split over `ep`
  and FSDP-sharded over `edp_shard` = 2 (the expert mesh), every other backbone parameter
  FSDP-sharded over all 4 ranks, the encoders over the encoder mesh. In layer 1 no token picks
  the experts of ep rank 0 (a selection bias), so those ranks receive no tokens there.
- SP × FSDP, the tiny omni MoE: `ParallelDims(dp_shard=2, sp=2)` — each SP pair splits one long
  sample (media block cut by the slice boundary included) beside whole short ones; FSDP shards
  over `dp_shard_sp`.
- TP × FSDP, the tiny omni MoE with everything TP splits: `ParallelDims(dp_shard=2, tp=2,
  encoder_tp=2)` — decoder blocks, embeddings and LM head over `tp`, encoder blocks over
  `encoder_tp`, FSDP over the data-parallel axes of both meshes (2-D DTensor parameters).
- PP × FSDP, the tiny decoder (the pipeline takes token ids, not the omni model's media):
  `ParallelDims(pp=2, dp_shard=2)`, GPipe and 1F1B, each stage FSDP-sharded over `dp`; and
  PP × TP (`ParallelDims(pp=2, tp=2)`, 1F1B): the last stage scores with the vocabulary-split
  LM head.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omniscale.backbone.config import MoEConfig
from omniscale.parallel.pipeline import default_loss, stack_microbatches
from tests.parallel.dist_models import (
    CONFIG,
    assert_grads_close,
    full_grads,
    omni_collate,
    omni_model,
    omni_samples,
    omni_step,
    pack,
)
from tests.parallel.multiproc import run_ranks

# One worker runs the module (`--dist loadgroup`): its module fixture, a multi-rank run, is
# built once instead of on each worker that draws one of its tests.
pytestmark = pytest.mark.xdist_group("fsdp_combos")

KINDS = ["image", "audio", "video", "image", "audio", "image"]  # 35, 37, 13, 28, 39, 28 tokens
EP_SHARDS = [[0, 1], [2], [3, 4], [5]]  # samples per data-parallel rank
# (sample, sp_size) per rank in batch order; SP pairs are ranks (0, 1) and (2, 3). Sample 1's
# audio block spans both of its slices; sample 0's image lies in slice 0 only.
TP_SHARDS = [[0, 1, 2], [3, 4, 5]]  # samples per data-parallel rank (a TP pair shares them)
SP_PLAN = [[(2, 1), (1, 2)], [(1, 2), (3, 1)], [(0, 2), (5, 1)], [(0, 2), (4, 1)]]
MOE = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=64, bias_update_rate=1e-3)
SCHEDULES = ("gpipe", "1f1b")
PP_LENGTHS = [[[12, 17], [23]], [[31], [9, 14]]]  # [dp rank][micro-batch] sequence lengths
PP_TOKENS = 32


def _omni(vocab_size):
    model = omni_model(vocab_size, moe=MOE)
    model.decoder.layers[1].ffn.expert_bias_E[:4] = -100.0  # ep rank 0's experts: never picked
    return model


def _microbatches() -> list[list[SimpleNamespace]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for rank in PP_LENGTHS:
        mbs = []
        for lengths in rank:
            seqs = []
            for n in lengths:
                ids = torch.randint(0, CONFIG.vocab_size, (n + 1,), generator=g)
                seqs.append((ids[:-1], ids[1:]))
            mbs.append(SimpleNamespace(**pack(seqs)))
        out.append(mbs)
    return out


# ---- the ranks ---------------------------------------------------------------------------

def _ep_fsdp(rank, world, vocab_size, shards, n_global):
    from omniscale.parallel import ParallelDims, apply_ep, apply_fsdp

    dims = ParallelDims(dp_shard=4, ep=2, world_size=world)
    model = _omni(vocab_size)
    dims.validate_for(model.config)
    mesh, experts = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
    apply_ep(model, experts["ep"])
    apply_fsdp(model, mesh, encoder_mesh=dims.build_encoder_mesh("cpu"), expert_mesh=experts)
    loss = omni_step(model, shards[mesh["dp"].get_local_rank()], n_global)
    grads = full_grads(model)  # experts: this ep rank's slice, gathered over edp_shard
    offset = model.decoder.layers[1].ffn.experts.ep_offset
    return loss.item(), (offset, grads) if experts["edp_shard"].get_local_rank() == 0 else None


def _sp_fsdp(rank, world, vocab_size, batches, n_global):
    from omniscale.parallel import ParallelDims, apply_fsdp, apply_sp
    from omniscale.parallel.sequence import sp_batch

    dims = ParallelDims(dp_shard=2, sp=2, world_size=world)
    model = _omni(vocab_size)
    dims.validate_for(model.config)
    mesh = dims.build_mesh("cpu")
    apply_sp(model, mesh["sp"])
    apply_fsdp(model, mesh, encoder_mesh=dims.build_encoder_mesh("cpu"))
    with sp_batch(model, batches[rank]):
        out = model(batches[rank])
    loss = out["loss_sum"] / n_global
    loss.backward()
    grads = full_grads(model)
    return loss.item(), grads if rank == 0 else None


def _tp_fsdp(rank, world, vocab_size, shards, n_global):
    from omniscale.parallel import ParallelDims, apply_fsdp, apply_tp

    dims = ParallelDims(dp_shard=2, tp=2, encoder_tp=2, world_size=world)
    model = _omni(vocab_size)
    dims.validate_for(model.config)
    mesh, encoder_mesh = dims.build_mesh("cpu"), dims.build_encoder_mesh("cpu")
    apply_tp(model, mesh["tp"], encoder_mesh["encoder_tp"])
    apply_fsdp(model, mesh, encoder_mesh=encoder_mesh)
    loss = omni_step(model, shards[mesh["dp"].get_local_rank()], n_global)
    grads = full_grads(model)
    # each TP pair holds one data-parallel share: count its loss once
    return loss.item() if mesh["tp"].get_local_rank() == 0 else 0.0, \
        grads if rank == 0 else None


def _pp_fsdp(rank, world, microbatches, n_global):
    from torch.distributed.fsdp import FSDPModule

    from omniscale.backbone.decoder import MoEDecoder
    from omniscale.parallel import ParallelDims, apply_fsdp, apply_pp

    dims = ParallelDims(pp=2, dp_shard=2, world_size=world)
    dims.validate_for(CONFIG)
    mesh = dims.build_mesh("cpu")
    out = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)
        runner = apply_pp(MoEDecoder(CONFIG), mesh["pp"], schedule, 2,
                          microbatch_tokens=PP_TOKENS)
        apply_fsdp(runner.module, mesh)
        loss = runner.step(microbatches[mesh["dp"].get_local_rank()], n_tokens=n_global)
        grads = full_grads(runner.module)  # this stage's parameters, gathered over dp
        out[schedule] = (None if loss is None else loss.item(),
                         grads if mesh["dp"].get_local_rank() == 0 else None)
    out["tp"] = _pp_tp(world, microbatches, n_global)
    # FSDP units of the last stage: its block (a pipeline stage keys layers in a dict) + root
    out["units"] = sum(isinstance(m, FSDPModule) for m in runner.module.modules())
    return out


def _pp_tp(world, microbatches, n_global):
    """1F1B over both data-parallel shares' micro-batches on one pp × tp mesh."""
    from omniscale.backbone.decoder import MoEDecoder
    from omniscale.parallel import ParallelDims, apply_pp, apply_tp

    dims = ParallelDims(pp=2, tp=2, world_size=world)
    dims.validate_for(CONFIG)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    mbs = [mb for rank in microbatches for mb in rank]
    per_rank = len(microbatches[0])  # router loss: a mean over each data-parallel share's
    runner = apply_pp(MoEDecoder(CONFIG), mesh["pp"], "1f1b", len(mbs),
                      microbatch_tokens=PP_TOKENS,
                      loss_fn=lambda ce, router, n, m: default_loss(ce, router, n, per_rank))
    apply_tp(runner.module, mesh["tp"])  # torchtitan's order: the stage, then its split
    loss = runner.step(mbs, n_tokens=n_global)
    split = {n: type(p).__name__ for n, p in runner.module.named_parameters()
             if n in ("embed_tokens.weight", "lm_head.weight")}
    grads = full_grads(runner.module)  # gathered over tp
    return (None if loss is None else loss.item(),
            grads if mesh["tp"].get_local_rank() == 0 else None, split)


def _combos(rank, world, vocab_size, ep_shards, sp_batches, tp_shards, n_global,
            microbatches, pp_n_global):
    return {"ep": _ep_fsdp(rank, world, vocab_size, ep_shards, n_global),
            "sp": _sp_fsdp(rank, world, vocab_size, sp_batches, n_global),
            "tp": _tp_fsdp(rank, world, vocab_size, tp_shards, n_global),
            "pp": _pp_fsdp(rank, world, microbatches, pp_n_global)}


# ---- single-process references -----------------------------------------------------------

def _pp_reference(microbatches, n_global) -> tuple[float, dict]:
    """Every data-parallel rank's padded micro-batches through the whole model, each with the
    pipeline's per-micro-batch loss (`default_loss` over the global token count)."""
    from omniscale.backbone.decoder import MoEDecoder

    torch.manual_seed(0)
    model, total = MoEDecoder(CONFIG), 0.0
    for mbs in microbatches:
        ids, labels, kw = stack_microbatches(mbs, PP_TOKENS)
        for i in range(len(mbs)):
            hidden, aux = model(model.embed_tokens(ids[i]), kw["position_ids"][i],
                                kw["cu_seqlens"][i], kw["max_seqlen"])
            ce_sum, _ = model.loss(hidden, labels[i])
            loss = default_loss(ce_sum, aux["router_loss"], torch.tensor(n_global), len(mbs))
            loss.backward()
            total += loss.item()
    return total, full_grads(model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    vocab_size, samples = omni_samples(KINDS, tmp_path_factory.mktemp("tok") / "tok.json")
    whole = omni_collate([(s, 1, 0) for s in samples])
    n_global = int((whole.labels_T != -100).sum())
    ep_shards = [omni_collate([(samples[i], 1, 0) for i in shard]) for shard in EP_SHARDS]
    sp_batches = [omni_collate([(samples[i], k, rank % k) for i, k in plan])
                  for rank, plan in enumerate(SP_PLAN)]
    tp_shards = [omni_collate([(samples[i], 1, 0) for i in shard]) for shard in TP_SHARDS]
    microbatches = _microbatches()
    pp_n_global = sum(int((mb.labels_T != -100).sum()) for mbs in microbatches for mb in mbs)

    model = _omni(vocab_size)
    omni_ref = (omni_step(model, whole, n_global).item(), full_grads(model))
    ranks = run_ranks(_combos, 4, vocab_size, ep_shards, sp_batches, tp_shards, n_global,
                      microbatches, pp_n_global)
    return {"omni": omni_ref, "pp": _pp_reference(microbatches, pp_n_global)}, ranks


def _check_loss(losses, want):
    assert sum(losses) == pytest.approx(want, rel=1e-5)


def test_ep_fsdp_matches_single_process(runs):
    (ref_loss, ref_grads), ranks = runs[0]["omni"], runs[1]
    _check_loss([r["ep"][0] for r in ranks], ref_loss)
    slices = sorted((r["ep"][1] for r in ranks if r["ep"][1] is not None), key=lambda s: s[0])
    assert [offset for offset, _ in slices] == [0, 4]
    grads = dict(slices[0][1])
    for name in grads:
        if ".experts." in name:  # each ep rank holds experts [offset, offset + 4)
            grads[name] = np.concatenate([g[name] for _, g in slices])
    assert_grads_close(grads, ref_grads)
    assert not ref_grads["decoder.layers.1.ffn.experts.down_proj"][:4].any()  # never picked


def test_sp_fsdp_matches_single_process(runs):
    (ref_loss, ref_grads), ranks = runs[0]["omni"], runs[1]
    _check_loss([r["sp"][0] for r in ranks], ref_loss)
    assert_grads_close(ranks[0]["sp"][1], ref_grads)


def test_tp_fsdp_matches_single_process(runs):
    (ref_loss, ref_grads), ranks = runs[0]["omni"], runs[1]
    _check_loss([r["tp"][0] for r in ranks], ref_loss)
    assert_grads_close(ranks[0]["tp"][1], ref_grads)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp_fsdp_matches_single_process(runs, schedule):
    (ref_loss, ref_grads), ranks = runs[0]["pp"], runs[1]
    stages = [r["pp"][schedule] for r in ranks]
    assert [loss is None for loss, _ in stages] == [True, True, False, False]
    _check_loss([loss for loss, _ in stages[2:]], ref_loss)
    first, last = stages[0][1], stages[2][1]  # dp rank 0 of each stage
    assert not first.keys() & last.keys()
    assert_grads_close(first | last, ref_grads)
    assert [r["pp"]["units"] for r in ranks] == [2, 2, 2, 2]


def test_pp_tp_matches_single_process(runs):
    (ref_loss, ref_grads), ranks = runs[0]["pp"], runs[1]
    stages = [r["pp"]["tp"] for r in ranks]
    assert [loss is None for loss, _, _ in stages] == [True, True, False, False]
    for loss, _, _ in stages[2:]:  # both TP ranks of the last stage score the whole loss
        assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(stages[0][1] | stages[2][1], ref_grads)
    # the first stage's embeddings and the last stage's LM head are split over the vocabulary
    assert [s[2] for s in stages] == [{"embed_tokens.weight": "DTensor"}] * 2 + \
        [{"lm_head.weight": "DTensor"}] * 2
