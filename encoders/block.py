"""The bidirectional transformer block both encoders stack, and their rotary tables.

Encoders see many items packed into one sequence (``cu_seqlens`` delimits them) and attend
within each item only, in both directions; positions are rotary, so a packed item sees exactly
what it would see alone. Fused ops come from the ``kernels`` registry (torch references on CPU).

Shape suffixes: T tokens (all items packed), D width, H heads, K head dim, F feed-forward width,
S attention windows (cu_seqlens has S+1 entries).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from omniscale import kernels
from omniscale.kernels.reference import rotary_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return kernels.get("rms_norm", x_TD.device)(x_TD, self.weight, self.eps)


class EncoderBlock(nn.Module):
    """Pre-norm block: varlen bidirectional self-attention with rotary positions, then SwiGLU."""

    def __init__(self, d_model: int, n_heads: int, ffn_dim: int, eps: float = 1e-6):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"encoder d_model {d_model}: must be a multiple of n_heads {n_heads}")
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.attn_norm = RMSNorm(d_model, eps)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=True)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.ffn_norm = RMSNorm(d_model, eps)
        self.gate_up = nn.Linear(d_model, 2 * ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x_TD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                cu_seqlens_S1: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        device = x_TD.device
        rotary = kernels.get("rotary", device)
        T = x_TD.shape[0]
        q_THK, k_THK, v_THK = self.qkv(self.attn_norm(x_TD)).view(
            T, 3, self.n_heads, self.head_dim).unbind(1)
        q_THK, k_THK = rotary(q_THK, cos_TK, sin_TK), rotary(k_THK, cos_TK, sin_TK)
        attn_THK = kernels.get("varlen_attention", device)(
            q_THK, k_THK, v_THK, cu_seqlens_S1, max_seqlen, causal=False)
        x_TD = x_TD + self.out(attn_THK.reshape(T, -1))
        gate_TF, up_TF = self.gate_up(self.ffn_norm(x_TD)).chunk(2, dim=-1)
        return x_TD + self.down(kernels.get("swiglu", device)(gate_TF, up_TF))


def rope_nd(positions: list[torch.Tensor], head_dim: int, theta: float = 10000.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for positions on several axes (patch row and column; frame, row
    and column): the rotary frequency pairs are split into one band per axis, and each band
    spans the full frequency range (Qwen2-VL's vision RoPE) -- unlike an M-RoPE split, where
    one axis would keep only the slow frequencies and could not tell neighbours apart."""
    pairs = head_dim // 2
    if head_dim % 2 or pairs < len(positions):
        raise ValueError(f"head_dim {head_dim}: needs an even size with a frequency pair per "
                         f"axis ({len(positions)} axes)")
    bands = [pairs // len(positions)] * len(positions)
    bands[0] += pairs - sum(bands)
    freqs = []
    for pos_T, n in zip(positions, bands):
        inv_freq = 1.0 / theta ** (torch.arange(n, device=pos_T.device, dtype=torch.float32) / n)
        freqs.append(pos_T.float()[:, None] * inv_freq)
    freqs_TP = torch.cat(freqs, dim=-1)
    emb_TK = torch.cat((freqs_TP, freqs_TP), dim=-1)
    return emb_TK.cos(), emb_TK.sin()


def rope_1d(pos_T: torch.Tensor, head_dim: int, theta: float = 10000.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for 1-D positions (tables are cheap: no fused version)."""
    return rotary_tables(pos_T, head_dim, theta)


def cu_seqlens(lengths: list[int], device: torch.device | str) -> tuple[torch.Tensor, int]:
    """(cu_seqlens [S+1] int32, max length) of windows of the given lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return cu.to(device), max(lengths, default=0)
