"""Activation checkpointing is exact: `full` and `selective` give the loss and gradients of the
same model without checkpointing (one process; with FSDP and TP it runs in test_tp), keep
state-dict keys, and recompute what they promise: full re-runs every block's matmuls in
backward, selective re-runs none (it keeps their outputs) but saves less than no AC."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omniscale.parallel.checkpointing import apply_ac
from tests.parallel.dist_models import (
    assert_grads_close,
    build,
    full_grads,
    global_tokens,
    pack,
    sequences,
    step_loss,
)

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in MATMULS
        return func(*args, **(kwargs or {}))


def run(mode: str | None) -> dict:
    model = build()
    if mode:
        apply_ac(model, mode)
    seqs = sequences()
    saved = []

    def pack_hook(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        loss = step_loss(model, pack(seqs), global_tokens(seqs))
    with CountMatmuls() as backward:
        loss.backward()
    return {"model": model, "loss": loss.item(), "grads": full_grads(model),
            "saved": sum(saved), "backward_matmuls": backward.n}


@pytest.fixture(scope="module")
def runs():
    return {mode: run(mode) for mode in (None, "full", "selective")}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_gives_identical_loss_and_gradients(runs, mode):
    plain, ac = runs[None], runs[mode]
    assert ac["loss"] == plain["loss"]
    assert_grads_close(ac["grads"], plain["grads"], rtol=0, atol=0)
    assert ac["model"].state_dict().keys() == plain["model"].state_dict().keys()


def test_recompute_is_what_each_mode_promises(runs):
    plain, full, selective = runs[None], runs["full"], runs["selective"]
    assert full["saved"] < plain["saved"]  # the outer graph keeps only block inputs
    assert full["backward_matmuls"] > plain["backward_matmuls"]  # forward matmuls re-run
    assert selective["backward_matmuls"] == plain["backward_matmuls"]  # outputs kept


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode 'some': choose one of full, selective"):
        apply_ac(build(), "some")
