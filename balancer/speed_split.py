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
each part costs work/k: the even split. A slow rank's slice cannot fall below its attention
share, so the time saved is bounded by φ: only uneven head counts would lift that bound.

Shape suffix: K ranks of the group.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def speed_fractions(attn_share, s_K, lo, hi):
    """Token fractions t_K (Σ = 1, each in [lo, hi]; module docstring) for a sample whose
    attention share is `attn_share`, split over ranks of speeds `s_K`. Needs k·lo ≤ 1 ≤ k·hi.
    Σ_j clip(t_j(τ), lo, hi) rises with τ, so bisection finds the τ where it is 1."""
    k = len(s_K)
    lin = 1.0 - attn_share
    if lin <= 1e-12 or k == 1:
        return np.full(k, 1.0 / k)  # attention only: every slice costs the same
    a = attn_share / k
    t_K = np.empty(k)
    low, high = np.inf, 0.0  # every slice at lo (Σ ≤ 1) .. every slice at hi (Σ ≥ 1)
    for j in range(k):
        low = min(low, (lin * lo + a) / s_K[j])
        high = max(high, (lin * hi + a) / s_K[j])
    for _ in range(100):
        tau = 0.5 * (low + high)
        total = 0.0
        for j in range(k):
            total += min(hi, max(lo, (tau * s_K[j] - a) / lin))
        if total < 1.0:
            low = tau
        else:
            high = tau
    total = 0.0
    for j in range(k):
        t_K[j] = min(hi, max(lo, (high * s_K[j] - a) / lin))
        total += t_K[j]
    return t_K / total


@njit(cache=True)
def part_costs(work, attn_share, t_K):
    """Each rank's part of a split sample of cost `work` (with its communication) holding the
    token fractions `t_K`, in work units (module docstring)."""
    k = len(t_K)
    return work * ((1.0 - attn_share) * t_K + attn_share / k)


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
