"""Tensor parallelism beyond the decoder blocks, on 2 real gloo ranks against one process (loss
and every gradient): the omni model's vision and audio encoder blocks split over the encoder
mesh's `encoder_tp` (fused qkv and gate_up regrouped per forward; in the Qwen2-VL / Whisper
layouts, fc1-activation-fc2 MLPs with biases), its token embeddings and LM
head split over the vocabulary (an odd size: an uneven split) with the vocabulary-
parallel cross-entropy and gathered logits; and a decoder with tied embeddings, where one split
weight serves the lookup and the loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.parallel.dist_models import (
    CONFIG,
    TextLM,
    assert_grads_close,
    full_grads,
    global_tokens,
    omni_collate,
    omni_model,
    omni_samples,
    omni_step,
    pack,
    sequences,
    step_loss,
)
from tests.parallel.multiproc import run_ranks

# One worker runs the module (`--dist loadgroup`): its module fixture, a multi-rank run, is
# built once instead of on each worker that draws one of its tests.
pytestmark = pytest.mark.xdist_group("tp_omni")

KINDS = ["image", "audio", "video"]
TIED = dataclasses.replace(CONFIG, tie_embeddings=True)
VOCAB = 375  # over the demo tokenizer's ids; odd, so TP rank 0 holds 188 rows and rank 1 187
# parameter -> its local shape on TP rank 0 (of 2): split layers hold their share, not a copy
SPLIT = {"vision.blocks.0.qkv.weight": (96, 64), "vision.blocks.1.gate_up.weight": (128, 64),
         "audio.blocks.0.qkv.bias": (96,), "audio.blocks.1.down.weight": (64, 64),
         "decoder.embed_tokens.weight": (188, 64), "decoder.lm_head.weight": (188, 64),
         "decoder.layers.0.attn.q_proj.weight": (64, 64)}


def _hidden() -> torch.Tensor:
    return torch.randn(5, 64, generator=torch.Generator().manual_seed(1))


def _tied_reference() -> tuple[float, dict]:
    torch.manual_seed(0)
    model = TextLM(TIED)
    seqs = sequences()
    loss = step_loss(model, pack(seqs), global_tokens(seqs))
    loss.backward()
    return loss.item(), full_grads(model)


def _tp_ranks(rank, world, vocab_size, packed, n_global):
    from omniscale.parallel import ParallelDims, apply_tp

    dims = ParallelDims(tp=world, encoder_tp=world, world_size=world)
    model = omni_model(vocab_size)
    dims.validate_for(model.config)
    mesh, encoder_mesh = dims.build_mesh("cpu"), dims.build_encoder_mesh("cpu")
    apply_tp(model, mesh["tp"], encoder_mesh["encoder_tp"])
    omni_loss = omni_step(model, packed, n_global).item()
    shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if n in SPLIT}
    hf_layouts = omni_model(vocab_size, hf_layouts=True)  # fc1/act/fc2 MLPs, biases
    apply_tp(hf_layouts, mesh["tp"], encoder_mesh["encoder_tp"])
    hf_loss = omni_step(hf_layouts, packed, n_global).item()
    logits = model.decoder.logits(_hidden()).detach().numpy()

    torch.manual_seed(0)
    tied = apply_tp(TextLM(TIED), mesh["tp"])
    seqs = sequences()
    tied_loss = step_loss(tied, pack(seqs), global_tokens(seqs))
    tied_loss.backward()
    omni_grads, tied_grads = full_grads(model), full_grads(tied)  # collectives: every rank
    hf_grads = full_grads(hf_layouts)
    return {"omni": (omni_loss, omni_grads if rank == 0 else None), "shapes": shapes,
            "hf_layouts": (hf_loss, hf_grads if rank == 0 else None),
            "logits": logits, "tied": (tied_loss.item(), tied_grads if rank == 0 else None)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    vocab_size, samples = omni_samples(KINDS, tmp_path_factory.mktemp("tok") / "tok.json")
    assert vocab_size <= VOCAB
    vocab_size = VOCAB
    packed = omni_collate([(s, 1, 0) for s in samples])
    n_global = int((packed.labels_T != -100).sum())
    model = omni_model(vocab_size)
    ref_loss = omni_step(model, packed, n_global).item()
    ref_logits = (_hidden() @ model.decoder.lm_weight_VD.T).detach()
    hf_layouts = omni_model(vocab_size, hf_layouts=True)
    hf_loss = omni_step(hf_layouts, packed, n_global).item()
    reference = {"omni": (ref_loss, full_grads(model)), "logits": ref_logits,
                 "tied": _tied_reference(), "hf_layouts": (hf_loss, full_grads(hf_layouts))}
    return reference, run_ranks(_tp_ranks, 2, vocab_size, packed, n_global)


@pytest.mark.parametrize("case", ["omni", "tied", "hf_layouts"])
def test_tp_matches_single_process(runs, case):
    reference, ranks = runs
    ref_loss, ref_grads = reference[case]
    for r in ranks:
        assert r[case][0] == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(ranks[0][case][1], ref_grads)


def test_encoders_embeddings_and_head_are_split(runs):
    reference, ranks = runs
    assert ranks[0]["shapes"] == SPLIT
    assert ranks[1]["shapes"]["decoder.lm_head.weight"] == (187, 64)  # torch.chunk: ceil first
    for r in ranks:  # gathered logits: the whole vocabulary on every rank
        torch.testing.assert_close(torch.as_tensor(r["logits"]), reference["logits"])
