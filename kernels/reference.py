"""Torch references of every fused op: the CPU path and the oracle the fast kernels are tested
against. Each has the signature its fast versions share.

Shape suffixes: T tokens (packed, all sequences of a micro-batch), D width, H heads (Hkv for
keys/values), K head dim, E experts, V vocabulary, S sequences (cu_seqlens has S+1 entries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniscale.kernels.transfer import to_device
from omniscale.layout import IGNORE_INDEX


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / rms(x) * weight, computed in fp32 and returned in x's dtype."""
    x = x_TD.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight_D.float()).to(x_TD.dtype)


def add_rms_norm(x_TD: torch.Tensor, residual_TD: torch.Tensor, weight_D: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's add then norm, fused."""
    summed = x_TD + residual_TD
    return rms_norm(summed, weight_D, eps), summed


def rotary(x_THK: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) with per-token cos/sin tables."""
    half = x_THK.shape[-1] // 2
    x1, x2 = x_THK[..., :half], x_THK[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x_THK.float() * cos_TK[:, None, :] + rotated.float() * sin_TK[:, None, :]
            ).to(x_THK.dtype)


def rotary_tables(position_ids_T: torch.Tensor, head_dim: int, theta: float = 10000.0,
                  mrope_position_3T: torch.Tensor | None = None,
                  mrope_sections: tuple[int, int, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for 1-D positions, or multimodal RoPE: the rotary frequency
    pairs are split into temporal/height/width sections, each rotated by its own axis of
    ``mrope_position_3T`` (Qwen2-VL); text tokens carry equal positions on all three axes,
    which makes M-RoPE coincide with 1-D RoPE for them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids_T.device,
                                            dtype=torch.float32) / head_dim)
    if mrope_position_3T is None:
        freqs = position_ids_T.float()[:, None] * inv_freq[None, :]
    else:
        if mrope_sections is None or sum(mrope_sections) != head_dim // 2:
            raise ValueError(f"mrope_sections {mrope_sections} must sum to head_dim/2 = "
                             f"{head_dim // 2}")
        # each frequency's axis, made on the host and copied without waiting for the device
        axis = to_device([a for a, n in enumerate(mrope_sections) for _ in range(n)],
                         inv_freq.device)
        pos = mrope_position_3T.float()[axis]  # [K/2, T]: each frequency's own axis
        freqs = pos.T * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def swiglu(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    return F.silu(gate_TF) * up_TF


def varlen_attention(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THK: torch.Tensor,
                     cu_seqlens_S1: torch.Tensor, max_seqlen: int, causal: bool = True
                     ) -> torch.Tensor:
    """Attention within each packed sequence only (``cu_seqlens`` delimits them); grouped-
    query attention when k/v have fewer heads. SDPA per sequence: simple and exact, the
    reference every faster backend is checked against. Consecutive sequences of one length
    are one batched call ([n, H, L, K]: the same per-sequence math, one kernel launch, no
    per-sequence gradient buffers); tokens outside every sequence get zeros."""
    del max_seqlen  # part of the shared signature (flash-attn needs it)
    return by_runs(q_THK, k_THK, v_THK, cu_seqlens_S1, causal, attend_run)


def by_runs(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor,
            cu_seqlens_S1: torch.Tensor, causal: bool, attend) -> torch.Tensor:
    """Varlen attention as `attend(q, k, v, n, length, causal)` on each piece of
    `equal_length_runs` (its tokens, packed), the outputs concatenated in token order."""
    runs = equal_length_runs(cu_seqlens_S1.tolist(), q_THK.shape[0])
    if len(runs) == 1:  # one run covers every token: no split (and no split backward)
        parts = [(q_THK, k_TGK, v_TGK)]
    else:
        sizes = [n * length if n else length for n, length in runs]
        parts = list(zip(*(t.split(sizes) for t in (q_THK, k_TGK, v_TGK))))
    outs = [attend(q, k, v, n, length, causal) for (n, length), (q, k, v) in zip(runs, parts)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attend_run(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor, n: int,
               length: int, causal: bool = True) -> torch.Tensor:
    """One piece of `equal_length_runs`: n sequences of `length` packed back to back (n = 0:
    tokens outside every sequence, which get zeros), as one batched SDPA call."""
    if n == 0:
        return q_THK.new_zeros(q_THK.shape)
    T, H, K = q_THK.shape
    # [n, H, L, K] with native GQA: SDPA then takes its fused CPU kernel; 3-D inputs or
    # repeated k/v heads cost 2-5x more fwd+bwd on CPU (math path / extra copies).
    q, k, v = (t.view(n, length, t.shape[1], K).transpose(1, 2)
               for t in (q_THK, k_TGK, v_TGK))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=H != k.shape[1])
    return o.transpose(1, 2).reshape(n * length, H, K)


def equal_length_runs(bounds: list[int], total: int) -> list[tuple[int, int]]:
    """The tokens [0, total) in order as (n, L) pieces of n·L tokens: maximal runs of n
    consecutive sequences of length L (`bounds`: cu_seqlens; empty sequences dropped), and
    tokens outside every sequence as (0, size) pieces."""
    runs: list[list[int]] = []
    position = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        if start > position:
            runs.append([0, start - position])
        if runs and runs[-1][0] and runs[-1][1] == end - start:
            runs[-1][0] += 1
        else:
            runs.append([1, end - start])
        position = end
    if total > position or not runs:
        runs.append([0, total - position])
    return [(n, length) for n, length in runs]


def linear_cross_entropy(hidden_TD: torch.Tensor, weight_VD: torch.Tensor,
                         labels_T: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                         reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against labels; the reference materialises the
    full [T, V] logits (the fused kernel never does)."""
    logits_TV = hidden_TD.float() @ weight_VD.float().T
    return F.cross_entropy(logits_TV, labels_T, ignore_index=ignore_index, reduction=reduction)


def expert_counts(expert_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed copies per expert, [E] int64. A scatter-add, not ``bincount``: on CUDA bincount
    reads its input's maximum back to the host to size its output (a sync per layer)."""
    flat = expert_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def moe_permute(x_TD: torch.Tensor, expert_TK: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens grouped by expert: (x_sorted [T*k, D], order [T*k] (index into the flattened
    T*k routing choices), counts [E]). A stable sort keeps each expert's tokens in order."""
    flat = expert_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(expert_TK, num_experts)
    topk = expert_TK.shape[1]
    # index_select, not x[idx]: its backward is an index_add (~2x faster on CPU than the
    # accumulating index_put that indexing's backward runs)
    return x_TD.index_select(0, order // topk), order, counts


def moe_unpermute(y_PD: torch.Tensor, order_P: torch.Tensor, weight_TK: torch.Tensor
                  ) -> torch.Tensor:
    """Inverse of moe_permute, combining each token's k expert outputs by routing weight."""
    T, topk = weight_TK.shape
    # Row p of y goes back to routing choice order[p]: gather through the inverse permutation
    # (an index_select; a scatter `flat[order] = y` costs ~2.5x as much on CPU).
    inverse_P = torch.empty_like(order_P).scatter_(
        0, order_P, torch.arange(order_P.numel(), device=order_P.device))
    flat = y_PD.index_select(0, inverse_P)
    # The width is explicit: an empty micro-batch (T = 0) must still work.
    return (flat.view(T, topk, y_PD.shape[-1]) * weight_TK[..., None].to(y_PD.dtype)).sum(1)
