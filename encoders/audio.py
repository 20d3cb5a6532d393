"""The audio encoder: log-mel frames -> x4 subsampling -> transformer -> LLM width.

Input is the decoder's mel tensor: every clip's log-mel frames concatenated in item order, plus
each clip's frame count. Every layout emits exactly ``omniscale.geometry.audio_tokens(frames)``
tokens per clip (``ceil(ceil(frames / 2) / 2)``), and its blocks attend within each clip
(``cu_seqlens``), so a packed clip gets what it would get alone.

Layouts (``AudioConfig.layout``):

- ``"omniscale"`` (ours): two stride-2 convolutions (kernel 3, padding 1), blocks with 1-D
  rotary positions (RMSNorm, SwiGLU), an MLP projector to the LLM width.
- ``"whisper"``: Whisper's encoder -- conv1 (stride 1), GELU, conv2 (stride 2), GELU, plus the
  position table (``max_positions`` rows, sinusoidal at init), pre-LN blocks (LayerNorm with
  bias, q/k/v/out projections, fc1 -> GELU -> fc2), final LayerNorm -- then, as Qwen2-Audio
  does, an average pool over frame pairs and a linear projection to the LLM width.
- ``"qwen2_audio"``: the same, with Qwen2-Audio's order: pool, then the final LayerNorm.

Where the Whisper layouts differ from transformers': there every clip is padded to a fixed 30 s
window (``2 * max_source_positions`` mel frames); Whisper attends over all of it, padding
included, and Qwen2-Audio masks the padded keys but its convolutions still read the padding
frames at a clip's end. Here a clip is encoded at its own length (zeros past its end, as a
convolution's own padding), attending within itself, positions counted from its start. On an
input of exactly the fixed window the computations are the same. An odd number of
frames after conv2 keeps its last frame as a token of its own (pooled alone), where
Qwen2-Audio drops it -- that keeps the token count ``audio_tokens(frames)``. The position table
has a row per conv2 frame of the fixed window; one frame more reuses its last row, since the
loader's 30 s clip has 3001 mel frames (1501 after conv2) where Whisper's feature extractor
drops the last; longer clips are an error.

The convolutions run on all clips at once, zero-padded to the longest: zero padding is what a
convolution's own padding feeds it at a clip's end, and the first convolution's output is
zeroed past each clip's length before the second, so every clip gets exactly what it would get
alone.

Shape suffixes: R mel frames (all clips packed), B mel bins, A audio clips, D encoder width,
N encoder frames or LLM tokens (all clips packed), K head dim, S attention windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from omniscale.encoders.block import EncoderBlock, cu_seqlens, reset_module, rope_1d
from omniscale.encoders.projector import MLPProjector
from omniscale.kernels.transfer import to_device

LAYOUTS = ("omniscale", "whisper", "qwen2_audio")


@dataclass(frozen=True)
class AudioConfig:
    n_mels: int = 80
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 128
    rope_theta: float = 10000.0  # the omniscale layout's rotary positions
    norm_eps: float = 1e-6  # Whisper's LayerNorms use 1e-5 (audio_from_hf sets it)
    layout: str = "omniscale"  # "omniscale" | "whisper" | "qwen2_audio" (module docstring)
    max_positions: int = 1500  # Whisper layouts: rows of the position table (conv2 frames)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"audio layout {self.layout!r}: choose one of {', '.join(LAYOUTS)}")

    @property
    def whisper(self) -> bool:
        """Whisper's encoder architecture (either Whisper layout)."""
        return self.layout != "omniscale"

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


