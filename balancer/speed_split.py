"""A split sample's slices sized by its ranks' speeds (speed-aware Ulysses).

Ulysses gives every rank of an SP group all of the sequence's tokens for 1/k of the attention
heads, so the attention part of a split sample (`attn`, the cost model's quadratic term) costs
each rank attn/k whatever slice it holds; everything else (projections, MLP / experts, norms,
the slice's all-to-all) is token-wise and costs in proportion to the slice. Equal slices make a
slow rank the group's straggler. Here rank j holds a fraction t_j of the tokens, chosen so the
ranks finish their parts together: rank j's part is `work × ((1 − φ)·t_j + φ/k)` (work: the
whole sample's cost with its communication, k × `split.unit_cost`; φ: its attention share) and
takes that over its speed s_j. Equal finish times give

    t_j = (τ·s_j − φ/k) / (1 − φ),   τ = 1 / Σ s   (time in work units),

clipped to [lo, hi] (a slice holds at least one token and at most the micro-batch budget), τ
then set so the clipped fractions still sum to 1 (water-filling). On equal speeds t_j = 1/k and
each part costs work/k: the even split.

With equal heads a slow rank's part cannot fall below its attention share φ/k, and a fast rank
whose slice is at the budget cannot take more: a long sample mostly attention then leaves its
slow rank the group's straggler. Heads sized by speed lift that bound (`split_parts`): rank j
attends h_j of the H query heads (the Ulysses exchange sends rows of uneven width,
`parallel.sequence`), its part is `work × ((1 − φ)·t_j + φ·g_j)` with g_j = h_j / H, and φ/k
above becomes φ·g_j. The heads go by speed (`head_counts`) and are kept only when the group
then finishes sooner than with H/k each.

Shape suffix: K ranks of the group.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def speed_fractions(attn_share, s_K, lo, hi, g_K):
    """Token fractions t_K (Σ = 1, each in [lo, hi]; module docstring) for a sample whose
    attention share is `attn_share`, split over ranks of speeds `s_K` attending the fractions
    `g_K` of its heads (1/k each: equal heads). Needs k·lo ≤ 1 ≤ k·hi.
    Σ_j clip(t_j(τ), lo, hi) rises with τ, so bisection finds the τ where it is 1."""
    k = len(s_K)
    lin = 1.0 - attn_share
    if lin <= 1e-12 or k == 1:
        return np.full(k, 1.0 / k)  # attention only: every slice costs the same
    t_K = np.empty(k)
    low, high = np.inf, 0.0  # every slice at lo (Σ ≤ 1) .. every slice at hi (Σ ≥ 1)
    for j in range(k):
        a = attn_share * g_K[j]
        low = min(low, (lin * lo + a) / s_K[j])
        high = max(high, (lin * hi + a) / s_K[j])
    for _ in range(100):
        tau = 0.5 * (low + high)
        total = 0.0
        for j in range(k):
            total += min(hi, max(lo, (tau * s_K[j] - attn_share * g_K[j]) / lin))
        if total < 1.0:
            low = tau
        else:
            high = tau
    total = 0.0
    for j in range(k):
        t_K[j] = min(hi, max(lo, (high * s_K[j] - attn_share * g_K[j]) / lin))
        total += t_K[j]
    return t_K / total


@njit(cache=True)
def part_costs(work, attn_share, t_K, g_K):
    """Each rank's part of a split sample of cost `work` (with its communication) holding the
    token fractions `t_K` and attending the fractions `g_K` of its heads, in work units
    (module docstring)."""
    return work * ((1.0 - attn_share) * t_K + attn_share * g_K)


@njit(cache=True)
def head_counts(s_K, n_heads):
    """Query heads per rank in proportion to its speed: each at least one, Σ = `n_heads`
    (≥ k): every rank's whole share, then the heads left one by one to the largest remainders
    (or taken back from the smallest, from ranks with more than one), lowest rank on ties."""
    k = len(s_K)
    exact_K = s_K / s_K.sum() * n_heads
    h_K = np.maximum(np.floor(exact_K), 1.0).astype(np.int64)
    rem_K = exact_K - np.floor(exact_K)
    rest = n_heads - h_K.sum()
    while rest > 0:
        j = np.argmax(rem_K)
        h_K[j] += 1
        rem_K[j] = -np.inf
        rest -= 1
    while rest < 0:
        best = -1
        for j in range(k):
            if h_K[j] > 1 and (best < 0 or rem_K[j] < rem_K[best]):
                best = j
        h_K[best] -= 1
        rem_K[best] = np.inf
        rest += 1
    return h_K


@njit(cache=True)
def head_fractions(h_K):
    """The fraction of the heads each rank attends: h_K / Σ h, or 1/k each when `h_K` is all
    zero (equal heads)."""
    k = len(h_K)
    if h_K[0] == 0:
        return np.full(k, 1.0 / k)
    return h_K / h_K.sum()


@njit(cache=True)
def split_parts(attn_share, s_K, lo, hi, n_heads):
    """(t_K, h_K) for a sample split over ranks of speeds `s_K`: its token fractions and the
    query heads each rank attends -- all zero for H/k each (equal heads; always when
    `n_heads` is 0, the model's heads unknown to the planner, or below k). Heads by speed
    (`head_counts`) are kept only when the group's slowest part then takes less time."""
    k = len(s_K)
    zero_K = np.zeros(k, np.int64)
    g_K = np.full(k, 1.0 / k)
    t_K = speed_fractions(attn_share, s_K, lo, hi, g_K)
    if n_heads < k or attn_share <= 0.0:
        return t_K, zero_K
    h_K = head_counts(s_K, n_heads)
    if (h_K == h_K[0]).all():
        return t_K, zero_K  # H/k each
    g2_K = h_K / n_heads
    t2_K = speed_fractions(attn_share, s_K, lo, hi, g2_K)
    if (part_costs(1.0, attn_share, t2_K, g2_K) / s_K).max() \
            < (part_costs(1.0, attn_share, t_K, g_K) / s_K).max() * (1.0 - 1e-9):
        return t2_K, h_K
    return t_K, zero_K


def slice_lengths(tokens: int, t_K: np.ndarray, most: int | None = None) -> np.ndarray:
    """Whole-token slice lengths (Σ = tokens), each at least one and at most ``most`` (the
    micro-batch budget), nearest the fractions: each fraction's whole tokens, then the tokens
    left one by one to the largest remainders with room (or taken back from the smallest).
    Needs k ≤ tokens ≤ k·most."""
    most = tokens if most is None else int(most)
    exact_K = np.asarray(t_K, np.float64) * tokens
    lengths_K = np.clip(np.floor(exact_K), 1, most).astype(np.int64)
    order = np.argsort(-(exact_K - np.floor(exact_K)), kind="stable")
    rest = tokens - int(lengths_K.sum())
    while rest:
        step, before = (1 if rest > 0 else -1), rest
        for j in (order if step > 0 else order[::-1]).tolist():
            if rest and 1 <= lengths_K[j] + step <= most:
                lengths_K[j] += step
                rest -= step
        if rest == before:
            raise ValueError(f"{tokens} tokens do not make {len(lengths_K)} slices of 1 to "
                             f"{most} tokens")
    return lengths_K
