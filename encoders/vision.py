"""The vision encoder: one ViT for images and videos (Qwen2-VL style), packed by ``cu_seqlens``.

Input is a float patch tensor (``encoders.vision_input.vision_patches`` makes it on the device from
the loader's uint8 pixel rows): every image and clip of a batch concatenated in item order,
one row per patch of ``3 * temporal_patch_size * patch_size**2`` normalised pixels (an image
is its frame repeated ``temporal_patch_size`` times), patches of an item ordered
``(t, h/m, w/m, m, m)`` with ``m = merge_size`` -- so each merge window's ``m*m`` patches are
adjacent. A linear patch
embedding (the same map as Qwen2-VL's stride = kernel Conv3d), 2D rotary positions (patch row,
patch column), bidirectional blocks, and the merger to the LLM width.

Attention windows: each image attends within itself; a clip attends within each temporal patch
group (its ``h*w`` patches of one ``temporal_patch_size``-frame slice). Motion across slices is
left to the LLM, which sees the clip's tokens with temporal M-RoPE positions; in exchange the
encoder's cost is linear in clip length and its 2D positions are exact, and a clip's slices
are independent, which lets the encoder plan split long clips.

Layouts: the defaults are ours (RMSNorm, SwiGLU, no biases past ``qkv``). With the fields of
``QWEN2_VL`` (``norm="layer", mlp="quick_gelu", bias=True, norm_eps=1e-6``) the encoder is
Qwen2-VL's vision tower tensor for tensor -- the patch vector's (channel, frame, row, col)
order is its Conv3d kernel's flattened, the rotary bands are its (row, column) halves, the
attention windows are its ``cu_seqlens`` -- and ``encoders.hf.vision_from_hf`` loads its
checkpoints.

Shape suffixes: P patches (all items packed), C patch pixels, D encoder width, N LLM tokens,
L LLM width, V vision items, K head dim, S attention windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from omniscale.encoders.block import (
    EncoderBlock,
    check_layout,
    cu_seqlens,
    reset_module,
    rope_nd,
)
from omniscale.encoders.projector import PatchMerger

Grid = tuple[int, int, int]

# The fields that make a VisionConfig Qwen2-VL's vision tower (``VisionConfig(**QWEN2_VL, ...)``).
QWEN2_VL = dict(norm="layer", mlp="quick_gelu", bias=True, norm_eps=1e-6)


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    norm: str = "rms"  # block and merger norms: "rms" | "layer" (LayerNorm with bias)
    mlp: str = "swiglu"  # "swiglu" | "gelu" | "quick_gelu" (fc1 -> activation -> fc2)
    bias: bool = False  # biases on the attention output and feed-forward linears

    def __post_init__(self):
        check_layout(self.norm, self.mlp)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def preset(cls, name: str, **overrides) -> "VisionConfig":
        """``tiny`` (a CPU test step in milliseconds), ``small`` (a real but small ViT) and
        ``base`` (ViT-B-sized, for GPU planning); geometry fields stay Qwen2-VL's unless
        overridden, and must match the decoders' ``MediaGeometry``."""
        shapes = {"tiny": dict(d_model=64, n_layers=2, n_heads=4, ffn_dim=128),
                  "small": dict(d_model=256, n_layers=6, n_heads=4, ffn_dim=768),
                  "base": dict(d_model=768, n_layers=12, n_heads=12, ffn_dim=2048)}
        if name not in shapes:
            raise ValueError(f"unknown vision preset {name!r}: choose one of {', '.join(shapes)}")
        return cls(**{**shapes[name], **overrides})

    def check_geometry(self, geometry) -> None:
        """Raise when the decoders' patch geometry differs from the encoder's."""
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            if getattr(geometry, name) != getattr(self, name):
                raise ValueError(f"vision.{name} = {getattr(self, name)} but media.{name} = "
                                 f"{getattr(geometry, name)}: they must match")


