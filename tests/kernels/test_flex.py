"""The attention backends registered beside the reference: flex (tested against the SDPA
reference here, forward on CPU; its block mask built once per micro-batch and its compiles
once per length bucket) and flash (CUDA only: its selection and the adapter's own handling of
dtypes and of tokens outside every sequence are tested here, against flash-attn itself only
on a GPU, by tools/bench/gpu_check.sh through the `gpu` marker). torch's varlen kernel, the
CUDA default: tests/kernels/test_varlen.py."""

from __future__ import annotations

import pytest
import torch

from omniscale import kernels
from omniscale.kernels import flash, flex, reference


def qkv(lengths, heads=4, kv_heads=2, dim=16, requires_grad=False):
    torch.manual_seed(0)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, dim, requires_grad=requires_grad)
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths", [[64], [5, 130, 1, 200, 64], [3, 3, 3]])
def test_flex_equals_reference(lengths, causal):
    q, k, v, cu = qkv(lengths)
    with torch.no_grad():
        out = flex.varlen_attention(q, k, v, cu, max(lengths), causal)
        ref = reference.varlen_attention(q, k, v, cu, max(lengths), causal)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_flex_gives_zeros_outside_every_sequence(causal):
    q, k, v, _ = qkv([3, 5, 4, 2])  # 14 tokens: 3 before the sequences, 2 after
    cu = torch.tensor([3, 8, 12], dtype=torch.int32)
    with torch.no_grad():
        out = flex.varlen_attention(q, k, v, cu, 5, causal)
        ref = reference.varlen_attention(q, k, v, cu, 5, causal)
    assert out[:3].eq(0).all() and out[12:].eq(0).all()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_sequence_ids():
    cu = torch.tensor([0, 2, 2, 5])
    assert flex.sequence_ids(cu, 5).tolist() == [0, 0, 2, 2, 2]


def test_selection():
    assert kernels.backend_of("varlen_attention", "cpu") == "blocked"
    assert kernels.backend_of("varlen_attention", "cpu", prefer="flex") == "flex"
    assert kernels.backend_of("varlen_attention", "cpu", prefer="flash") == "reference"
    assert kernels.backend_of("varlen_attention", "cpu", prefer="varlen") == "reference"
    assert kernels.backend_of("varlen_attention", "cpu", prefer="reference") == "reference"
    # torch 2.11 ships varlen_attn: the CUDA default (this machine's GPU, if any, is Ampere+)
    assert kernels.backend_of("varlen_attention", "cuda") == "varlen"
    assert kernels.backend_of("varlen_attention", "cuda", prefer="flex") == "flex"


