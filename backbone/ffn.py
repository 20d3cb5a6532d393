"""The dense SwiGLU feed-forward (dense layers and the MoE's shared expert).

Shape suffixes: T tokens, D model width, F hidden width.
"""

from __future__ import annotations

import torch
from torch import nn

from omniscale.backbone.config import kernel


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, swiglu_kernel: str | None = None):
        super().__init__()
        self.swiglu_kernel = swiglu_kernel  # prefer= for swiglu (None: the registry's choice)
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        swiglu = kernel("swiglu", x_TD.device, self.swiglu_kernel)
        return self.down_proj(swiglu(self.gate_proj(x_TD), self.up_proj(x_TD)))
