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
The least (and most) loaded rank or group comes from a tournament tree (`balancer.ranktree`)
rather than a scan of the ranks, so a step of N samples costs O(N log R) on equal ranks (the
scans made it O(N·R) and the local search O(R² log R): seconds at 16,384 ranks); the trees
pick the same ranks as the scans, lowest index on ties. With speeds, LPT still scans (a
sample's finish time on a rank depends on both load and speed).

Shape suffixes: N samples of the step, R ranks, G SP groups.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from omniscale.balancer.ranktree import build, build2, least_within, smallest, update, update2
from omniscale.balancer.speed_split import head_fractions, part_costs, split_parts


@njit(cache=True)
def lpt(cost_N, order_N, load_R):
    """Each sample, in `order_N` (largest first), onto the least-loaded rank (lowest index on
    ties). Updates `load_R` in place and returns the rank of every sample (-1 if not in order).
    A tournament tree finds the rank (`balancer.ranktree`): O(N log R), the same ranks as a scan."""
    rank_N = np.full(len(cost_N), -1, np.int64)
    if len(order_N) == 0:
        return rank_N
    key_P, win_V = build(load_R)
    for o in range(len(order_N)):
        i = order_N[o]
        best = win_V[1]
        rank_N[i] = best
        load_R[best] += cost_N[i]
        update(key_P, win_V, best, load_R[best])
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
    if uniform:
        return _lpt_capped_uniform(cost_N, tokens_N, order_N, load_R, tok_R, cap)
    rank_N = np.full(len(cost_N), -1, np.int64)
    n_ranks = len(load_R)
    for o in range(len(order_N)):
        i = order_N[o]
        c = cost_N[i]
        best = -1
        for r in range(n_ranks):
            if tok_R[r] + tokens_N[i] > cap:
                continue
            if best < 0 or load_R[r] + c * inv_speed_R[r] < load_R[best] + c * inv_speed_R[best]:
                best = r
        if best < 0:
            best = int(np.argmin(tok_R))
        rank_N[i] = best
        load_R[best] += c * inv_speed_R[best]
        tok_R[best] += tokens_N[i]
    return rank_N


@njit(cache=True)
def _lpt_capped_uniform(cost_N, tokens_N, order_N, load_R, tok_R, cap):
    """`lpt_capped` on equal ranks with two tournament trees (loads, tokens): the least-loaded
    rank with room is a pruned descent (`ranktree.least_within`), not a scan of every rank."""
    rank_N = np.full(len(cost_N), -1, np.int64)
    if len(order_N) == 0:
        return rank_N
    load_key, load_win = build(load_R)
    tok_key, tok_win = build(tok_R.astype(np.float64))
    for o in range(len(order_N)):
        i = order_N[o]
        best = least_within(load_key, load_win, tok_key, tok_win, float(cap - tokens_N[i]))
        if best < 0:  # no rank has room: the least filled (lowest index on ties)
            best = tok_win[1]
        rank_N[i] = best
        load_R[best] += cost_N[i]
        tok_R[best] += tokens_N[i]
        update(load_key, load_win, best, load_R[best])
        update(tok_key, tok_win, best, float(tok_R[best]))
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
    # Per iteration the most loaded rank and the least loaded ones come from tournament trees
    # and the samples of a rank from per-rank lists: O(log R + the samples on the ranks
    # involved), where a sort of the ranks and a scan of every sample made the 2R + 16
    # iterations O(R² log R). Candidates are tried in the same order as that scan (partners by
    # (load, index), samples by index), so the moves made are the same.
    capped = cap >= 0
    n_ranks = len(load_R)
    if n_ranks < 2:
        return 0
    n_partners = min(n_partners, n_ranks - 1)
    member_RC, count_R = _members_by_rank(rank_N, movable_N, n_ranks)
    low_key, low_win = build(load_R)
    high_key, high_win = build(-load_R)  # a max tree: the min of the negated loads
    partner_K = np.empty(max(n_partners, 1), np.int64)
    made = 0
    for _ in range(max_iters):
        r = high_win[1]
        top = load_R[r]
        tiny = 1e-12 * max(abs(top), 1e-300)
        n_found = smallest(low_key, low_win, n_partners, r, partner_K)
        low = partner_K[0] if n_found else -1
        mine = np.sort(member_RC[r, :count_R[r]])
        best_new = top
        best_i = -1
        best_j = -1
        best_q = low
        for k in range(n_found):  # moves: to `low` alone when ranks are equal (the best of them)
            q = partner_K[k]
            if uniform and q != low:
                continue
            for i in mine:
                if capped and tok_R[q] + tokens_N[i] > cap:
                    continue
                new = max(top - cost_N[i] * inv_R[r], load_R[q] + cost_N[i] * inv_R[q])
                if new < best_new - tiny:
                    best_new, best_i, best_j, best_q = new, i, -1, q
        theirs = np.empty(0, np.int64)
        for k in range(n_found):
            q = partner_K[k]
            theirs = np.concatenate((theirs, member_RC[q, :count_R[q]]))
        # A swap of i for j improves only if d = c_i - c_j lies in (lo, hi) below, an interval
        # that only narrows as the best so far falls: r's samples sorted by cost give the i
        # that can pass for each j by two binary searches (widened by a margin against
        # rounding; the exact test below decides), tried in index order as the full scan of
        # every (j, i) pair tried them -- so the swap chosen is the same, in O(log) per j.
        by_cost = np.argsort(cost_N[mine], kind="mergesort")
        cost_sorted = cost_N[mine][by_cost]
        largest = abs(cost_sorted[-1]) if len(mine) else 0.0
        for j in np.sort(theirs):
            q = rank_N[j]
            lo = (top - best_new + tiny) / inv_R[r]
            hi = (best_new - tiny - load_R[q]) / inv_R[q]
            margin = 1e-9 * (largest + abs(cost_N[j]) + abs(lo) + abs(hi) + 1e-300)
            a = np.searchsorted(cost_sorted, cost_N[j] + max(lo, 0.0) - margin)
            b = np.searchsorted(cost_sorted, cost_N[j] + hi + margin, side="right")
            if a >= b:
                continue
            for i in mine[np.sort(by_cost[a:b])]:
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
            _leave(member_RC, count_R, r, best_i)
            member_RC = _join(member_RC, count_R, q, best_i)
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
            _leave(member_RC, count_R, r, best_i)
            _leave(member_RC, count_R, q, best_j)
            member_RC = _join(member_RC, count_R, q, best_i)
            member_RC = _join(member_RC, count_R, r, best_j)
        for x in (r, q):
            update(low_key, low_win, x, load_R[x])
            update(high_key, high_win, x, -load_R[x])
        made += 1
    return made


@njit(cache=True)
def _members_by_rank(rank_N, movable_N, n_ranks):
    """The movable samples of each rank (row r of [R, C], the first count_R[r] entries)."""
    count_R = np.zeros(n_ranks, np.int64)
    for i in range(len(rank_N)):
        if movable_N[i]:
            count_R[rank_N[i]] += 1
    member_RC = np.empty((n_ranks, max(1, count_R.max()) + 2), np.int64)
    count_R[:] = 0
    for i in range(len(rank_N)):
        if movable_N[i]:
            member_RC[rank_N[i], count_R[rank_N[i]]] = i
            count_R[rank_N[i]] += 1
    return member_RC, count_R


@njit(cache=True)
def _leave(member_RC, count_R, r, i):
    """Sample i off rank r's list (order within a list does not matter: it is sorted when
    read)."""
    for c in range(count_R[r]):
        if member_RC[r, c] == i:
            count_R[r] -= 1
            member_RC[r, c] = member_RC[r, count_R[r]]
            return


@njit(cache=True)
def _join(member_RC, count_R, r, i):
    """Sample i onto rank r's list; the lists widen (doubled) when a row is full."""
    if count_R[r] == member_RC.shape[1]:
        wider = np.empty((member_RC.shape[0], 2 * member_RC.shape[1]), np.int64)
        wider[:, :member_RC.shape[1]] = member_RC
        member_RC = wider
    member_RC[r, count_R[r]] = i
    count_R[r] += 1
    return member_RC


def place_sp_groups(unit_cost_N, sp_size_N, order_N, load_R, inv_speed_R=None,
                    slice_bounds=None):
    """Each split sample (in `order_N`: largest k, then largest cost first) onto the aligned
    group `[g*k, (g+1)*k)` whose most loaded rank is least loaded (then least total load,
    then lowest g). Returns the group's first rank per sample (-1 for samples not placed).
    With speeds (`inv_speed_R`), `load_R` is in time and the slices are sized by the group's
    speeds (`balancer.speed_split`): `slice_bounds` = (attention share, least and most token
    fraction of a slice) per sample, then the model's query heads (0: unknown); without them,
    equal slices, each taking the group's slowest rank's time on every rank (the Ulysses
    all-to-alls pace the group).
    The group sizes of the samples in `order_N` must be powers of two at most len(load_R)."""
    inv = np.ones(len(load_R)) if inv_speed_R is None \
        else np.ascontiguousarray(inv_speed_R, np.float64)
    k_O = np.asarray(sp_size_N)[np.asarray(order_N, np.int64)]
    if len(k_O) and ((k_O < 1).any() or (k_O & (k_O - 1)).any() or k_O.max() > len(load_R)):
        raise ValueError(f"place_sp_groups: SP group sizes must be powers of two <= "
                         f"{len(load_R)} ranks, got {sorted(set(k_O.tolist()))}")
    by_speed = inv_speed_R is not None and slice_bounds is not None
    n = len(unit_cost_N)
    share_N, lo_N, hi_N = (np.ascontiguousarray(b, np.float64) for b in slice_bounds[:3]) \
        if by_speed else (np.zeros(n), np.zeros(n), np.ones(n))
    n_heads = int(slice_bounds[3]) if by_speed and len(slice_bounds) > 3 else 0
    return _place_sp_groups(unit_cost_N, sp_size_N, order_N, load_R, inv, by_speed, share_N,
                            lo_N, hi_N, n_heads)


@njit(cache=True)
def _level(k):
    """log2 of a power of two."""
    lv = 0
    while (1 << lv) < k:
        lv += 1
    return lv


@njit(cache=True)
def _group_key(load_R, g, k):
    """(most loaded rank, summed load) of group g of size k, summed in rank order."""
    mx = -np.inf
    sm = 0.0
    for r in range(g * k, (g + 1) * k):
        mx = max(mx, load_R[r])
        sm += load_R[r]
    return mx, sm


@njit(cache=True)
def _place_sp_groups(unit_cost_N, sp_size_N, order_N, load_R, inv_R, by_speed, share_N, lo_N,
                     hi_N, n_heads):
    # One tournament tree per group size in use, over that size's aligned groups keyed by
    # (most loaded rank, summed load): the best group is the root, where a scan of every
    # group cost O(R) per split sample. Placing a sample changes the groups of every size
    # that overlap its ranks; each is re-keyed from its ranks (summed in rank order, as the
    # scan summed) and its tree path updated.
    first_N = np.full(len(unit_cost_N), -1, np.int64)
    n_ranks = len(load_R)
    if len(order_N) == 0:
        return first_N
    n_levels = _level(n_ranks + 1)
    used_L = np.zeros(n_levels + 1, np.bool_)
    for o in range(len(order_N)):
        used_L[_level(sp_size_N[order_N[o]])] = True
    size_L = np.zeros(n_levels + 1, np.int64)  # leaves of each level's tree
    off_L = np.zeros(n_levels + 2, np.int64)
    for lv in range(n_levels + 1):
        if used_L[lv]:
            size = 1
            while size < n_ranks >> lv:
                size *= 2
            size_L[lv] = size
        off_L[lv + 1] = off_L[lv] + size_L[lv]
    major = np.empty(off_L[-1], np.float64)
    minor = np.empty(off_L[-1], np.float64)
    win = np.empty(2 * off_L[-1], np.int64)
    for lv in range(n_levels + 1):
        if not used_L[lv]:
            continue
        k = 1 << lv
        n_groups = n_ranks >> lv
        mx_G = np.empty(n_groups, np.float64)
        sm_G = np.empty(n_groups, np.float64)
        for g in range(n_groups):
            mx_G[g], sm_G[g] = _group_key(load_R, g, k)
        o, size = off_L[lv], size_L[lv]
        major[o:o + size], minor[o:o + size], win[2 * o:2 * o + 2 * size] = \
            build2(mx_G, sm_G, size)
    for o in range(len(order_N)):
        i = order_N[o]
        k = sp_size_N[i]
        lv = _level(k)
        best = win[2 * off_L[lv] + 1]  # the root of this size's tree
        a = best * k
        first_N[i] = a
        if by_speed:
            t_K, h_K = split_parts(share_N[i], 1.0 / inv_R[a:a + k], lo_N[i], hi_N[i],
                                   n_heads)
            part_K = part_costs(unit_cost_N[i] * k, share_N[i], t_K, head_fractions(h_K))
            for r in range(a, a + k):
                load_R[r] += part_K[r - a] * inv_R[r]
        else:
            slowest = 0.0
            for r in range(a, a + k):
                slowest = max(slowest, inv_R[r])
            for r in range(a, a + k):
                load_R[r] += unit_cost_N[i] * slowest
        for lv2 in range(n_levels + 1):
            if not used_L[lv2]:
                continue
            k2 = 1 << lv2
            lo, hi = off_L[lv2], off_L[lv2] + size_L[lv2]
            for g in range(a // k2, min((a + k - 1) // k2, (n_ranks >> lv2) - 1) + 1):
                mx, sm = _group_key(load_R, g, k2)
                update2(major[lo:hi], minor[lo:hi], win[2 * lo:2 * hi], g, mx, sm)
    return first_N


def assign_ranks(unit_cost_N: np.ndarray, sp_size_N: np.ndarray, dp: int,
                 search_iters: int | None = None, n_partners: int = 4,
                 slice_tokens_N: np.ndarray | None = None, token_cap: int | None = None,
                 speed_R: np.ndarray | None = None, slice_bounds=None):
    """First rank of every sample (its rank if whole, its group's first rank if split) and the
    resulting per-rank time (cost / speed; the cost when ``speed_R`` is None: equal ranks).
    Deterministic: stable orders, lowest index on ties.

    ``token_cap``: whole samples go only where the rank's tokens (``slice_tokens_N`` per rank
    of a sample) stay within it, where they can: a rank over ``m × micro_batch_tokens`` needs
    an (m+1)-th micro-batch on every rank, whose fixed cost may exceed what the cost balance
    gains (``planner``). ``slice_bounds``: split samples' slices sized by speed
    (``place_sp_groups``).
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
    first_N = place_sp_groups(unit_cost_N, sp_size_N, sp_order, load_R, inv_R, slice_bounds)
    # costliest first, ties by index: a stable sort of the negated costs (a lexsort with the
    # index as a second key gives the same order at twice the time)
    whole_order = index_N[~split_N][np.argsort(-unit_cost_N[~split_N], kind="stable")]
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
