"""The dense SwiGLU feed-forward (dense layers and the MoE's shared expert).

Shape suffixes: T tokens, D model width, F hidden width.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        swiglu = kernels.get("swiglu", x_TD.device)
        return self.down_proj(swiglu(self.gate_proj(x_TD), self.up_proj(x_TD)))
