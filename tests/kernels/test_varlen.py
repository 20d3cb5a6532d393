"""torch's varlen_attn (kernels/varlen.py), the CUDA default for packed attention.

It runs on CUDA only, so on CPU two things are tested: the call it makes, under FakeTensorMode
with fake CUDA tensors (varlen_attn has a fake kernel): one `torch_attn::_varlen_attn` op with
the kv heads not repeated (GQA is native), int32 cu_seqlens on the device, Python-int maximum
lengths and the causal flag; and the adapter's numbers, with `varlen_attn` replaced by a CPU
implementation of the same contract (it checks what the flash kernel requires, computes per
sequence in fp32, and leaves garbage in the rows, and gradient rows, of tokens outside every
sequence, as the kernel does), against the SDPA reference in fp32. Against the real kernel:
the `gpu` tests (tools/bench/gpu_check.sh), vs the reference in bf16, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from omniscale import kernels
from omniscale.kernels import reference, varlen


class Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attn_call_on_fake_cuda(causal):
    with FakeTensorMode():
        q = torch.empty(14, 8, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.empty(14, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cu = torch.tensor([3, 8, 12])  # int64, on the host, tokens before and after
        with Calls() as seen:
            out = varlen.varlen_attention(q, k, v, cu, 5, causal)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "cuda"
    attn = [args for name, args in seen.calls if name == "torch_attn._varlen_attn.default"]
    assert len(attn) == 1
    aq, ak, av, cu_q, cu_k, max_q, max_k, is_causal, scale, window = attn[0]
    assert aq.shape == (14, 8, 64) and ak.shape == av.shape == (14, 2, 64)  # kv not repeated
    assert aq.dtype == ak.dtype == av.dtype == torch.bfloat16
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device.type == "cuda"
    assert (max_q, max_k) == (5, 5) and type(max_q) is int
    assert is_causal is causal and scale is None and window == ([-1, 0] if causal else [-1, -1])


def test_supported_inputs_and_the_rest_to_flex():
    bf = torch.empty(4, 8, 64, dtype=torch.bfloat16)
    assert varlen.supported(bf, bf[:, :2])
    assert varlen.supported(bf.half(), bf[:, :2].half())
    assert not varlen.supported(bf.float(), bf[:, :2].float())  # fp32: exact, in flex
    odd = torch.empty(4, 8, 36, dtype=torch.bfloat16)
    assert not varlen.supported(odd, odd)  # head dim not a multiple of 8
    wide = torch.empty(4, 2, 512, dtype=torch.bfloat16)
    assert not varlen.supported(wide, wide)


def sequence_attention(q, k, v, causal):
    """Softmax attention of one sequence in fp32, kv heads repeated for the query heads."""
    L, H, K = q.shape
    k, v = (t.float().repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhk,shk->hqs", q.float(), k) / math.sqrt(K)
    if causal:
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqs,shk->qhk", scores.softmax(-1), v)


class _CpuFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bounds, causal):
        ctx.save_for_backward(q, k, v)
        ctx.bounds, ctx.causal = bounds, causal
        out = torch.full_like(q, float("nan"))  # rows outside every sequence: never written
        for a, b in zip(bounds[:-1], bounds[1:]):
            out[a:b] = sequence_attention(q[a:b], k[a:b], v[a:b], causal).to(q.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        for a, b in zip(ctx.bounds[:-1], ctx.bounds[1:]):
            with torch.enable_grad():
                parts = [t[a:b].detach().float().requires_grad_() for t in (q, k, v)]
                o = sequence_attention(*parts, ctx.causal)
                for g, d in zip(grads, torch.autograd.grad(o, parts, grad[a:b].float())):
                    g[a:b] = d.to(g.dtype)
        return *grads, None, None


def cpu_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                    window_size=(-1, -1)):
    """varlen_attn's contract (torch/nn/attention/varlen.py, the flash kernel), on CPU."""
    assert query.dtype in (torch.float16, torch.bfloat16)
    assert key.dtype == value.dtype == query.dtype
    assert query.shape[1] % key.shape[1] == 0 and key.shape == value.shape
    assert all(t.stride(-1) == 1 for t in (query, key, value))
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    assert cu_seq_q.device == query.device and torch.equal(cu_seq_q, cu_seq_k)
    assert type(max_q) is int and type(max_k) is int
    assert isinstance(window_size, tuple) and window_size in ((-1, 0), (-1, -1))
    bounds = cu_seq_q.tolist()
    assert max(b - a for a, b in zip(bounds[:-1], bounds[1:])) <= max_q
    return _CpuFlash.apply(query, key, value, bounds, window_size == (-1, 0))


@pytest.mark.parametrize("causal", [True, False])
def test_adapter_against_the_reference_with_tokens_outside_every_sequence(causal):
    g = torch.Generator().manual_seed(0)
    T = 14  # 3 tokens before the sequences, 2 after
    q = torch.randn(T, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(T, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    cu = torch.tensor([3, 8, 9, 12])  # int64: the adapter makes it int32
    out = varlen.packed_varlen(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, 5, causal,
                               cpu_varlen_attn)
    ref = reference.varlen_attention(q, k, v, cu, 5, causal)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert out[:3].eq(0).all() and out[12:].eq(0).all()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn(ref.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v), grad.bfloat16())
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()  # the kernel's unwritten gradient rows are zeroed
        assert a[:3].eq(0).all() and a[12:].eq(0).all()
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen_default_matches_sdpa_reference_bf16(causal):
    """The registry's CUDA default against the SDPA reference (fp32, on the same bf16 values):
    GQA 4:1, head dim 128, tokens after the last sequence, forward and backward."""
    assert kernels.backend_of("varlen_attention", "cuda") == "varlen"
    attend = kernels.get("varlen_attention", "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    T = 700
    q = torch.randn(T, 8, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(T, 2, 128, device="cuda", generator=g).bfloat16().requires_grad_()
            for _ in range(2))
    cu = torch.tensor([0, 5, 135, 136, 400, 650], device="cuda", dtype=torch.int32)
    out = attend(q, k, v, cu, 264, causal)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = reference.varlen_attention(*ref_in, cu, 264, causal)
    assert out.dtype == torch.bfloat16 and out[650:].eq(0).all()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn(ref.shape, device="cuda", generator=g)
    got = torch.autograd.grad(out, (q, k, v), grad.bfloat16())
    want = torch.autograd.grad(ref, ref_in, grad)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and a[650:].eq(0).all()
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)

