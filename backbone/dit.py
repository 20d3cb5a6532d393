"""A video diffusion transformer trained by rectified flow (Goku-style), clips packed by length.

Training: for a clean clip x0 (patchified pixels for the demo; latents in a real run) draw a
time t ~ logit-normal per clip and noise n, form ``x_t = (1 - t) * x0 + t * n`` and regress the
velocity ``v = n - x0`` with an MSE loss. Sampling integrates ``dx/dt = v`` from t = 1 (noise)
down to t = 0.

Conditioning is adaLN-Zero (DiT): a vector per clip -- the timestep's embedding plus the mean
of the caption's token embeddings -- scales, shifts and gates every block. It is simpler than
cross-attention and, for short captions, as good; each block's gates start at zero, so the
network starts as the identity and trains stably.

Clips of different sizes are packed into one token sequence; attention stays within each clip
(``cu_seqlens``) and positions are 3-D rotary (frame, row, column), so a packed clip sees what
it would see alone. The feed-forward is dense SwiGLU, or the backbone's MoE layer
(``backbone.moe.MoE``) when ``DiTConfig.moe`` is set; its router loss joins the DiT's.

Shape suffixes: P video patches (all clips packed), C patch values, D width, V clips,
W caption tokens (all captions packed), K head dim, F feed-forward width, S clips + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from omniscale import kernels
from omniscale.backbone.config import ModelConfig, MoEConfig
from omniscale.backbone.moe import MoE
from omniscale.encoders.block import cu_seqlens, rope_nd


@dataclass(frozen=True)
class DiTConfig:
    in_channels: int = 3
    patch_size: int = 8
    temporal_patch_size: int = 2
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 256
    vocab_size: int = 256  # caption token ids (bytes for the demo, a tokenizer's ids otherwise)
    rope_theta: float = 10000.0
    logit_normal_mean: float = 0.0
    logit_normal_std: float = 1.0
    moe: MoEConfig | None = None  # None: dense SwiGLU feed-forward

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def preset(cls, name: str, **overrides) -> "DiTConfig":
        shapes = {"tiny": dict(d_model=96, n_layers=2, n_heads=4, ffn_dim=192),
                  "small": dict(d_model=384, n_layers=8, n_heads=6, ffn_dim=1024)}
        if name not in shapes:
            raise ValueError(f"unknown DiT preset {name!r}: choose one of {', '.join(shapes)}")
        return cls(**{**shapes[name], **overrides})


def patchify_video(frames_THWC: torch.Tensor, patch_size: int, temporal_patch_size: int
                   ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames [T, H, W, C] -> (patches [t*h*w, C*tp*p*p] in (t, h, w) order, grid (t, h, w))."""
    n, height, width, channels = frames_THWC.shape
    p, tp = patch_size, temporal_patch_size
    if n % tp or height % p or width % p:
        raise ValueError(f"clip {n}x{height}x{width}: does not tile into {tp}x{p}x{p} patches")
    t, h, w = n // tp, height // p, width // p
    x = frames_THWC.reshape(t, tp, h, p, w, p, channels).permute(0, 2, 4, 6, 1, 3, 5)
    return x.reshape(t * h * w, channels * tp * p * p), (t, h, w)


def unpatchify_video(patches_PC: torch.Tensor, grid: tuple[int, int, int], patch_size: int,
                     temporal_patch_size: int, channels: int = 3) -> torch.Tensor:
    """Inverse of :func:`patchify_video`: frames [T, H, W, C]."""
    t, h, w = grid
    p, tp = patch_size, temporal_patch_size
    x = patches_PC.reshape(t, h, w, channels, tp, p, p).permute(0, 4, 1, 5, 2, 6, 3)
    return x.reshape(t * tp, h * p, w * p, channels)


