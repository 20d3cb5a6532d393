"""Varlen attention with torch's flex attention: one call over the whole packed micro-batch,
a block mask that keeps each token inside its own sequence (and causal), so fully masked
blocks between sequences are skipped rather than computed.

Same signature as `kernels.reference.varlen_attention`. On CUDA the kernel is compiled (flex
attention in eager mode falls back to a dense math path); the block mask is built once per
call from `cu_seqlens`. In torch 2.11 flex attention has no CPU backward, so on CPU this
backend is forward-only (inference, tests) and only chosen with `prefer="flex"`.

Shape suffixes: T tokens, H query heads, G key/value heads, K head dim, S sequences.
"""

from __future__ import annotations

import functools
import warnings

import torch


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def sequence_ids(cu_seqlens_S1: torch.Tensor, total: int) -> torch.Tensor:
    """[T] index of the sequence each packed token belongs to."""
    positions_T = torch.arange(total, device=cu_seqlens_S1.device, dtype=cu_seqlens_S1.dtype)
    return torch.searchsorted(cu_seqlens_S1[1:].contiguous(), positions_T, right=True)


def varlen_attention(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor,
                     cu_seqlens_S1: torch.Tensor, max_seqlen: int, causal: bool = True
                     ) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    del max_seqlen  # the block mask carries the boundaries
    device = q_THK.device
    if device.type == "cpu" and torch.is_grad_enabled() and any(
            t.requires_grad for t in (q_THK, k_TGK, v_TGK)):
        raise NotImplementedError(
            "flex attention has no CPU backward in this torch; train on CPU with the "
            "reference backend (attention_backend=None or 'reference')")
    T = q_THK.shape[0]
    cu_S1 = cu_seqlens_S1.to(device)
    seq_T = sequence_ids(cu_S1, T)
    # tokens before the first sequence or after the last belong to none: they attend to
    # nothing and get zeros (the reference's contract)
    t_T = torch.arange(T, device=device)
    inside_T = (t_T >= cu_S1[0]) & (t_T < cu_S1[-1])

    def mask_mod(b, h, q_idx, kv_idx):
        same = (seq_T[q_idx] == seq_T[kv_idx]) & inside_T[q_idx] & inside_T[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    on_cuda = device.type == "cuda"
    block_mask = create_block_mask(mask_mod, None, None, T, T, device=device, _compile=on_cuda)
    attend = _compiled_flex() if on_cuda else flex_attention
    q, k, v = (t.transpose(0, 1)[None] for t in (q_THK, k_TGK, v_TGK))  # [1, heads, T, K]
    with warnings.catch_warnings():
        # eager on CPU is deliberate (forward-only test path); compiling buys nothing there
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = attend(q, k, v, block_mask=block_mask,
                     enable_gqa=q_THK.shape[1] != k_TGK.shape[1])
    return out[0].transpose(0, 1).masked_fill(~inside_T[:, None, None], 0.0)