class VisionEncoder(nn.Module):
    """Images and clips -> LLM embeddings, ``t*h*w / merge_size**2`` per item, in item order."""

    def __init__(self, config: VisionConfig, out_dim: int):
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = nn.Linear(c.patch_dim, c.d_model, bias=False)
        self.blocks = nn.ModuleList(
            EncoderBlock(c.d_model, c.n_heads, c.ffn_dim, c.norm_eps, c.norm, c.mlp, c.bias)
            for _ in range(c.n_layers))
        self.merger = PatchMerger(c.d_model, out_dim, c.merge_size, c.norm_eps, c.norm)

    def forward(self, pixel_patches_PC: torch.Tensor, grid_thw_V3: torch.Tensor
                ) -> torch.Tensor:
        """Embeddings [N, out_dim] of every item, concatenated in item order (item v owns
        ``vision_tokens(grid_thw_V3[v])`` consecutive rows)."""
        grids = [tuple(g) for g in grid_thw_V3.tolist()]
        self._check(pixel_patches_PC, grids)
        device = pixel_patches_PC.device
        pos_h_P, pos_w_P, windows = self._layout(grids, device)
        head_dim = self.config.d_model // self.config.n_heads
        cos_PK, sin_PK = rope_nd([pos_h_P, pos_w_P], head_dim, self.config.rope_theta)
        cu_S1, max_len = cu_seqlens(windows, device)
        x_PD = self.patch_embed(pixel_patches_PC.to(self.patch_embed.weight.dtype))
        for block in self.blocks:
            x_PD = block(x_PD, cos_PK.to(x_PD.dtype), sin_PK.to(x_PD.dtype), cu_S1, max_len)
        return self.merger(x_PD)

    def reset_module(self, module: nn.Module) -> None:
        """The initial value of ``module``'s own parameters (``block.reset_module``), for a
        module of this encoder (``MoEDecoder.reset_module``: the trainer's use)."""
        reset_module(module)

    def output_lengths(self, grid_thw_V3: torch.Tensor) -> torch.Tensor:
        """Embeddings per item: ``omniscale.geometry.vision_tokens`` of its grid."""
        return grid_thw_V3.prod(dim=1) // self.config.merge_size ** 2

    def dummy_inputs(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest valid input (one image of one merge window): what a rank encodes when
        its batch holds no image or video, so its collectives match the other ranks'."""
        m = self.config.merge_size
        return (torch.zeros(m * m, self.config.patch_dim, device=device),
                torch.tensor([[1, m, m]], device=device))

    def _check(self, pixel_patches_PC: torch.Tensor, grids: list[Grid]) -> None:
        c = self.config
        if pixel_patches_PC.ndim != 2 or pixel_patches_PC.shape[1] != c.patch_dim:
            raise ValueError(f"pixel patches {tuple(pixel_patches_PC.shape)}: expected "
                             f"[patches, {c.patch_dim}] (3 x {c.temporal_patch_size} x "
                             f"{c.patch_size} x {c.patch_size})")
        for t, h, w in grids:
            if t < 1 or h % c.merge_size or w % c.merge_size or h < 1 or w < 1:
                raise ValueError(f"vision grid {(t, h, w)}: h and w must be positive multiples "
                                 f"of merge_size {c.merge_size}")
        total = sum(t * h * w for t, h, w in grids)
        if total != pixel_patches_PC.shape[0]:
            raise ValueError(f"vision grids hold {total} patches but pixel_patches has "
                             f"{pixel_patches_PC.shape[0]} rows")

    def _layout(self, grids: list[Grid], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Per patch (row, column) in merge-window order, and the attention window lengths."""
        m = self.config.merge_size
        rows, cols, windows = [], [], []
        for t, h, w in grids:
            shape = (h // m, m, w // m, m)
            # (h/m, m, w/m, m) -> (h/m, w/m, m, m): the merge-window patch order.
            r = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(shape)
            q = torch.arange(w, device=device).view(1, 1, w // m, m).expand(shape)
            r, q = r.permute(0, 2, 1, 3), q.permute(0, 2, 1, 3)
            rows.append(r.reshape(-1).repeat(t))
            cols.append(q.reshape(-1).repeat(t))
            windows += [h * w] * t
        return torch.cat(rows), torch.cat(cols), windows
