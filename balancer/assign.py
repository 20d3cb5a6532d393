"""Rank assignment within a step: SP groups on aligned rank groups, then LPT, then local search.

Minimises the largest per-rank time (the step time when ranks synchronise once per step):
a rank's cost divided by its speed. Ranks are equal unless the caller gives measured speeds
(``inv_speed_R``, 1/speed: a rank at half speed takes twice as long for the same cost); then
LPT puts each sample where it would *finish* first (the uniform-machines rule) and the local
search compares times.
SP groups go first because they are the least flexible: a group of k must sit on ranks
`[g*k, (g+1)*k)`. Whole samples then fill around them by LPT (largest first onto the least
loaded rank, within 4/3 of optimal), and a bounded local search moves or swaps samples off the
most loaded rank while that lowers it.

Shape suffixes: N samples of the step, R ranks, G SP groups.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def lpt(cost_N, order_N, load_R):
    """Each sample, in `order_N` (largest first), onto the least-loaded rank (lowest index on
    ties). Updates `load_R` in place and returns the rank of every sample (-1 if not in order)."""
    rank_N = np.full(len(cost_N), -1, np.int64)
    n_ranks = len(load_R)
    for o in range(len(order_N)):
        i = order_N[o]
        best = 0
        for r in range(1, n_ranks):
            if load_R[r] < load_R[best]:
                best = r
        rank_N[i] = best
        load_R[best] += cost_N[i]
    return rank_N


@njit(cache=True)
def lpt_speeds(cost_N, order_N, load_R, inv_speed_R):
    """`lpt` on ranks of different speeds: each sample onto the rank where it would finish
    first (`load_R` in time; a sample takes cost × 1/speed there), lowest index on ties."""
    rank_N = np.full(len(cost_N), -1, np.int64)
    n_ranks = len(load_R)
    for o in range(len(order_N)):
        i = order_N[o]
        best = 0
        for r in range(1, n_ranks):
            if load_R[r] + cost_N[i] * inv_speed_R[r] < \
                    load_R[best] + cost_N[i] * inv_speed_R[best]:
                best = r
        rank_N[i] = best
        load_R[best] += cost_N[i] * inv_speed_R[best]
    return rank_N


@njit(cache=True)
def lpt_capped(cost_N, tokens_N, order_N, load_R, tok_R, cap, inv_speed_R, uniform):
    """`lpt` (`lpt_speeds` unless `uniform`) among the ranks whose tokens stay within `cap`
    (the least-filled rank when none has room). Updates `load_R` and `tok_R` in place;
    returns every sample's rank."""
    rank_N = np.full(len(cost_N), -1, np.int64)
    n_ranks = len(load_R)
    for o in range(len(order_N)):
        i = order_N[o]
        c = cost_N[i]
        best = -1
        for r in range(n_ranks):
            if tok_R[r] + tokens_N[i] > cap:
                continue
            if best < 0:
                best = r
            elif uniform:
                if load_R[r] < load_R[best]:
                    best = r
            elif load_R[r] + c * inv_speed_R[r] < load_R[best] + c * inv_speed_R[best]:
                best = r
        if best < 0:
            best = int(np.argmin(tok_R))
        rank_N[i] = best
        load_R[best] += c * inv_speed_R[best]
        tok_R[best] += tokens_N[i]
    return rank_N


def local_search(cost_N, rank_N, movable_N, load_R, max_iters, n_partners,
                 tokens_N=None, tok_R=None, cap=-1, inv_speed_R=None):
    """Move or swap movable samples off the most loaded rank while that lowers its load.

    Per iteration: the best single move to the least loaded rank (to any of the `n_partners`
    least loaded when ranks differ in speed: a slow rank may be least loaded and still the
    worst place), or the best swap with a sample of one of the `n_partners` least loaded ranks
    (the only ranks a swap can help much). Never raises the maximum, so the result is never
    worse than its input. With a token `cap` (>= 0; `tokens_N` and the per-rank `tok_R`
    given), no move or swap takes a rank over it. `load_R` is in time (cost × 1/speed,
    `inv_speed_R`; equal ranks when None). Updates `rank_N`, `load_R` (and `tok_R`) in place;
    returns the number of improvements made.
    """
    if cap < 0:
        tokens_N, tok_R = np.zeros(len(cost_N), np.int64), np.zeros(len(load_R), np.int64)
    uniform = inv_speed_R is None
    inv = np.ones(len(load_R)) if uniform else np.ascontiguousarray(inv_speed_R, np.float64)
    return _local_search(cost_N, rank_N, movable_N, load_R, max_iters, n_partners, tokens_N,
                         tok_R, cap, inv, uniform)


