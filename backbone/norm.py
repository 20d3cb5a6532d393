"""RMSNorm through the kernel registry (the fused kernel on GPU, the torch reference on CPU)."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return kernels.get("rms_norm", x_TD.device)(x_TD, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
