"""The plain-torch chunked linear cross-entropy (the CPU default) against the reference on
what the small Triton-interpreter tests do not reach: a vocabulary wide enough for the
vectorised softmax, many chunks that do not divide the tokens, fp64, all labels ignored,
very wrong predictions (the loss must not underflow to inf), and the CPU chunk size."""

from __future__ import annotations

import pytest
import torch

from omniscale.kernels import fused, reference


def both(h, w, labels, reduction, chunk):
    out = {}
    for name, fn in (("chunked", lambda *a: fused.linear_cross_entropy_chunked(
            *a, -100, reduction, fused.torch_chunk_step, chunk)),
            ("reference", lambda *a: reference.linear_cross_entropy(*a, -100, reduction))):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = fn(hh, ww, labels)
        loss.backward(torch.tensor(1.3, dtype=loss.dtype))
        out[name] = (loss.detach(), hh.grad, ww.grad)
    return out["chunked"], out["reference"]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk", [7, None])
def test_chunked_matches_reference_wide_vocabulary(reduction, chunk):
    torch.manual_seed(0)
    h, w = torch.randn(50, 16), torch.randn(3001, 16) / 4
    labels = torch.randint(0, 3001, (50,))
    labels[[3, 17, 49]] = -100
    for got, want in zip(*both(h, w, labels, reduction, chunk)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chunked_fp64_and_all_ignored():
    torch.manual_seed(0)
    h, w = torch.randn(9, 8, dtype=torch.float64), torch.randn(40, 8, dtype=torch.float64)
    labels = torch.randint(0, 40, (9,))
    loss, dh, dw = both(h, w, labels, "sum", 4)[0]
    assert loss.dtype == torch.float64
    ref = reference.linear_cross_entropy(h.float(), w.float(), labels)
    torch.testing.assert_close(loss.float(), ref)
    ignored = torch.full((9,), -100)
    (loss, dh, dw), _ = both(h, w, ignored, "sum", 4)
    assert loss == 0 and dh.abs().sum() == 0 and dw.abs().sum() == 0


def test_chunked_loss_of_a_very_wrong_prediction_is_finite():
    h = torch.tensor([[30.0, 0.0], [0.0, 1.0]])
    w = torch.tensor([[10.0, 0.0], [-10.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([1, 2])  # token 0: the target's logit is 600 below the maximum
    (loss, dh, dw), (loss_ref, dh_ref, dw_ref) = both(h, w, labels, "sum", None)
    assert torch.isfinite(loss) and torch.isclose(loss, loss_ref)
    torch.testing.assert_close(dh, dh_ref)
    torch.testing.assert_close(dw, dw_ref)


def test_cpu_chunks_are_fixed_rows_gpu_chunks_memory_sized():
    for vocab in (1024, 8192, 151_936):
        assert fused.default_chunk(torch.device("cpu"), vocab) == fused.CPU_CHUNK_ROWS
    assert fused.default_chunk(torch.device("cuda"), 8192) == fused.CHUNK_ELEMENTS // 8192
