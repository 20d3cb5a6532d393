"""The audio encoder: log-mel frames -> x4 subsampling convolutions -> transformer -> LLM width.

Input is the decoder's mel tensor: every clip's log-mel frames concatenated in item order, plus
each clip's frame count. Two stride-2 convolutions (kernel 3, padding 1) subsample each clip by 4
(exactly ``loaders.geometry.audio_tokens``), then bidirectional blocks attend within each clip
(``cu_seqlens``) with 1-D rotary positions, and a projector maps to the LLM width.

The convolutions run on all clips at once, zero-padded to the longest: zero padding is what a
convolution's own padding feeds it at a clip's end, and the first convolution's output is
zeroed past each clip's length before the second, so every clip gets exactly what it would get
alone.

Shape suffixes: R mel frames (all clips packed), B mel bins, A audio clips, D encoder width,
N LLM tokens (= encoder tokens), K head dim, S attention windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from omniscale.encoders.block import EncoderBlock, cu_seqlens, rope_1d
from omniscale.encoders.projector import MLPProjector


@dataclass(frozen=True)
class AudioConfig:
    n_mels: int = 80
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @classmethod
    def preset(cls, name: str, **overrides) -> "AudioConfig":
        """``tiny`` (CPU tests), ``small`` and ``base`` (Whisper-base-sized)."""
        shapes = {"tiny": dict(d_model=64, n_layers=2, n_heads=4, ffn_dim=128),
                  "small": dict(d_model=256, n_layers=4, n_heads=4, ffn_dim=768),
                  "base": dict(d_model=512, n_layers=6, n_heads=8, ffn_dim=2048)}
        if name not in shapes:
            raise ValueError(f"unknown audio preset {name!r}: choose one of {', '.join(shapes)}")
        return cls(**{**shapes[name], **overrides})

    def check_geometry(self, geometry) -> None:
        if geometry.n_mels != self.n_mels:
            raise ValueError(f"audio.n_mels = {self.n_mels} but media.n_mels = "
                             f"{geometry.n_mels}: they must match")


def _subsampled(lengths_A: torch.Tensor) -> torch.Tensor:
    """Output length of a stride-2, kernel-3, padding-1 convolution."""
    return (lengths_A - 1) // 2 + 1


class AudioEncoder(nn.Module):
    """Audio clips -> LLM embeddings, ``audio_tokens(frames)`` per clip, in clip order."""

    def __init__(self, config: AudioConfig, out_dim: int):
        super().__init__()
        self.config = config
        c = config
        self.conv1 = nn.Conv1d(c.n_mels, c.d_model, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.blocks = nn.ModuleList(EncoderBlock(c.d_model, c.n_heads, c.ffn_dim, c.norm_eps)
                                    for _ in range(c.n_layers))
        self.projector = MLPProjector(c.d_model, 2 * c.d_model, out_dim, c.norm_eps)

    def forward(self, mel_RB: torch.Tensor, frames_A: torch.Tensor) -> torch.Tensor:
        """Embeddings [N, out_dim] of every clip, concatenated in clip order."""
        lengths = [int(n) for n in frames_A.tolist()]
        self._check(mel_RB, lengths)
        device = mel_RB.device
        x_ABR = pad_sequence(list(mel_RB.to(self.conv1.weight.dtype).split(lengths)),
                             batch_first=True).transpose(1, 2)
        len1_A = _subsampled(torch.tensor(lengths, device=device))
        h_ADR = F.gelu(self.conv1(x_ABR))
        keep1 = torch.arange(h_ADR.shape[2], device=device)[None, :] < len1_A[:, None]
        h_ADR = F.gelu(self.conv2(h_ADR * keep1[:, None, :]))
        len2_A = _subsampled(len1_A)
        keep2 = torch.arange(h_ADR.shape[2], device=device)[None, :] < len2_A[:, None]
        x_ND = h_ADR.transpose(1, 2)[keep2]  # row-major: clip by clip, in time order

        tokens = len2_A.tolist()
        pos_N = torch.cat([torch.arange(n, device=device) for n in tokens])
        cos_NK, sin_NK = rope_1d(pos_N, self.config.d_model // self.config.n_heads,
                                 self.config.rope_theta)
        cu_S1, max_len = cu_seqlens(tokens, device)
        for block in self.blocks:
            x_ND = block(x_ND, cos_NK.to(x_ND.dtype), sin_NK.to(x_ND.dtype), cu_S1, max_len)
        return self.projector(x_ND)

    @staticmethod
    def output_lengths(frames_A: torch.Tensor) -> torch.Tensor:
        """Embeddings per clip: ``loaders.geometry.audio_tokens`` of its frame count."""
        return _subsampled(_subsampled(frames_A))

    def dummy_inputs(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A 4-frame silent clip (one token): what a rank encodes when its batch holds no
        audio, so its collectives match the other ranks'."""
        return (torch.zeros(4, self.config.n_mels, device=device),
                torch.tensor([4], device=device))

    def _check(self, mel_RB: torch.Tensor, lengths: list[int]) -> None:
        if mel_RB.ndim != 2 or mel_RB.shape[1] != self.config.n_mels:
            raise ValueError(f"audio mel {tuple(mel_RB.shape)}: expected [frames, "
                             f"{self.config.n_mels}]")
        if not lengths or min(lengths) < 1:
            raise ValueError(f"audio frame counts {lengths}: need at least one clip, each with "
                             "at least one frame")
        if sum(lengths) != mel_RB.shape[0]:
            raise ValueError(f"audio frame counts sum to {sum(lengths)} but the mel tensor has "
                             f"{mel_RB.shape[0]} frames")
