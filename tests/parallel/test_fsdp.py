"""FSDP2 on real gloo ranks gives the single-process loss and gradients: the tiny MoE decoder on
2 and 4 ranks, and the omni model (vision + audio encoders on their own encoder mesh) on 2.

Each data-parallel rank gets its contiguous share of one global batch and divides its summed
token loss by the global token count; FSDP sums gradients, so the gathered (`full_tensor`)
gradients must equal those of one process on the whole batch.
"""

from __future__ import annotations

import pytest

from tests.backbone.omni_batches import (  # tests/backbone, via dist_models
    batch,
    decoded,
    render,
    tokenizer,
)
from tests.parallel.dist_models import (
    assert_grads_close,
    full_grads,
    omni_model,
    omni_step,
    parallel_step,
    reference,
)
from tests.parallel.multiproc import run_ranks

# One worker runs the module (`--dist loadgroup`): its module fixture, a multi-rank run, is
# built once instead of on each worker that draws one of its tests.
pytestmark = pytest.mark.xdist_group("fsdp")

OMNI_KINDS = ["image", "audio", "video", "image"]  # rank 1 of 2 has no audio: dummy path


def _omni_fsdp(rank, world, vocab_size, shards, n_global):
    import torch.distributed as dist

    from omniscale.parallel import ParallelDims, apply_fsdp

    dims = ParallelDims(world_size=world)
    mesh, encoder_mesh = dims.build_mesh("cpu"), dims.build_encoder_mesh("cpu")
    model = apply_fsdp(omni_model(vocab_size), mesh, encoder_mesh=encoder_mesh)
    loss = omni_step(model, shards[rank], n_global).detach()
    dist.all_reduce(loss, group=mesh["dp"].get_group())
    grads = full_grads(model)
    return loss.item(), grads if rank == 0 else None


def _two_ranks(rank, world, vocab_size, shards, n_global):
    """Both 2-rank cases in one set of processes (spawning ranks dominates the test time)."""
    return parallel_step(rank, world, world, 1), _omni_fsdp(rank, world, vocab_size, shards,
                                                            n_global)


@pytest.fixture(scope="module")
def omni_batches(tmp_path_factory):
    rendered = render(OMNI_KINDS, seed=0)
    tok = tokenizer([c for _, _, c in rendered], tmp_path_factory.mktemp("tok") / "tok.json")
    samples = [decoded(kind, media, caption, tok) for kind, media, caption in rendered]
    whole = batch(samples)
    n_global = int((whole.labels_T != -100).sum())
    return tok.tokenizer.get_vocab_size(), whole, [batch(samples[:2]), batch(samples[2:])], n_global


@pytest.fixture(scope="module")
def two_ranks(omni_batches):
    vocab_size, _, shards, n_global = omni_batches
    return run_ranks(_two_ranks, 2, vocab_size, shards, n_global)


def check(results, ref_loss, ref_grads):
    for loss, _ in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(results[0][1], ref_grads)


def test_fsdp_decoder_on_2_ranks_matches_single_process(two_ranks):
    check([decoder for decoder, _ in two_ranks], *reference())


def test_fsdp_decoder_on_4_ranks_matches_single_process():
    check(run_ranks(parallel_step, 4, 4, 1), *reference())


def test_fsdp_omni_with_encoder_mesh_matches_single_process(omni_batches, two_ranks):
    vocab_size, whole, _, n_global = omni_batches
    model = omni_model(vocab_size)
    ref_loss = omni_step(model, whole, n_global).item()
    check([omni for _, omni in two_ranks], ref_loss, full_grads(model))

