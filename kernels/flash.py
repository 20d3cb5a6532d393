"""Varlen attention with flash-attn (Dao-AILab/flash-attention) on CUDA: the packed sequences
go in as they are, `cu_seqlens` delimits them, grouped-query attention is native.

Same signature as `kernels.reference.varlen_attention`. flash-attn computes in fp16/bf16 only:
fp32 inputs are cast to bf16 and the output back to fp32 (training in fp32 on GPU is for
debugging; use `OMNISCALE_KERNELS=reference` there for exact fp32). flash_attn is imported
inside the function so that importing this module never needs it.

Shape suffixes: T tokens, H query heads, G key/value heads, K head dim, S sequences.
"""

from __future__ import annotations

import torch


def varlen_attention(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor,
                     cu_seqlens_S1: torch.Tensor, max_seqlen: int, causal: bool = True
                     ) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    dtype = q_THK.dtype
    compute = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    cu_S1 = cu_seqlens_S1.to(device=q_THK.device, dtype=torch.int32)
    max_seqlen = int(max_seqlen)
    out_THK = flash_attn_varlen_func(
        q_THK.to(compute), k_TGK.to(compute), v_TGK.to(compute),
        cu_seqlens_q=cu_S1, cu_seqlens_k=cu_S1, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, dropout_p=0.0, causal=causal).to(dtype)
    # flash-attn leaves rows outside every sequence (padding before the first or after the
    # last) as it allocated them; the contract is zeros there, as unwritten memory can hold
    # NaN, which the MoE router would spread into the aux loss.
    # (no host sync: the mask is built on the device)
    t_T = torch.arange(out_THK.shape[0], device=out_THK.device)
    outside_T = (t_T < cu_S1[0]) | (t_T >= cu_S1[-1])
    out_THK = out_THK.masked_fill(outside_T[:, None, None], 0.0)
    return out_THK