def test_buckets_are_few_and_pad_at_most_a_quarter():
    assert [flex.bucket(t) for t in (0, 1, 128, 129, 300, 384, 385, 1000, 1025, 5000)] == \
        [128, 128, 128, 256, 384, 384, 512, 1024, 1280, 5120]
    padded = [flex.bucket(t) for t in range(1, 20000)]
    assert all(p % 128 == 0 and p >= t for t, p in zip(range(1, 20000), padded))
    assert all(p - t <= max(127, t // 4) for t, p in zip(range(1, 20000), padded))
    assert len(set(p for p in padded if 8192 < p <= 16384)) == 4  # 4 shapes per doubling


def test_block_mask_built_once_per_micro_batch(monkeypatch):
    """The decoder hands one cu_seqlens tensor to every layer: the mask is built for the
    first layer only; a new micro-batch (a new tensor, even with equal contents) and an
    in-place change of the tensor build it again, and the result follows the new bounds."""
    from torch.nn.attention import flex_attention as flex_module

    builds = []
    create = flex_module.create_block_mask

    def counting(*args, **kwargs):
        builds.append(args[3])  # the (padded) query length
        return create(*args, **kwargs)

    monkeypatch.setattr(flex_module, "create_block_mask", counting)
    q, k, v, cu = qkv([5, 130, 1, 64])
    with torch.no_grad():
        ref = reference.varlen_attention(q, k, v, cu, 130)
        for _layer in range(4):
            torch.testing.assert_close(flex.varlen_attention(q, k, v, cu, 130), ref,
                                       atol=2e-6, rtol=1e-5)
        assert builds == [256]
        flex.varlen_attention(q, k, v, cu.clone(), 130)  # the next micro-batch
        assert len(builds) == 2
        cu[2] = 100  # same tensor, other bounds
        out = flex.varlen_attention(q, k, v, cu, 130)
        assert len(builds) == 3
        torch.testing.assert_close(out, reference.varlen_attention(q, k, v, cu, 130),
                                   atol=2e-6, rtol=1e-5)


def test_compiled_flex_compiles_once_per_length_bucket():
    """Packed lengths 300 and 330 share the 384 bucket: one compile (the old exact-length
    compile made one per micro-batch); 600 is another bucket. The compiles are counted by
    dynamo's CompileCounter backend (eager: CPU inductor would take ~45 s here); what is
    compiled and what dynamo guards on are the same as on CUDA."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    attend = flex.compiled_flex(counter)
    try:
        for lengths, compiles in (([100, 200], 1), ([50, 250, 30], 1), ([500, 100], 2)):
            q, k, v, cu = qkv(lengths)
            with torch.no_grad():
                out = flex.packed_flex(q, k, v, cu, True, attend)
            torch.testing.assert_close(out, reference.varlen_attention(q, k, v, cu, 500),
                                       atol=2e-6, rtol=1e-5)
            assert counter.frame_count == compiles, (lengths, counter.frame_count)
    finally:
        torch._dynamo.reset()


def test_flex_refuses_cpu_backward_clearly():
    q, k, v, cu = qkv([8, 8], requires_grad=True)
    with pytest.raises(NotImplementedError, match="reference backend"):
        flex.varlen_attention(q, k, v, cu, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["varlen", "flex", "flash"])
def test_gpu_backend_matches_reference_with_grads(backend):
    if kernels.backend_of("varlen_attention", "cuda", prefer=backend) != backend:
        pytest.skip(f"{backend} not available")
    attend = kernels.get("varlen_attention", "cuda", prefer=backend)
    q, k, v, cu = qkv([5, 130, 1, 200, 64], requires_grad=True)
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in (q, k, v))
    cu = cu.cuda()
    out = attend(q, k, v, cu, 200, True)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = reference.varlen_attention(*ref_inputs, cu, 200, True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(ref)
    out.backward(g.bfloat16())
    ref.backward(g)
    for a, b in zip((q, k, v), ref_inputs):
        torch.testing.assert_close(a.grad.float(), b.grad, atol=5e-2, rtol=5e-2)


def test_flash_adapter_zeroes_tokens_outside_every_sequence(monkeypatch):
    """flash-attn's varlen call writes only the rows its cu_seqlens cover. A stand-in with
    that behaviour (the reference inside the sequences, NaN in every other row, as unwritten
    memory may hold) checks what the adapter adds: bf16 compute for fp32 inputs, the output
    back in fp32, and zeros outside every sequence, as the reference gives."""
    import sys
    import types

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, max_seqlen_q, causal, **_):
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16
        assert cu_seqlens_q.dtype == torch.int32
        out = torch.full_like(q, float("nan"))
        first, last = int(cu_seqlens_q[0]), int(cu_seqlens_q[-1])
        out[first:last] = reference.varlen_attention(
            q[first:last].float(), k[first:last].float(), v[first:last].float(),
            cu_seqlens_q - first, max_seqlen_q, causal).to(q.dtype)
        return out

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_varlen_func=flash_attn_varlen_func))
    q, k, v, _ = qkv([3, 5, 4, 2], requires_grad=True)  # 14 tokens
    cu = torch.tensor([3, 8, 12], dtype=torch.int64)  # 3 before, 2 after
    out = flash.varlen_attention(q, k, v, cu, 5)
    ref = reference.varlen_attention(q, k, v, cu, 5)
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert out[:3].eq(0).all() and out[12:].eq(0).all()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)  # bf16 inside
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
