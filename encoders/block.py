"""The bidirectional transformer block both encoders stack, and their rotary tables.

Encoders see many items packed into one sequence (``cu_seqlens`` delimits them) and attend
within each item only, in both directions; positions are rotary (or, in the Whisper layout,
already added to the input), so a packed item sees exactly what it would see alone. Fused ops
come from the ``kernels`` registry (torch references on CPU).

One block, several layouts, so a configured encoder *is* the architecture it loads weights
from (``encoders.hf``) rather than a look-alike:

- ``norm``: ``"rms"`` (RMSNorm, weight only; ours) or ``"layer"`` (LayerNorm with a bias:
  Qwen2-VL's vision tower, Whisper);
- ``mlp``: ``"swiglu"`` (``gate_up``/``down``; ours), or ``"gelu"`` / ``"quick_gelu"``
  (``up`` -> activation -> ``down``: Whisper / Qwen2-VL); ``down`` keeps its name in every
  layout (tensor parallelism splits it row-wise);
- ``bias``: biases on the attention output and feed-forward linears (``qkv`` always has one:
  a fused Whisper q/k/v gets a zero k bias: without rotary it adds the same ``q . b`` to
  every key's logit, which softmax ignores, so its gradient is zero and it stays zero).

Shape suffixes: T tokens (all items packed), D width, H heads, K head dim, F feed-forward width,
S attention windows (cu_seqlens has S+1 entries).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

from omniscale import kernels
from omniscale.kernels.reference import rotary_tables
from omniscale.kernels.transfer import to_device

NORMS = ("rms", "layer")
MLPS = ("swiglu", "gelu", "quick_gelu")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return kernels.get("rms_norm", x_TD.device)(x_TD, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


@torch.no_grad()
def reset_module(module: nn.Module) -> None:
    """The initial value of an encoder module's own parameters (not its children's): the
    layer's own ``reset_parameters`` -- PyTorch's defaults for ``nn.Linear``, ``nn.Conv1d``
    and ``nn.LayerNorm``, ones for RMSNorm. The encoders' ``reset_module`` (the trainer
    initialises a model built on the meta device with it, one tensor at a time)."""
    reset = getattr(module, "reset_parameters", None)
    if reset is not None:
        reset()


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``"rms"``: RMSNorm; ``"layer"``: LayerNorm with weight and bias."""
    if kind == "rms":
        return RMSNorm(dim, eps)
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"encoder norm {kind!r}: choose one of {', '.join(NORMS)}")


def check_layout(norm: str, mlp: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"encoder norm {norm!r}: choose one of {', '.join(NORMS)}")
    if mlp not in MLPS:
        raise ValueError(f"encoder mlp {mlp!r}: choose one of {', '.join(MLPS)}")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU, which Qwen2-VL's vision tower was trained with."""
    return x * torch.sigmoid(1.702 * x)


class EncoderBlock(nn.Module):
    """Pre-norm block: varlen bidirectional self-attention (rotary positions when given), then
    the feed-forward layer (module docstring: the layouts)."""

    def __init__(self, d_model: int, n_heads: int, ffn_dim: int, eps: float = 1e-6,
                 norm: str = "rms", mlp: str = "swiglu", bias: bool = False):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"encoder d_model {d_model}: must be a multiple of n_heads {n_heads}")
        check_layout(norm, mlp)
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.mlp_kind = mlp
        self.attn_norm = make_norm(norm, d_model, eps)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=True)
        self.out = nn.Linear(d_model, d_model, bias=bias)
        self.ffn_norm = make_norm(norm, d_model, eps)
        if mlp == "swiglu":
            self.gate_up = nn.Linear(d_model, 2 * ffn_dim, bias=bias)
        else:
            self.up = nn.Linear(d_model, ffn_dim, bias=bias)
        self.down = nn.Linear(ffn_dim, d_model, bias=bias)

    def forward(self, x_TD: torch.Tensor, cos_TK: torch.Tensor | None,
                sin_TK: torch.Tensor | None, cu_seqlens_S1: torch.Tensor, max_seqlen: int
                ) -> torch.Tensor:
        """``cos_TK``/``sin_TK`` None: no rotary (the input already carries positions)."""
        device = x_TD.device
        T = x_TD.shape[0]
        q_THK, k_THK, v_THK = self.qkv(self.attn_norm(x_TD)).view(
            T, 3, self.n_heads, self.head_dim).unbind(1)
        if cos_TK is not None:
            rotary = kernels.get("rotary", device)
            q_THK, k_THK = rotary(q_THK, cos_TK, sin_TK), rotary(k_THK, cos_TK, sin_TK)
        attn_THK = kernels.get("varlen_attention", device)(
            q_THK, k_THK, v_THK, cu_seqlens_S1, max_seqlen, causal=False)
        x_TD = x_TD + self.out(attn_THK.reshape(T, -1))
        h_TD = self.ffn_norm(x_TD)
        if self.mlp_kind == "swiglu":
            gate_TF, up_TF = self.gate_up(h_TD).chunk(2, dim=-1)
            h_TF = kernels.get("swiglu", device)(gate_TF, up_TF)
        elif self.mlp_kind == "gelu":
            h_TF = F.gelu(self.up(h_TD))
        else:
            h_TF = quick_gelu(self.up(h_TD))
        return x_TD + self.down(h_TF)


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
    cu = [0, *itertools.accumulate(lengths)]
    return to_device(cu, device, torch.int32), max(lengths, default=0)