@njit(cache=True)
def _local_search(cost_N, rank_N, movable_N, load_R, max_iters, n_partners, tokens_N, tok_R,
                  cap, inv_R, uniform):
    capped = cap >= 0
    n = len(cost_N)
    n_ranks = len(load_R)
    if n_ranks < 2:
        return 0
    n_partners = min(n_partners, n_ranks - 1)
    is_partner_R = np.zeros(n_ranks, np.bool_)
    mine = np.empty(n, np.int64)
    made = 0
    for _ in range(max_iters):
        r = np.argmax(load_R)
        top = load_R[r]
        tiny = 1e-12 * max(abs(top), 1e-300)
        order_R = np.argsort(load_R, kind="mergesort")
        is_partner_R[:] = False
        low = -1
        k = 0
        for q in order_R:
            if q != r and k < n_partners:
                is_partner_R[q] = True
                if low < 0:
                    low = q
                k += 1
        n_mine = 0
        for i in range(n):
            if rank_N[i] == r and movable_N[i]:
                mine[n_mine] = i
                n_mine += 1
        best_new = top
        best_i = -1
        best_j = -1
        best_q = low
        for q in order_R:  # moves: to `low` alone when ranks are equal (the best of them)
            if q == r or not is_partner_R[q] or (uniform and q != low):
                continue
            for m in range(n_mine):
                i = mine[m]
                if capped and tok_R[q] + tokens_N[i] > cap:
                    continue
                new = max(top - cost_N[i] * inv_R[r], load_R[q] + cost_N[i] * inv_R[q])
                if new < best_new - tiny:
                    best_new, best_i, best_j, best_q = new, i, -1, q
        for j in range(n):
            q = rank_N[j]
            if not movable_N[j] or not is_partner_R[q]:
                continue
            for m in range(n_mine):
                i = mine[m]
                d = cost_N[i] - cost_N[j]
                if d <= 0:
                    continue
                if capped and (tok_R[q] + tokens_N[i] - tokens_N[j] > cap
                               or tok_R[r] + tokens_N[j] - tokens_N[i] > cap):
                    continue
                new = max(top - d * inv_R[r], load_R[q] + d * inv_R[q])
                if new < best_new - tiny:
                    best_new, best_i, best_j = new, i, j
        if best_i < 0:
            break
        if best_j < 0:
            q = best_q
            rank_N[best_i] = q
            load_R[r] -= cost_N[best_i] * inv_R[r]
            load_R[q] += cost_N[best_i] * inv_R[q]
            if capped:
                tok_R[r] -= tokens_N[best_i]
                tok_R[q] += tokens_N[best_i]
        else:
            q = rank_N[best_j]
            d = cost_N[best_i] - cost_N[best_j]
            rank_N[best_i] = q
            rank_N[best_j] = r
            load_R[r] -= d * inv_R[r]
            load_R[q] += d * inv_R[q]
            if capped:
                dt = tokens_N[best_i] - tokens_N[best_j]
                tok_R[r] -= dt
                tok_R[q] += dt
        made += 1
    return made


def place_sp_groups(unit_cost_N, sp_size_N, order_N, load_R, inv_speed_R=None):
    """Each split sample (in `order_N`: largest k, then largest cost first) onto the aligned
    group `[g*k, (g+1)*k)` whose most loaded rank is least loaded (then least total load,
    then lowest g). Returns the group's first rank per sample (-1 for samples not placed).
    With speeds (`inv_speed_R`), a slice takes its group's slowest rank's time on every rank
    of the group (the Ulysses all-to-alls pace the group) and `load_R` is in time."""
    inv = np.ones(len(load_R)) if inv_speed_R is None \
        else np.ascontiguousarray(inv_speed_R, np.float64)
    return _place_sp_groups(unit_cost_N, sp_size_N, order_N, load_R, inv)


