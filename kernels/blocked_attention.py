"""Exact causal attention as batched matrix products over blocks of query rows, with a
closed-form backward: the CPU default for causal `varlen_attention` on sequences of up to
`MAX_LEN` tokens.

Why: on CPU, SDPA's fused (flash) kernel spends most of a short sequence's time outside its
matrix products, and its backward recomputes the probabilities. Here each block of `rows`
query rows (per head) is two bmm calls forward and four backward against only the keys it
can see (those up to the block's last row, so about half the product is skipped), and the
probabilities are kept for the backward. At the `tiny` and `small` decoders' shapes (4 × 512
tokens, head dim 32, 2 threads) fwd+bwd ran 1.3-1.5× and 1.5-1.9× faster than SDPA over
several runs (tools/bench/attention.py; docs/bench/attention_cpu.json).

The price is memory: the kept probabilities grow with L², so longer sequences, and calls whose
kept probabilities would exceed `MAX_SAVED` elements, go to SDPA (kernels/reference.py).
Bidirectional attention (the encoders) skips nothing and goes to SDPA too, which is faster
there (ViT shapes: blocks took ~1.4× SDPA's time).

Grouped-query attention without repeating k/v: the r query heads of one k/v head are stacked
as rows of one matrix, so every product runs against that k/v head once.

Shape suffixes: N sequences of one length L, H query heads, G key/value heads (r = H/G), K head
dim, B = N·G products in a batch, X = L·r query rows of a k/v head (position, head), R rows of
a block (n positions × r heads), C keys a block sees, Y columns of the mask buffer.
"""

from __future__ import annotations

import math

import torch

from omniscale.kernels import reference

MAX_LEN = 1024  # longer sequences: SDPA (blocks then no longer beat it, measured at 2048)
MAX_SAVED = 32 * 2**20  # kept probabilities per call, elements (128 MiB in fp32)


def block_rows(length: int) -> int:
    """Query rows per head in a block: small enough that a block's scores stay near the cache,
    large enough that the per-block calls do not dominate (measured best at L = 128..1024)."""
    return 48 if length <= 512 else 64


class _BlockedAttention(torch.autograd.Function):
    """o = softmax(q'·kᵀ + causal mask)·v, q' = q/√K, for N sequences of one length, inputs in
    the packed layout [N, L, heads, K]. Backward, per block, with P its probabilities and
    Δ = rowsum(dO ∘ O): dV += Pᵀ·dO, dS = P ∘ (dO·Vᵀ − Δ), dQ = dS·K/√K, dK += dSᵀ·q'.

    Queries are laid out [N·G, L·r, K] (a k/v head's r query heads interleaved per position),
    so a block of positions is a contiguous run of rows: no copy per block. No op's output is
    modified in place in the forward: selective activation checkpointing
    (parallel/checkpointing.py) keeps bmm outputs and refuses ones changed after the fact."""

    @staticmethod
    def forward(ctx, q_NLHK, k_NLGK, v_NLGK, rows: int):
        N, L, H, K = q_NLHK.shape
        G = k_NLGK.shape[2]
        r = H // G
        scale = 1.0 / math.sqrt(K)
        q_BXK = _grouped(q_NLHK, G) * scale  # X = L·r rows
        k_BLK = k_NLGK.permute(0, 2, 1, 3).reshape(N * G, L, K)
        v_BLK = v_NLGK.permute(0, 2, 1, 3).reshape(N * G, L, K)
        # Additive causal mask of every block, as views of one buffer: block [lo, hi) sees keys
        # [0, hi); columns [L - lo, L + n) of the buffer are zeros for the keys before the
        # block and the block's own upper triangle of -inf after them (rows: position, head).
        mask_XY = q_NLHK.new_zeros(rows, r, L + rows)
        mask_XY[..., L:].masked_fill_(torch.ones(
            rows, rows, dtype=torch.bool, device=q_NLHK.device).triu_(1)[:, None], float("-inf"))
        o_blocks, p_blocks = [], []
        for lo in range(0, L, rows):
            hi = min(L, lo + rows)
            n = hi - lo
            s_BRC = torch.baddbmm(mask_XY[:n, :, L - lo:L + n].reshape(n * r, hi),
                                  q_BXK[:, lo * r:hi * r], k_BLK[:, :hi].transpose(1, 2))
            p_BRC = torch.softmax(s_BRC, -1)
            o_blocks.append(torch.bmm(p_BRC, v_BLK[:, :hi]))
            p_blocks.append(p_BRC)
        o_BXK = torch.cat(o_blocks, 1) if len(o_blocks) > 1 else o_blocks[0]
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q_BXK, k_BLK, v_BLK, o_BXK, *p_blocks)
            ctx.shape, ctx.rows, ctx.scale = (N, L, H, G, K), rows, scale
        return _ungrouped(o_BXK, N, L, G)

    @staticmethod
    def backward(ctx, do_NLHK):
        q_BXK, k_BLK, v_BLK, o_BXK, *p_blocks = ctx.saved_tensors
        (N, L, H, G, K), rows, scale = ctx.shape, ctx.rows, ctx.scale
        r = H // G
        do_BXK = _grouped(do_NLHK, G)
        delta_BX1 = (do_BXK * o_BXK).sum(-1, keepdim=True)
        dk_BLK, dv_BLK = torch.zeros_like(k_BLK), torch.zeros_like(v_BLK)
        dq_blocks = []
        for p_BRC, lo in zip(p_blocks, range(0, L, rows)):
            hi = min(L, lo + rows)
            do_BRK = do_BXK[:, lo * r:hi * r]
            dv_BLK[:, :hi] += torch.bmm(p_BRC.transpose(1, 2), do_BRK)
            ds_BRC = torch.bmm(do_BRK, v_BLK[:, :hi].transpose(1, 2))
            ds_BRC.sub_(delta_BX1[:, lo * r:hi * r]).mul_(p_BRC)
            dq_blocks.append(torch.bmm(ds_BRC, k_BLK[:, :hi]))
            dk_BLK[:, :hi] += torch.bmm(ds_BRC.transpose(1, 2), q_BXK[:, lo * r:hi * r])
        dq_BXK = (torch.cat(dq_blocks, 1) if len(dq_blocks) > 1 else dq_blocks[0]).mul_(scale)
        dk_NLGK = dk_BLK.view(N, G, L, K).transpose(1, 2)
        dv_NLGK = dv_BLK.view(N, G, L, K).transpose(1, 2)
        return _ungrouped(dq_BXK, N, L, G), dk_NLGK, dv_NLGK, None


