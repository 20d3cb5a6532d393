"""Fused linear + cross-entropy against the torch reference (which materialises the logits),
forward and backward: the Triton per-chunk kernel on CPU in Triton's interpreter and the pure
torch chunked path (fp32; vocabularies that are not powers of two, one wider than a kernel
block, chunks that do not divide the tokens, ignored labels, sum and mean), and Triton on CUDA
in bf16 (gpu). Tolerances, relative to the largest reference value: fp32 1e-5; bf16 3e-2 (the
logits are a bf16 matmul's output in the fused path, fp32 in the reference)."""

from __future__ import annotations

import pytest
import torch

from omniscale.kernels import fused, reference, triton_linear_ce

pytestmark = pytest.mark.usefixtures("triton_env")


def near(got, want, tol):
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=tol * max(scale, 1.0), rtol=tol)


def triton_chunks_of(chunk):
    def fn(h, w, labels, ignore_index=-100, reduction="sum"):
        return fused.linear_cross_entropy_chunked(h, w, labels, ignore_index, reduction,
                                                  triton_linear_ce.triton_chunk_step, chunk)
    return fn


IMPLS = {"triton": triton_linear_ce.linear_cross_entropy,
         "triton_chunks_of_4": triton_chunks_of(4),
         "torch_chunked": fused.chunked_linear_cross_entropy}


def check(fn, T, D, V, reduction, ignored=(), device="cpu", dtype=torch.float32, tol=1e-5):
    torch.manual_seed(0)
    h = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, D, device=device, dtype=dtype) / D ** 0.5).requires_grad_()
    labels = torch.randint(0, V, (T,), device=device)
    labels[list(ignored)] = -100
    if T > 2:
        labels[0], labels[1] = 0, V - 1  # both ends of the vocabulary
    loss = fn(h, w, labels, ignore_index=-100, reduction=reduction)
    loss_ref = reference.linear_cross_entropy(h, w, labels, -100, reduction)
    near(loss, loss_ref, tol)
    for got, want in zip(torch.autograd.grad(1.7 * loss, (h, w)),
                         torch.autograd.grad(1.7 * loss_ref, (h, w))):
        near(got, want, tol)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_ce_matches_reference(impl, reduction):
    check(IMPLS[impl], 13, 24, 37, reduction, ignored=(4, 9))


def test_linear_ce_vocabulary_wider_than_a_block():
    check(IMPLS["triton"], 3, 8, 5003, "mean")


def test_linear_ce_all_labels_ignored():
    h, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4)
    labels = torch.full((3,), -100)
    loss = triton_linear_ce.linear_cross_entropy(h, w, labels)
    assert loss.item() == 0.0 and torch.equal(torch.autograd.grad(loss, h)[0], torch.zeros(3, 4))
    assert triton_linear_ce.linear_cross_entropy(h, w, labels, reduction="mean").isnan()


def test_linear_ce_reduction_none_and_no_grad():
    h, w = torch.randn(6, 4), torch.randn(7, 4)
    labels = torch.tensor([1, 2, -100, 6, 0, 3])
    near(triton_linear_ce.linear_cross_entropy(h, w, labels, reduction="none"),
         reference.linear_cross_entropy(h, w, labels, reduction="none"), 1e-5)
    with torch.no_grad():
        near(triton_linear_ce.linear_cross_entropy(h, w, labels),
             reference.linear_cross_entropy(h, w, labels), 1e-5)
    with pytest.raises(ValueError, match="reduction 'avg'"):
        triton_linear_ce.linear_cross_entropy(h, w, labels, reduction="avg")


def test_linear_ce_mixed_dtypes():
    # bf16 activations against an fp32 weight (mixed precision): promoted as a matmul would be,
    # gradients returned in each input's own dtype.
    h = torch.randn(9, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    labels = torch.randint(0, 11, (9,))
    loss = triton_linear_ce.linear_cross_entropy(h, w, labels)
    loss_ref = reference.linear_cross_entropy(h, w, labels)
    near(loss, loss_ref, 1e-5)
    grads = torch.autograd.grad(loss, (h, w))
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32]
    for got, want in zip(grads, torch.autograd.grad(loss_ref, (h, w))):
        near(got, want, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_ce_matches_reference_on_cuda(reduction):
    check(triton_linear_ce.linear_cross_entropy, 2049, 1024, 151936, reduction,
          ignored=range(0, 2049, 7), device="cuda", dtype=torch.bfloat16, tol=3e-2)