def timestep_embedding(t_V: torch.Tensor, dim: int, max_period: float = 10000.0
                       ) -> torch.Tensor:
    """Sinusoidal features of t in [0, 1] (scaled by 1000, as DiT does)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t_V.device) / half)
    args_VH = 1000.0 * t_V.float()[:, None] * freqs[None]
    return torch.cat((args_VH.cos(), args_VH.sin()), dim=-1)


def _modulate(x_PD: torch.Tensor, shift_PD: torch.Tensor, scale_PD: torch.Tensor
              ) -> torch.Tensor:
    return F.layer_norm(x_PD, x_PD.shape[-1:]) * (1 + scale_PD) + shift_PD


class DenseFFN(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x_PD: torch.Tensor) -> torch.Tensor:
        gate_PF, up_PF = self.gate_up(x_PD).chunk(2, dim=-1)
        return self.down(kernels.get("swiglu", x_PD.device)(gate_PF, up_PF))


class DiTBlock(nn.Module):
    """adaLN-Zero block: modulated attention within each clip, then a modulated FFN."""

    def __init__(self, c: DiTConfig):
        super().__init__()
        self.n_heads, self.head_dim = c.n_heads, c.d_model // c.n_heads
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.out = nn.Linear(c.d_model, c.d_model)
        # MoE reads only the width and the MoE fields of a backbone config.
        self.ffn = DenseFFN(c.d_model, c.ffn_dim) if c.moe is None else \
            MoE(ModelConfig(d_model=c.d_model, moe=c.moe))
        self.modulation = nn.Linear(c.d_model, 6 * c.d_model)
        nn.init.zeros_(self.modulation.weight)  # gates start at zero: the block is the identity
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x_PD, cond_PD, cos_PK, sin_PK, cu_S1, max_len):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(
            F.silu(cond_PD)).chunk(6, dim=-1)
        P = x_PD.shape[0]
        q, k, v = self.qkv(_modulate(x_PD, shift1, scale1)).view(
            P, 3, self.n_heads, self.head_dim).unbind(1)
        rotary = kernels.get("rotary", x_PD.device)
        attn_PHK = kernels.get("varlen_attention", x_PD.device)(
            rotary(q, cos_PK, sin_PK), rotary(k, cos_PK, sin_PK), v, cu_S1, max_len,
            causal=False)
        x_PD = x_PD + gate1 * self.out(attn_PHK.reshape(P, -1))
        y = self.ffn(_modulate(x_PD, shift2, scale2))
        y_PD, aux = y if isinstance(y, tuple) else (y, None)  # MoE also returns router stats
        return x_PD + gate2 * y_PD, aux


class VideoDiT(nn.Module):
    """Velocity predictor ``v(x_t, t, caption)`` over packed clips, and its flow-matching loss."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(f"dit.d_model {config.d_model}: must be a multiple of n_heads")
        self.config = c = config
        self.patch_embed = nn.Linear(c.patch_dim, c.d_model)
        self.text_embed = nn.EmbeddingBag(c.vocab_size, c.d_model, mode="mean")
        self.time_mlp = nn.Sequential(nn.Linear(c.d_model, c.d_model), nn.SiLU(),
                                      nn.Linear(c.d_model, c.d_model))
        self.blocks = nn.ModuleList(DiTBlock(c) for _ in range(c.n_layers))
        self.final_modulation = nn.Linear(c.d_model, 2 * c.d_model)
        self.final = nn.Linear(c.d_model, c.patch_dim)
        for layer in (self.final_modulation, self.final):  # start by predicting zero velocity
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def velocity(self, x_PC: torch.Tensor, t_V: torch.Tensor, grid_thw_V3: torch.Tensor,
                 caption_ids_W: torch.Tensor, caption_offsets_V: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted velocity [P, C] of every clip's noisy patches at its time ``t_V``,
        router loss: the MoE layers' weighted aux + z terms, 0 when dense). Captions are
        packed: clip v's tokens start at ``caption_offsets_V[v]``."""
        grids = [tuple(g) for g in grid_thw_V3.tolist()]
        sizes = [t * h * w for t, h, w in grids]
        if sum(sizes) != x_PC.shape[0]:
            raise ValueError(f"grids hold {sum(sizes)} patches but x has {x_PC.shape[0]}")
        device = x_PC.device
        sizes_V = torch.tensor(sizes, device=device)
        # the sinusoid is built in fp32; under bf16 parameters (FSDP mixed precision) it
        # enters the MLP in the MLP's dtype
        time_VD = timestep_embedding(t_V, self.config.d_model)
        cond_VD = (self.time_mlp(time_VD.to(self.patch_embed.weight.dtype))
                   + self.text_embed(caption_ids_W, caption_offsets_V))
        cond_PD = cond_VD.repeat_interleave(sizes_V, dim=0)
        cos_PK, sin_PK = rope_nd(_positions(grids, device),
                                 self.config.d_model // self.config.n_heads,
                                 self.config.rope_theta)
        cu_S1, max_len = cu_seqlens(sizes, device)
        x_PD = self.patch_embed(x_PC)
        router_loss = x_PD.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x_PD, aux = block(x_PD, cond_PD, cos_PK, sin_PK, cu_S1, max_len)
            if aux is not None:
                m = self.config.moe
                router_loss = (router_loss + m.aux_loss_coef * aux["aux_loss"]
                               + m.z_loss_coef * aux["z_loss"])
        shift, scale = self.final_modulation(F.silu(cond_PD)).chunk(2, dim=-1)
        return self.final(_modulate(x_PD, shift, scale)), router_loss

    def forward(self, x0_PC: torch.Tensor, grid_thw_V3: torch.Tensor,
                caption_ids_W: torch.Tensor, caption_offsets_V: torch.Tensor,
                generator: torch.Generator | None = None) -> dict:
        """Rectified-flow loss: ``loss_sum`` (per-patch velocity MSE summed over patches) and
        ``n_tokens`` (patches) -- summed over micro-batches and ranks before one division, like
        the LM's -- and ``router_loss`` (a per-token mean to add, 0 when dense). Times and
        noise are drawn from ``generator`` (the global RNG when None), on its device."""
        c, device = self.config, x0_PC.device
        n_clips = grid_thw_V3.shape[0]
        # Draw on the generator's device (a CPU generator may drive a GPU model: the same
        # seed gives the same times and noise on any device), then move.
        rng = generator.device if generator is not None else device
        logits_V = torch.randn(n_clips, generator=generator, device=rng).to(device)
        t_V = torch.sigmoid(c.logit_normal_mean + c.logit_normal_std * logits_V)
        noise_PC = torch.randn(x0_PC.shape, generator=generator, device=rng,
                               dtype=x0_PC.dtype).to(device)
        sizes_V = grid_thw_V3.prod(dim=1).to(device)
        t_P1 = t_V.repeat_interleave(sizes_V)[:, None].to(x0_PC.dtype)
        x_t_PC = (1 - t_P1) * x0_PC + t_P1 * noise_PC
        v_PC, router_loss = self.velocity(x_t_PC, t_V, grid_thw_V3, caption_ids_W,
                                          caption_offsets_V)
        per_patch_P = (v_PC.float() - (noise_PC - x0_PC).float()).pow(2).mean(dim=1)
        return {"loss_sum": per_patch_P.sum(),
                "n_tokens": torch.tensor(x0_PC.shape[0], device=device),
                "router_loss": router_loss}

    @torch.no_grad()
    def sample(self, grid_thw_V3: torch.Tensor, caption_ids_W: torch.Tensor,
               caption_offsets_V: torch.Tensor, steps: int = 16,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Clean patches [P, C] by Euler steps of dx/dt = v from pure noise at t = 1."""
        n = int(grid_thw_V3.prod(dim=1).sum())
        device = self.patch_embed.weight.device
        x_PC = torch.randn(n, self.config.patch_dim, generator=generator, device=device)
        times = torch.linspace(1.0, 0.0, steps + 1, device=device)
        for t_hi, t_lo in zip(times[:-1], times[1:]):
            t_V = t_hi.expand(grid_thw_V3.shape[0])
            v_PC, _ = self.velocity(x_PC, t_V, grid_thw_V3, caption_ids_W, caption_offsets_V)
            x_PC = x_PC + (t_lo - t_hi) * v_PC
        return x_PC


def _positions(grids: list[tuple[int, int, int]], device) -> list[torch.Tensor]:
    """(frame, row, column) of every patch, (t, h, w) order within each clip."""
    per_clip = [torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                for t, h, w in grids]
    return [torch.cat([clip[axis].reshape(-1) for clip in per_clip]).to(device)
            for axis in range(3)]