def _grouped(t_NLHK: torch.Tensor, G: int) -> torch.Tensor:
    """[N, L, H, K] -> [N·G, L·r, K]: per k/v head, its r query heads at every position."""
    N, L, H, K = t_NLHK.shape
    return t_NLHK.reshape(N, L, G, H // G, K).transpose(1, 2).reshape(N * G, L * (H // G), K)


def _ungrouped(t_BXK: torch.Tensor, N: int, L: int, G: int) -> torch.Tensor:
    """Inverse of `_grouped`: [N·G, L·r, K] -> [N, L, H, K] (contiguous)."""
    K = t_BXK.shape[-1]
    return t_BXK.reshape(N, G, L, -1, K).transpose(1, 2).reshape(N, L, -1, K).contiguous()


def fits(n: int, length: int, n_heads: int, causal: bool, dtype: torch.dtype) -> bool:
    """Whether a run of n sequences of `length` goes through blocks (else SDPA)."""
    if not causal or length > MAX_LEN or dtype not in (torch.float32, torch.float64):
        return False
    n_blocks = math.ceil(length / block_rows(length))
    seen = (n_blocks + 1) / (2 * n_blocks)  # the fraction of keys a query row's block sees
    return n * n_heads * length * length * seen <= MAX_SAVED


def attend_run(q_NLHK: torch.Tensor, k_NLGK: torch.Tensor, v_NLGK: torch.Tensor
               ) -> torch.Tensor:
    """Causal attention over one run of N sequences of length L, packed: [N, L, H, K]."""
    return _BlockedAttention.apply(q_NLHK, k_NLGK, v_NLGK, block_rows(q_NLHK.shape[1]))


def varlen_attention(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor,
                     cu_seqlens_S1: torch.Tensor, max_seqlen: int, causal: bool = True
                     ) -> torch.Tensor:
    """Same contract as `kernels.reference.varlen_attention`: runs of equal-length sequences
    that `fits` (causal, short enough) go through blocks, the rest through the reference's
    SDPA."""
    del max_seqlen
    return reference.by_runs(q_THK, k_TGK, v_TGK, cu_seqlens_S1, causal, _attend_run)


def _attend_run(q_THK: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor, n: int,
                length: int, causal: bool) -> torch.Tensor:
    """One piece of `reference.equal_length_runs`: through blocks when it `fits`, else SDPA."""
    T, H, K = q_THK.shape
    if not n or not fits(n, length, H, causal, q_THK.dtype):
        return reference.attend_run(q_THK, k_TGK, v_TGK, n, length, causal)
    G = k_TGK.shape[1]
    return attend_run(q_THK.view(n, length, H, K), k_TGK.view(n, length, G, K),
                      v_TGK.view(n, length, G, K)).view(T, H, K)