@njit(cache=True)
def _place_sp_groups(unit_cost_N, sp_size_N, order_N, load_R, inv_R):
    first_N = np.full(len(unit_cost_N), -1, np.int64)
    n_ranks = len(load_R)
    for o in range(len(order_N)):
        i = order_N[o]
        k = sp_size_N[i]
        best = -1
        best_max = np.inf
        best_sum = np.inf
        for g in range(n_ranks // k):
            mx = -np.inf
            sm = 0.0
            for r in range(g * k, (g + 1) * k):
                mx = max(mx, load_R[r])
                sm += load_R[r]
            if mx < best_max or (mx == best_max and sm < best_sum):
                best, best_max, best_sum = g, mx, sm
        first_N[i] = best * k
        slowest = 0.0
        for r in range(best * k, (best + 1) * k):
            slowest = max(slowest, inv_R[r])
        for r in range(best * k, (best + 1) * k):
            load_R[r] += unit_cost_N[i] * slowest
    return first_N


def assign_ranks(unit_cost_N: np.ndarray, sp_size_N: np.ndarray, dp: int,
                 search_iters: int | None = None, n_partners: int = 4,
                 slice_tokens_N: np.ndarray | None = None, token_cap: int | None = None,
                 speed_R: np.ndarray | None = None):
    """First rank of every sample (its rank if whole, its group's first rank if split) and the
    resulting per-rank time (cost / speed; the cost when ``speed_R`` is None: equal ranks).
    Deterministic: stable orders, lowest index on ties.

    ``token_cap``: whole samples go only where the rank's tokens (``slice_tokens_N`` per rank
    of a sample) stay within it, where they can: a rank over ``m × micro_batch_tokens`` needs
    an (m+1)-th micro-batch on every rank, whose fixed cost may exceed what the cost balance
    gains (``planner``).
    """
    unit_cost_N = np.ascontiguousarray(unit_cost_N, np.float64)
    sp_size_N = np.ascontiguousarray(sp_size_N, np.int64)
    n = len(unit_cost_N)
    load_R = np.zeros(dp, np.float64)
    uniform = speed_R is None
    inv_R = np.ones(dp) if uniform else 1.0 / np.asarray(speed_R, np.float64)
    index_N = np.arange(n)
    split_N = sp_size_N > 1
    sp_order = index_N[split_N][np.lexsort((index_N[split_N], -unit_cost_N[split_N],
                                            -sp_size_N[split_N]))]
    first_N = place_sp_groups(unit_cost_N, sp_size_N, sp_order, load_R, inv_R)
    whole_order = index_N[~split_N][np.lexsort((index_N[~split_N], -unit_cost_N[~split_N]))]
    iters = 2 * dp + 16 if search_iters is None else search_iters
    inv_search = None if uniform else inv_R
    if token_cap is None:
        rank_N = lpt(unit_cost_N, whole_order, load_R) if uniform \
            else lpt_speeds(unit_cost_N, whole_order, load_R, inv_R)
        local_search(unit_cost_N, rank_N, ~split_N, load_R, iters, n_partners,
                     inv_speed_R=inv_search)
    else:
        tokens_N = np.ascontiguousarray(slice_tokens_N, np.int64)
        tok_R = np.zeros(dp, np.int64)
        for i in np.flatnonzero(split_N):
            tok_R[first_N[i]:first_N[i] + sp_size_N[i]] += tokens_N[i]
        rank_N = lpt_capped(unit_cost_N, tokens_N, whole_order, load_R, tok_R, int(token_cap),
                            inv_R, uniform)
        local_search(unit_cost_N, rank_N, ~split_N, load_R, iters, n_partners, tokens_N, tok_R,
                     int(token_cap), inv_search)
    return np.where(split_N, first_N, rank_N), load_R
