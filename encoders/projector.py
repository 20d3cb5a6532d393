"""Projectors from encoder width into the LLM width.

The vision merger is what makes an image cost ``t*h*w / merge_size**2`` LLM tokens
(``omniscale.geometry.vision_tokens``): it concatenates each merge window's ``merge_size**2``
patches -- adjacent in the Qwen2-VL patch order -- and maps them to one LLM embedding. Audio
needs no merging (its convolutions already subsample by 4), only a width change.

Shape suffixes: P patches, N LLM tokens, D encoder width, L LLM width.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from omniscale.encoders.block import RMSNorm, make_norm


class MLPProjector(nn.Module):
    """norm -> Linear -> GELU -> Linear: encoder features [N, in_dim] to LLM embeddings."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, eps: float = 1e-6):
        super().__init__()
        self.norm = RMSNorm(in_dim, eps)
        self.fc1 = nn.Linear(in_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, out_dim)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x_ND))))


class PatchMerger(nn.Module):
    """``merge_size**2`` consecutive patches -> one LLM token (Qwen2-VL's merger).

    Normalising each patch before concatenation (rather than the concatenation) keeps the
    norm's weight per encoder channel, as in Qwen2-VL. ``norm``: ``"rms"`` (ours) or
    ``"layer"`` (Qwen2-VL's ``ln_q``, a LayerNorm with bias)."""

    def __init__(self, d_model: int, out_dim: int, merge_size: int, eps: float = 1e-6,
                 norm: str = "rms"):
        super().__init__()
        self.group = merge_size ** 2
        self.norm = make_norm(norm, d_model, eps)
        width = d_model * self.group
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, out_dim)

    def forward(self, x_PD: torch.Tensor) -> torch.Tensor:
        if x_PD.shape[0] % self.group:
            raise ValueError(f"{x_PD.shape[0]} patches: not a multiple of the merge window "
                             f"{self.group}")
        x_NG = self.norm(x_PD).reshape(-1, self.group * x_PD.shape[1])
        return self.fc2(F.gelu(self.fc1(x_NG)))
