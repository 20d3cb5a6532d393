"""Tensor parallelism on real gloo ranks gives the single-process loss and gradients: TP over 2
ranks, and the full stack TP → AC → FSDP on a 2 × 2 mesh (data-parallel ranks hold different
sequences; the two TP ranks of a pair hold the same ones, split over heads and features)."""

from __future__ import annotations

import pytest

from omniscale.parallel.tensor import apply_tp
from tests.parallel.dist_models import CONFIG, assert_grads_close, parallel_step, reference
from tests.parallel.multiproc import run_ranks


def check(results):
    ref_loss, ref_grads = reference()
    for loss, _ in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(results[0][1], ref_grads)


def test_tp_on_2_ranks_matches_single_process():
    check(run_ranks(parallel_step, 2, 1, 2))


def test_fsdp_tp_ac_on_2x2_matches_single_process():
    check(run_ranks(parallel_step, 4, 2, 2, "full"))


def test_tp_of_one_leaves_the_model_alone():
    from omniscale.backbone.decoder import MoEDecoder

    class OneRank:
        def size(self):
            return 1

    model = MoEDecoder(CONFIG)
    before = {n: type(p) for n, p in model.named_parameters()}
    assert apply_tp(model, OneRank()) is model
    assert {n: type(p) for n, p in model.named_parameters()} == before
