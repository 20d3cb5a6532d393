"""RMSNorm through the kernel registry (the fused kernel on GPU, the torch reference on CPU,
or the backend `kernel` names: ModelConfig.kernels)."""

from __future__ import annotations

import torch
from torch import nn

from omniscale.backbone.config import kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, kernels: dict[str, str | None] | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # prefer= per op ("rms_norm", "add_rms_norm"); None: the registry's choice
        self.prefer = dict(kernels or {})

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        rms_norm = kernel("rms_norm", x_TD.device, self.prefer.get("rms_norm"))
        return rms_norm(x_TD, self.weight, self.eps)

    def add_forward(self, x_TD: torch.Tensor, residual_TD: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one fused op (add_rms_norm)."""
        add_rms_norm = kernel("add_rms_norm", x_TD.device, self.prefer.get("add_rms_norm"))
        return add_rms_norm(x_TD, residual_TD, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
