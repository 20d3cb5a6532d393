"""Varlen attention with torch's flex attention: one call over the whole packed micro-batch,
a block mask that keeps each token inside its own sequence (and causal), so fully masked
blocks between sequences are skipped rather than computed. On CUDA it serves what the flash
kernels (kernels/varlen.py) do not take (fp32, odd head dims) and `prefer="flex"`.

Same signature as `kernels.reference.varlen_attention`. On CUDA the kernel is compiled (flex
attention in eager mode falls back to a dense math path). In torch 2.11 flex attention has no
CPU backward, so on CPU this backend is forward-only (inference, tests) and only chosen with
`prefer="flex"`.

Two costs are paid once per micro-batch, not once per layer or per length:
- The block mask depends only on `cu_seqlens` (and the padded length, causality, device): it
  is built once and memoised on the `cu_seqlens` tensor itself, which the decoder hands to
  every layer of the micro-batch. The memo is checked against the tensor's version counter,
  so an in-place change rebuilds it; it dies with the tensor (no process-wide cache, no
  stale entry for a reused id).
- Compilation is static (`dynamic=False`: specialised kernels, autotuned per shape), so the
  packed length is padded up to a bucket (`bucket`): quarter-octave steps in multiples of
  128 (flex's block), at most 25% padding and at most 4 shapes per doubling of the length,
  where the exact lengths would compile once per micro-batch until dynamo's recompile limit
  and then run flex eagerly (dense [T, T] scores). Padded tokens belong to no sequence: their
  blocks are fully masked, so the kernel skips them, and they are cut off again.
  `dynamic=True` was the alternative; static shapes plus buckets is what can be checked here
  (a compile count on CPU) and keeps the kernels specialised.

Shape suffixes: T tokens, P padded tokens (the bucket), H query heads, G key/value heads,
K head dim, S sequences.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

BLOCK = 128  # flex attention's default block: lengths are padded to whole blocks anyway
# Shapes compiled before dynamo gives up and runs flex eagerly (its default: 8), for calls
# outside a compiled region; ~4 buckets per doubling of the length, times grad / no grad.
RECOMPILE_LIMIT = 64
MEMO = "_omniscale_flex_masks"  # attribute of the cu_seqlens tensor holding its block masks


def bucket(total: int) -> int:
    """The padded length compile sees for `total` tokens: a multiple of 128 (at least 128),
    in steps of a quarter of the largest power of two <= total (≤ 25% padding)."""
    step = max(BLOCK, 1 << max(int(total).bit_length() - 3, 0))
    return max(BLOCK, -(-int(total) // step) * step)


@functools.cache
def compiled_flex(backend="inductor"):
    """flex_attention compiled for static shapes (one per bucket); `backend` for tests."""
    return compile_as_one_op(flex_attention, backend)


def compile_as_one_op(fn, backend="inductor"):
    """`fn` compiled for static shapes, its compiled region one op to dispatch modes
    (`higher_order::inductor_compiled_code`): selective activation checkpointing can keep its
    output (parallel/checkpointing.py) instead of running the kernels again in backward."""
    options = {"wrap_inductor_compiled_regions": True} if backend == "inductor" else None
    return torch.compile(fn, dynamic=False, backend=backend, options=options)


def sequence_ids(cu_seqlens_S1: torch.Tensor, total: int) -> torch.Tensor:
    """[T] index of the sequence each packed token belongs to."""
    positions_T = torch.arange(total, device=cu_seqlens_S1.device, dtype=cu_seqlens_S1.dtype)
    return torch.searchsorted(cu_seqlens_S1[1:].contiguous(), positions_T, right=True)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: not memoised
        return None


def _mask_mod(seq_P: torch.Tensor, inside_P: torch.Tensor, causal: bool):
    # Only the derived tensors are captured (not cu_seqlens: no reference cycle via the memo).
    def mask_mod(b, h, q_idx, kv_idx):
        same = (seq_P[q_idx] == seq_P[kv_idx]) & inside_P[q_idx] & inside_P[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same
    return mask_mod


@torch.compiler.disable  # host-side memo; inside a compiled block it runs eagerly
def block_mask_for(cu_seqlens_S1: torch.Tensor, padded: int, causal: bool,
                   device: torch.device) -> tuple:
    """(block mask, inside_P) for a micro-batch padded to `padded` tokens, built once per
    `cu_seqlens` tensor and (padded, causal, device). inside_P: tokens of some sequence;
    tokens before the first sequence, after the last, or padding belong to none: they
    attend to nothing and get zeros (the reference's contract)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (padded, causal, str(device))
    version = _version(cu_seqlens_S1)
    memo = getattr(cu_seqlens_S1, MEMO, None)
    if version is not None and memo is not None and memo[0] == version and key in memo[1]:
        return memo[1][key]
    cu_S1 = cu_seqlens_S1.to(device)
    seq_P = sequence_ids(cu_S1, padded)
    t_P = torch.arange(padded, device=device)
    inside_P = (t_P >= cu_S1[0]) & (t_P < cu_S1[-1])
    block_mask = create_block_mask(_mask_mod(seq_P, inside_P, causal), None, None, padded,
                                   padded, device=device, _compile=device.type == "cuda")
    if version is not None:
        if memo is None or memo[0] != version:
            memo = (version, {})
            setattr(cu_seqlens_S1, MEMO, memo)
        memo[1][key] = (block_mask, inside_P)
    return block_mask, inside_P


def packed_flex(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor,
                cu_seqlens_S1: torch.Tensor, causal: bool, attend) -> torch.Tensor:
    """Flex attention (`attend`: flex_attention, compiled or not) over the micro-batch padded
    to its bucket, with the micro-batch's memoised block mask."""
    T = q_THK.shape[0]
    # Inside a compiled block (parallel/parallelize.py compiles them with dynamic shapes) the
    # length is symbolic: bucketing would only specialise the block's graph on it.
    padded = T if torch.compiler.is_compiling() else bucket(T)
    block_mask, inside_P = block_mask_for(cu_seqlens_S1, padded, causal, q_THK.device)
    # [1, heads, P, K]; the padding rows are zeros (any finite value would do: fully masked)
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, padded - T)).transpose(0, 1)[None]
               for t in (q_THK, k_TGK, v_TGK))
    gqa = q_THK.shape[1] != k_TGK.shape[1]
    with warnings.catch_warnings():
        # eager on CPU is deliberate (forward-only test path); compiling buys nothing there
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        if torch.compiler.is_compiling():  # inside a compiled block: its graph holds the call
            out = attend(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        else:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = attend(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)[:T].masked_fill(~inside_P[:T, None, None], 0.0)


def varlen_attention(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor,
                     cu_seqlens_S1: torch.Tensor, max_seqlen: int, causal: bool = True
                     ) -> torch.Tensor:
    del max_seqlen  # the block mask carries the boundaries
    device = q_THK.device
    if device.type == "cpu" and torch.is_grad_enabled() and any(
            t.requires_grad for t in (q_THK, k_TGK, v_TGK)):
        raise NotImplementedError(
            "flex attention has no CPU backward in this torch; train on CPU with the "
            "reference backend (attention_backend=None or 'reference')")
    attend = compiled_flex() if device.type == "cuda" else flex_attention
    return packed_flex(q_THK, k_TGK, v_TGK, cu_seqlens_S1, causal, attend)
