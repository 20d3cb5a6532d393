"""Tensor parallelism on real gloo ranks gives the single-process loss and gradients: TP over 2
ranks, and the full stack TP → AC → FSDP on a 2 × 2 mesh (data-parallel ranks hold different
sequences; the two TP ranks of a pair hold the same ones, split over heads and features).

The vocabulary-parallel loss on its own, over several chunks of tokens and an uneven split of
the vocabulary, equals `F.cross_entropy` of the whole logits (loss, hidden and weight
gradients), and no tensor it makes (forward and backward) is larger than a chunk's logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from omniscale.kernels.fused import CPU_CHUNK_ROWS
from omniscale.layout import IGNORE_INDEX
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


# ---- the vocabulary-parallel loss ----------------------------------------------------------

# Three chunks of CPU_CHUNK_ROWS tokens, the last one short; an odd vocabulary, so TP rank 0
# holds 32 rows and rank 1 31; a narrow width, so a chunk's logits are the largest thing the
# loss needs and [T, V/tp] is twice as large.
T, V, D = 2 * CPU_CHUNK_ROWS + 77, 63, 8


def _loss_inputs():
    g = torch.Generator().manual_seed(5)
    hidden_TD = torch.randn(T, D, generator=g, dtype=torch.float64)
    weight_VD = torch.randn(V, D, generator=g, dtype=torch.float64)
    labels_T = torch.randint(0, V, (T,), generator=g)
    labels_T[::7] = IGNORE_INDEX
    return hidden_TD, weight_VD, labels_T


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _vocab_loss_rank(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from omniscale.parallel.tensor import vocab_parallel_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    hidden_TD, weight_VD, labels_T = _loss_inputs()
    weight_VD = torch.nn.Parameter(distribute_tensor(weight_VD, mesh, [Shard(0)]))
    hidden_TD.requires_grad_()
    with LargestTensor() as largest:
        loss = vocab_parallel_loss(weight_VD, hidden_TD, labels_T)
        loss.backward()
    with torch.no_grad():  # evaluation: the loss alone
        eval_loss = vocab_parallel_loss(weight_VD, hidden_TD, labels_T)
    return (loss.item(), eval_loss.item(), hidden_TD.grad, weight_VD.grad.full_tensor(),
            largest.numel)


def test_vocab_parallel_loss_is_exact_and_chunked():
    hidden_TD, weight_VD, labels_T = _loss_inputs()
    hidden_TD.requires_grad_()
    weight_VD.requires_grad_()
    want = F.cross_entropy(hidden_TD @ weight_VD.T, labels_T, ignore_index=IGNORE_INDEX,
                           reduction="sum")
    want.backward()
    v = -(-V // 2)
    for loss, eval_loss, d_hidden, d_weight, largest in run_ranks(_vocab_loss_rank, 2):
        assert largest <= CPU_CHUNK_ROWS * v < T * v  # one chunk's logits, never [T, V/tp]
        assert loss == pytest.approx(want.item(), rel=1e-12)
        assert eval_loss == loss
        torch.testing.assert_close(d_hidden, hidden_TD.grad)
        torch.testing.assert_close(d_weight, weight_VD.grad)
