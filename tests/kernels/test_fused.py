"""The plain-torch chunked linear cross-entropy (the CPU default) against the reference on
what the small Triton-interpreter tests do not reach: a vocabulary wide enough for the
vectorised softmax, many chunks that do not divide the tokens, fp64, all labels ignored,
very wrong predictions (the loss must not underflow to inf), and the CPU chunk size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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


class MatmulDtypes(TorchDispatchMode):
    """Records the operand dtypes of every matrix product (mm / addmm / addmm_, any
    overload) that runs inside it."""

    PRODUCTS = {torch.ops.aten.mm: (0, 2), torch.ops.aten.addmm: (1, 3),
                torch.ops.aten.addmm_: (1, 3)}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = self.PRODUCTS.get(func.overloadpacket)
        if where is not None:
            self.seen.append((str(func), tuple(a.dtype for a in args[slice(*where)])))
        return func(*args, **(kwargs or {}))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_bf16_head_runs_its_matmuls_in_bf16_within_bf16_error_of_fp32():
    """Mixed precision: bf16 hidden states and head weight. The logits, dH and dW products run
    in bf16 (fp32 accumulation, the softmax in fp32), and the loss and both gradients stay
    within bf16 error of an fp32 oracle computed independently: F.cross_entropy on the full
    fp32 logits of the same (bf16-valued) inputs. Bounds: the loss to 5e-4 relative (logits
    rounded once to bf16 on CPU, 2⁻⁹ relative each, errors of random sign; seen: 3e-5), the
    gradients to 1e-2 in relative norm (the logits' gradient rounded to bf16 for its two
    products, each chunk's dW product rounded once, the gradients returned in bf16: a few
    2⁻⁹; seen: 2-3e-3)."""
    torch.manual_seed(0)
    T, D, V = 300, 64, 1000
    h = torch.randn(T, D).bfloat16()
    w = (torch.randn(V, D) / 4).bfloat16()  # logits of std ~2
    labels = torch.randint(0, V, (T,))
    labels[::7] = -100
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with MatmulDtypes() as products:
        loss = fused.linear_cross_entropy_chunked(hh, ww, labels, -100, "sum",
                                                  fused.torch_chunk_step, 128)  # 3 chunks
        loss.backward()
    assert len(products.seen) == 3 * 3, products.seen  # per chunk: logits, dH, dW
    assert all(dtypes == (torch.bfloat16, torch.bfloat16) for _, dtypes in products.seen), \
        products.seen
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    loss_ref = F.cross_entropy(h32 @ w32.T, labels, ignore_index=-100, reduction="sum")
    loss_ref.backward()
    assert loss.dtype == torch.float32
    assert hh.grad.dtype == ww.grad.dtype == torch.bfloat16
    assert rel_err(loss.detach(), loss_ref.detach()) < 5e-4
    assert rel_err(hh.grad, h32.grad) < 1e-2
    assert rel_err(ww.grad, w32.grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_head_on_cuda_runs_bf16_products_into_fp32():
    """CUDA: the logits and dW products are bf16 GEMMs writing fp32 (out_dtype), dH a bf16
    GEMM; loss and gradients within bf16 error of the fp32 oracle (the logits are not rounded
    to bf16 there, so the loss is tighter than on CPU)."""
    torch.manual_seed(0)
    T, D, V = 2049, 512, 32000
    h = torch.randn(T, D, device="cuda").bfloat16()
    w = (torch.randn(V, D, device="cuda") / 16).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda")
    labels[::7] = -100
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with MatmulDtypes() as products:
        loss = fused.linear_cross_entropy_chunked(hh, ww, labels, -100, "sum",
                                                  fused.torch_chunk_step, 512)
        loss.backward()
    assert products.seen and all(dtypes == (torch.bfloat16, torch.bfloat16)
                                 for _, dtypes in products.seen), products.seen
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    loss_ref = F.cross_entropy(h32 @ w32.T, labels, ignore_index=-100, reduction="sum")
    loss_ref.backward()
    assert rel_err(loss.detach(), loss_ref.detach()) < 1e-3
    assert rel_err(hh.grad, h32.grad) < 1e-2
    assert rel_err(ww.grad, w32.grad) < 1e-2
