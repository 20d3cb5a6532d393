"""Varlen attention with the flash kernel inside PyTorch (`torch.nn.attention.varlen.varlen_attn`,
torch >= 2.10): the CUDA default. The packed sequences go in as they are, `cu_seqlens` delimits
them, no mask is built and nothing is compiled, so a packed length that changes every
micro-batch costs nothing extra (flex attention compiles per shape: kernels/flex.py).

Same signature as `kernels.reference.varlen_attention`. The contract of `varlen_attn` in torch
2.11 (torch/nn/attention/varlen.py, the FlashAttention-2 kernels it calls):
- q [T, H, K], k and v [T, G, K] with G dividing H: grouped-query attention is native (the
  kernel maps query head h to kv head h·G/H, as SDPA's enable_gqa), so k/v are not repeated;
- fp16 or bf16, head dim a multiple of 8 and at most 256, last dim contiguous, an Ampere or
  newer GPU (the registry checks the GPU);
- `cu_seq_q` / `cu_seq_k` int32 on q's device, `max_q` / `max_k` Python ints;
- causal is `window_size=(-1, 0)`, a tuple (it tests `window_size == (-1, 0)`);
- forward and backward are custom ops with fake kernels: torch.compile and selective
  activation checkpointing see one op (parallel/checkpointing.py keeps its output).
Inputs outside that contract (fp32, an odd head dim) go to flex attention, which computes them
exactly, rather than being cast (flash-attn's adapter, kernels/flash.py, casts fp32 to bf16).

Tokens outside every sequence (before `cu_seqlens[0]` or from `cu_seqlens[-1]` on) are never
touched by the kernel: their output rows, and their rows of dq/dk/dv in the backward, hold
whatever the allocator left (NaN possibly, which the MoE router would spread). The contract is
zeros: the output is masked, and the gradients pass through `_ZeroGradOutside` (no host sync:
the mask is built on the device).

Shape suffixes: T tokens, H query heads, G key/value heads, K head dim, S sequences.
"""

from __future__ import annotations

from typing import Callable

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def supported(q_THK: torch.Tensor, k_TGK: torch.Tensor) -> bool:
    """Whether `varlen_attn` takes these inputs (dtype, head dim, head grouping)."""
    K = q_THK.shape[-1]
    return (q_THK.dtype in HALF_DTYPES and K % 8 == 0 and K <= MAX_HEAD_DIM
            and q_THK.shape[1] % k_TGK.shape[1] == 0)


class _ZeroGradOutside(torch.autograd.Function):
    """Identity forward; the backward zeroes the gradient rows of tokens outside every
    sequence (the kernel leaves them unwritten)."""

    @staticmethod
    def forward(ctx, x_TNK, outside_T):
        ctx.save_for_backward(outside_T)
        return x_TNK.view_as(x_TNK)

    @staticmethod
    def backward(ctx, grad_TNK):
        (outside_T,) = ctx.saved_tensors
        return grad_TNK.masked_fill(outside_T[:, None, None], 0.0), None


def packed_varlen(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor,
                  cu_seqlens_S1: torch.Tensor, max_seqlen, causal: bool,
                  attn: Callable) -> torch.Tensor:
    """The call of `attn` (varlen_attn's signature) that the contract above asks for, and the
    zeros outside every sequence. `attn` is a parameter so that CPU tests can run this
    preparation against a CPU implementation of the same contract."""
    device = q_THK.device
    cu_S1 = cu_seqlens_S1.to(device=device, dtype=torch.int32)
    # a SymInt under torch.compile stays symbolic (int() would specialise on every length)
    max_seqlen = int(max_seqlen) if isinstance(max_seqlen, torch.Tensor) else max_seqlen
    t_T = torch.arange(q_THK.shape[0], device=device)
    outside_T = (t_T < cu_S1[0]) | (t_T >= cu_S1[-1])
    q, k, v = (_ZeroGradOutside.apply(t.contiguous(), outside_T) for t in (q_THK, k_TGK, v_TGK))
    out_THK = attn(q, k, v, cu_S1, cu_S1, max_seqlen, max_seqlen,
                   window_size=(-1, 0) if causal else (-1, -1))
    return out_THK.masked_fill(outside_T[:, None, None], 0.0)


def varlen_attention(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor,
                     cu_seqlens_S1: torch.Tensor, max_seqlen: int, causal: bool = True
                     ) -> torch.Tensor:
    if not supported(q_THK, k_TGK):
        from omniscale.kernels import flex

        return flex.varlen_attention(q_THK, k_TGK, v_TGK, cu_seqlens_S1, max_seqlen, causal)
    from torch.nn.attention.varlen import varlen_attn

    return packed_varlen(q_THK, k_TGK, v_TGK, cu_seqlens_S1, max_seqlen, causal, varlen_attn)
