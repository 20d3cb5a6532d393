"""Grouped-query attention over packed sequences (varlen): each sequence attends only to its
own tokens, delimited by `cu_seqlens`. Optional RMSNorm on q and k per head (Qwen3), rotary
positions (1-D, or multimodal M-RoPE when the caller passes 3-axis positions) and the
attention itself through the kernel registry (on CUDA torch's varlen flash kernel, flex
attention or flash-attn; on CPU row-blocked products or the SDPA reference).

The attention core (q, k, v after rotary -> output heads) is the `core` attribute so that
sequence parallelism (parallel/sequence.py) can wrap it with its all-to-alls without touching
this file, as expert parallelism swaps `MoE.dispatcher`.

Shape suffixes: T tokens (all packed sequences), D model width, H query heads, G key/value
heads, K head dim, S sequences (cu_seqlens has S+1 entries).
"""

from __future__ import annotations

import torch
from torch import nn

from omniscale import kernels
from omniscale.backbone.config import ModelConfig, kernel
from omniscale.backbone.norm import RMSNorm
from omniscale.kernels.reference import rotary_tables


def rope_tables(config: ModelConfig, position_ids_T: torch.Tensor,
                mrope_3T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, K] shared by every layer: 1-D rotary from `position_ids_T`, or M-RoPE
    (temporal/height/width sections of the frequency pairs) from `mrope_3T`."""
    return rotary_tables(
        position_ids_T, config.head_dim, config.rope_theta, mrope_position_3T=mrope_3T,
        mrope_sections=config.mrope_sections if mrope_3T is not None else None)


class VarlenCore:
    """Causal varlen attention through the kernel registry:
    `(q_THK, k_TGK, v_TGK, cu_seqlens_S1, max_seqlen) -> o_THK`."""

    def __init__(self, backend: str | None = None):
        self.backend = backend

    def __call__(self, q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor,
                 cu_seqlens_S1: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        attend = kernels.get("varlen_attention", q_THK.device, prefer=self.backend)
        return attend(q_THK, k_TGK, v_TGK, cu_seqlens_S1, max_seqlen, causal=True)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (config.n_heads, config.n_kv_heads,
                                                        config.head_dim)
        self.backend = config.attention_backend
        self.rotary_kernel = config.kernel_backend("rotary")
        self.core = VarlenCore(self.backend)  # parallel/sequence.py wraps it for Ulysses
        d_q, d_kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.d_model, d_q, bias=False)
        self.k_proj = nn.Linear(config.d_model, d_kv, bias=False)
        self.v_proj = nn.Linear(config.d_model, d_kv, bias=False)
        self.o_proj = nn.Linear(d_q, config.d_model, bias=False)
        norm_kernels = {"rms_norm": config.kernel_backend("rms_norm")}
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, norm_kernels) \
            if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, norm_kernels) \
            if config.qk_norm else None

    def forward(self, x_TD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                cu_seqlens_S1: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        T = x_TD.shape[0]
        q_THK = self.q_proj(x_TD).view(T, self.n_heads, self.head_dim)
        k_TGK = self.k_proj(x_TD).view(T, self.n_kv_heads, self.head_dim)
        v_TGK = self.v_proj(x_TD).view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_THK, k_TGK = self.q_norm(q_THK), self.k_norm(k_TGK)
        rotary = kernel("rotary", x_TD.device, self.rotary_kernel)
        q_THK, k_TGK = rotary(q_THK, cos_TK, sin_TK), rotary(k_TGK, cos_TK, sin_TK)
        o_THK = self.core(q_THK, k_TGK, v_TGK, cu_seqlens_S1, max_seqlen)
        return self.o_proj(o_THK.reshape(T, self.n_heads * self.head_dim))
