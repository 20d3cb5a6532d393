"""Long-short split: which samples run on a sequence-parallel (SP) group, and of what size.

A sample much costlier than what one rank carries in a step would set the step time alone, and
a sample longer than the micro-batch budget cannot run on one rank at all. Such a sample is
split over an aligned group of k ranks (k a power of two); each rank then holds
`slice_tokens(L, k)` tokens and carries `c/k` plus the Ulysses all-to-all cost of its slice
(`cost.CommModel`).

Shape suffix: N samples.
"""

from __future__ import annotations

import numpy as np

from omniscale.balancer.types import slice_tokens


def largest_sp_size(sp_max: int, dp: int) -> int:
    """The largest SP group allowed: a power of two, at most sp_max and at most dp ranks."""
    return min(sp_max, 1 << (int(dp).bit_length() - 1))


def slot_share(cost_N: np.ndarray, tokens_N: np.ndarray, n_steps: int, dp: int,
               micro_batch_tokens: int) -> float:
    """What one rank should carry in one micro-batch slot: the per-rank share of a step
    (cost / (steps × dp)) over the slots its tokens need (at least one).

    FSDP synchronises every micro-batch, so a slice costlier than this makes its slot slow on
    every rank: the other ranks cannot fill that slot to match under the token budget.
    """
    per_rank = float(np.sum(cost_N)) / (n_steps * dp)
    tokens = float(np.sum(tokens_N)) / (n_steps * dp)
    return per_rank / max(1.0, np.ceil(tokens / micro_batch_tokens))


def unit_cost(cost_N: np.ndarray, tokens_N: np.ndarray, sp_size_N: np.ndarray,
              sp_comm_per_token: float) -> np.ndarray:
    """Cost one rank carries for a sample: c for a whole sample, c/k + comm for a split one
    (comm: `sp_comm_per_token` × its slice × (k−1)/k, the part of the slice it sends)."""
    sp_size_N = np.asarray(sp_size_N, np.int64)
    comm_N = np.where(sp_size_N > 1, sp_comm_per_token * slice_tokens(tokens_N, sp_size_N)
                      * (sp_size_N - 1) / sp_size_N, 0.0)
    return cost_N / sp_size_N + comm_N


def choose_sp_size(cost_N: np.ndarray, tokens_N: np.ndarray, share: float, *, sp_max: int,
                   dp: int, micro_batch_tokens: int,
                   sp_comm_per_token: float = 0.0) -> np.ndarray:
    """SP group size per sample (int32, 1 = whole).

    The smallest k in 1, 2, 4, … ≤ `largest_sp_size` whose per-rank cost fits the per-rank
    share (`c/k + comm ≤ share`; the largest allowed k when none does), raised if needed until
    the slice fits the hard micro-batch budget. Raises ValueError naming the first sample that
    cannot fit the budget even on the largest group: no plan could run it.
    """
    tokens_N = np.asarray(tokens_N, np.int64)
    cost_N = np.asarray(cost_N, np.float64)
    k_max = largest_sp_size(sp_max, dp)
    too_long = tokens_N > micro_batch_tokens * k_max
    if too_long.any():
        i = int(np.argmax(too_long))
        raise ValueError(
            f"sample {i} has {int(tokens_N[i])} tokens: more than micro_batch_tokens × sp_max "
            f"= {micro_batch_tokens} × {k_max} = {micro_batch_tokens * k_max}"
            + (f" (sp_max {sp_max} capped to {k_max} by dp {dp})" if k_max < sp_max else ""))
    k_cost_N = np.full(len(tokens_N), k_max, np.int64)  # no k fits the share: the largest
    k_budget_N = np.full(len(tokens_N), k_max, np.int64)
    k = k_max
    while k >= 1:  # downwards, so the smallest fitting k is written last
        k_N = np.full(len(tokens_N), k)
        k_cost_N[unit_cost(cost_N, tokens_N, k_N, sp_comm_per_token) <= share] = k
        k_budget_N[slice_tokens(tokens_N, k) <= micro_batch_tokens] = k
        k //= 2
    return np.maximum(k_cost_N, k_budget_N).astype(np.int32)