def _conv_out(length: int, stride: int) -> int:
    """Output length of a kernel-3, padding-1 convolution."""
    return (length - 1) // stride + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's position table [length, channels]: sines then cosines of geometrically spaced
    timescales (what its checkpoints hold, frozen, and what a fresh table starts from)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2, dtype=torch.float32))
    scaled = torch.arange(length, dtype=torch.float32)[:, None] * inv_timescales[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


def pool_pairs(x_ND: torch.Tensor, rows_A: list[int]) -> torch.Tensor:
    """Each clip's consecutive frame pairs averaged (Qwen2-Audio's ``AvgPool1d(2, 2)``); an
    odd clip's last frame is a token of its own. Clips stay packed in order."""
    device = x_ND.device
    rows = torch.tensor(rows_A, device=device)
    pooled = (rows + 1) // 2
    first_A = torch.cumsum(rows, 0) - rows
    first_pooled_A = torch.cumsum(pooled, 0) - pooled
    local_N = torch.arange(x_ND.shape[0], device=device) - torch.repeat_interleave(first_A, rows)
    group_N = torch.repeat_interleave(first_pooled_A, rows) + local_N // 2
    total = int(pooled.sum())
    sum_ND = x_ND.new_zeros(total, x_ND.shape[1]).index_add(0, group_N, x_ND)
    count_N = torch.bincount(group_N, minlength=total).to(x_ND.dtype)
    return sum_ND / count_N[:, None]


class AudioEncoder(nn.Module):
    """Audio clips -> LLM embeddings, ``audio_tokens(frames)`` per clip, in clip order."""

    def __init__(self, config: AudioConfig, out_dim: int):
        super().__init__()
        self.config = config
        c = config
        # x4 either way: ours subsamples in both convolutions, Whisper in conv2 then the pool.
        self.conv1 = nn.Conv1d(c.n_mels, c.d_model, kernel_size=3, stride=1 if c.whisper else 2,
                               padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        block = (dict(norm="layer", mlp="gelu", bias=True) if c.whisper else
                 dict(norm="rms", mlp="swiglu", bias=False))
        self.blocks = nn.ModuleList(EncoderBlock(c.d_model, c.n_heads, c.ffn_dim, c.norm_eps,
                                                 **block) for _ in range(c.n_layers))
        if c.whisper:
            # A buffer: Whisper and Qwen2-Audio keep the table frozen (requires_grad False).
            self.register_buffer("pos_embed", sinusoids(c.max_positions, c.d_model))
            self.norm = nn.LayerNorm(c.d_model, eps=c.norm_eps)
            self.projector = nn.Linear(c.d_model, out_dim)
        else:
            self.projector = MLPProjector(c.d_model, 2 * c.d_model, out_dim, c.norm_eps)

    def forward(self, mel_RB: torch.Tensor, frames_A: torch.Tensor) -> torch.Tensor:
        """Embeddings [N, out_dim] of every clip, concatenated in clip order."""
        x_ND, rows = self.features(mel_RB, frames_A)
        if self.config.whisper:
            x_ND = pool_pairs(x_ND, rows)
            if self.config.layout == "qwen2_audio":
                x_ND = self.norm(x_ND)
        return self.projector(x_ND)

    def features(self, mel_RB: torch.Tensor, frames_A: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int]]:
        """(the blocks' output [N, D] at the conv2 frame rate, every clip's frames packed in
        order; frames per clip). The Whisper layout includes the final LayerNorm: this is
        Whisper's ``last_hidden_state``; the others are before pooling and projection."""
        lengths = [int(n) for n in frames_A.tolist()]
        self._check(mel_RB, lengths)
        device = mel_RB.device
        x_ABR = pad_sequence(list(mel_RB.to(self.conv1.weight.dtype).split(lengths)),
                             batch_first=True).transpose(1, 2)
        # Every length is known on the host: the device computes none it must read back.
        len1 = [_conv_out(n, self.conv1.stride[0]) for n in lengths]
        rows = [_conv_out(n, 2) for n in len1]
        len1_A = to_device(len1, device)
        h_ADR = F.gelu(self.conv1(x_ABR))
        keep1 = torch.arange(h_ADR.shape[2], device=device)[None, :] < len1_A[:, None]
        h_ADR = F.gelu(self.conv2(h_ADR * keep1[:, None, :]))
        # each clip's frames, clip by clip in time order (a gather: a boolean mask would
        # count its rows on the device)
        width = h_ADR.shape[2]
        keep_N = to_device([a * width + t for a, n in enumerate(rows) for t in range(n)],
                           device, torch.int64)
        x_ND = h_ADR.transpose(1, 2).reshape(-1, h_ADR.shape[1]).index_select(0, keep_N)

        pos_N = torch.cat([torch.arange(n, device=device) for n in rows])
        cu_S1, max_len = cu_seqlens(rows, device)
        if self.config.whisper:
            limit = self.pos_embed.shape[0]
            if max_len > limit + 1:
                raise ValueError(f"audio clip of {max(lengths)} mel frames: the "
                                 f"{self.config.layout} layout's position table covers "
                                 f"{2 * (limit + 1)} (max_positions {limit})")
            x_ND = x_ND + self.pos_embed[pos_N.clamp(max=limit - 1)].to(x_ND.dtype)
            cos_NK = sin_NK = None
        else:
            cos_NK, sin_NK = rope_1d(pos_N, self.config.d_model // self.config.n_heads,
                                     self.config.rope_theta)
            cos_NK, sin_NK = cos_NK.to(x_ND.dtype), sin_NK.to(x_ND.dtype)
        for block in self.blocks:
            x_ND = block(x_ND, cos_NK, sin_NK, cu_S1, max_len)
        if self.config.layout == "whisper":
            x_ND = self.norm(x_ND)
        return x_ND, rows

    @torch.no_grad()
    def reset_module(self, module: nn.Module) -> None:
        """The initial value of ``module``'s own parameters and buffers, for a module of this
        encoder (``MoEDecoder.reset_module``: the trainer's use): the Whisper position table
        is sinusoidal, the layers take PyTorch's defaults (``block.reset_module``)."""
        if module is self and self.config.whisper:
            self.pos_embed.copy_(sinusoids(self.config.max_positions, self.config.d_model))
        else:
            reset_module(module)

    @staticmethod
    def output_lengths(frames_A: torch.Tensor) -> torch.Tensor:
        """Embeddings per clip: ``omniscale.geometry.audio_tokens`` of its frame count (every
        layout: two halvings, each keeping an odd last frame)."""
        return _conv_out(_conv_out(frames_A, 2), 2)

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
