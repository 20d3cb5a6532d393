"""Packing: samples into the (rank, micro-batch slot) grid under a hard token budget.

The budget bounds activation memory, so it is never exceeded. Every rank runs the same number
of micro-batches (FSDP gathers parameters per micro-batch, so all ranks must issue the same
collectives; a rank with fewer real ones runs empty slots). The slices of a split sample run in
the same slot on all k ranks of its group, since the Ulysses all-to-alls pair them. Because
ranks wait for each other at every micro-batch, the step time is Σ_slots max_ranks(slot cost),
not the max of the per-rank sums: packing minimises that sum directly.

How: every slot has a height, its most loaded rank's cost. Samples go in costliest first (split
samples before whole ones, widest group first: they need a slot free on the most ranks) into
the cell that raises the sum of heights least, i.e. into the gaps under heights other ranks set;
among free fills the tightest gap wins (big gaps stay for big samples). Ranks are given (the
assignment balanced the per-rank totals, the DDP objective). A local search then moves and
swaps whole samples between the slots of one rank while that lowers the sum of heights, so
per-rank totals never change.

Shape suffixes: N samples of the step, R ranks, B micro-batch slots.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _best_slot(a, k, t, c, n_open, tok_RB, cost_RB, height_B, budget):
    """The open slot where a piece of t tokens and cost c on ranks [a, a+k) raises Σ heights
    least; ties: the tightest gap left under the height, then the lowest slot. -1 if none
    fits."""
    best = -1
    best_rise = np.inf
    best_gap = np.inf
    for b in range(n_open):
        top = -np.inf
        fits = True
        for r in range(a, a + k):
            if tok_RB[r, b] + t > budget:
                fits = False
                break
            top = max(top, cost_RB[r, b])
        if not fits:
            continue
        new = top + c
        rise = max(0.0, new - height_B[b])
        gap = max(0.0, height_B[b] - new)
        if rise < best_rise or (rise == best_rise and gap < best_gap):
            best, best_rise, best_gap = b, rise, gap
    return best


@njit(cache=True)
def _height(cost_RB, b):
    """(max, second max, argmax) over ranks of slot b's cost."""
    top = -np.inf
    second = -np.inf
    arg = -1
    for r in range(cost_RB.shape[0]):
        v = cost_RB[r, b]
        if v > top:
            second, top, arg = top, v, r
        elif v > second:
            second = v
    return top, second, arg


@njit(cache=True)
def _by_rank(rank_N, movable_N, n_ranks):
    """Movable samples grouped by rank (CSR): (start_R1, members)."""
    start_R1 = np.zeros(n_ranks + 1, np.int64)
    for i in range(len(rank_N)):
        if movable_N[i]:
            start_R1[rank_N[i] + 1] += 1
    for r in range(n_ranks):
        start_R1[r + 1] += start_R1[r]
    fill_R = start_R1[:-1].copy()
    members = np.empty(start_R1[-1], np.int64)
    for i in range(len(rank_N)):
        if movable_N[i]:
            members[fill_R[rank_N[i]]] = i
            fill_R[rank_N[i]] += 1
    return start_R1, members


@njit(cache=True)
def align_search(slot_N, rank_N, movable_N, slice_tokens_N, unit_cost_N, tok_RB, cost_RB,
                 n_slots, budget, max_passes):
    """Moves and swaps of whole samples between two slots of one rank that lower Σ heights.

    For each slot with a single tallest rank r, try lowering r's cost there: move one of its
    samples to another of its slots, or swap it for a cheaper one of r's, whichever gives the
    largest net drop of the sum of heights (token budget kept). Per-rank totals never change.
    Updates slot_N and the grid in place; returns the number of changes made.
    """
    start_R1, members = _by_rank(rank_N, movable_N, cost_RB.shape[0])
    height_B = np.empty(n_slots, np.float64)
    for b in range(n_slots):
        height_B[b] = _height(cost_RB, b)[0]
    made = 0
    for _ in range(max_passes):
        improved = False
        for b in range(n_slots):
            top, second, r = _height(cost_RB, b)
            if r < 0 or top <= second:
                continue
            best_gain = 1e-12 * max(abs(top), 1e-300)
            best_i = -1
            best_j = -1
            best_d = -1
            # Bounds that skip only what cannot win (a candidate wins by a strictly larger
            # gain): a change of i's slot lowers b by top - max(second, top - delta), delta
            # (i's cost, or i's less a cheaper j's; costs are >= 0) at most ci, and rounded
            # subtraction is monotone, so the computed gain is at most i's move's first term,
            # and never more than top - second.
            cap = top - second
            for u in range(start_R1[r], start_R1[r + 1]):
                if best_gain >= cap:
                    break
                i = members[u]
                if slot_N[i] != b:
                    continue
                ci = unit_cost_N[i]
                ti = slice_tokens_N[i]
                lower_i = top - max(second, top - ci)
                if lower_i <= best_gain:
                    continue
                for d in range(n_slots):  # move i from b to d
                    if d != b and tok_RB[r, d] + ti <= budget:
                        gain = lower_i - max(0.0, cost_RB[r, d] + ci - height_B[d])
                        if gain > best_gain:
                            best_gain, best_i, best_j, best_d = gain, i, -1, d
                if lower_i <= best_gain:
                    continue
                for w in range(start_R1[r], start_R1[r + 1]):  # swap i with a cheaper j
                    j = members[w]
                    d = slot_N[j]
                    if d == b or unit_cost_N[j] >= ci:
                        continue
                    tj = slice_tokens_N[j]
                    if tok_RB[r, b] - ti + tj > budget or tok_RB[r, d] - tj + ti > budget:
                        continue
                    delta = ci - unit_cost_N[j]
                    gain = top - max(second, top - delta) \
                        - max(0.0, cost_RB[r, d] + delta - height_B[d])
                    if gain > best_gain:
                        best_gain, best_i, best_j, best_d = gain, i, j, d
            if best_i < 0:
                continue
            _relocate(best_i, r, b, best_d, slot_N, slice_tokens_N, unit_cost_N, tok_RB, cost_RB)
            if best_j >= 0:
                _relocate(best_j, r, best_d, b, slot_N, slice_tokens_N, unit_cost_N, tok_RB,
                          cost_RB)
            for s in (b, best_d):
                height_B[s] = _height(cost_RB, s)[0]
            made += 1
            improved = True
        if not improved:
            break
    return made


@njit(cache=True)
def _relocate(i, r, src, dst, slot_N, slice_tokens_N, unit_cost_N, tok_RB, cost_RB):
    """Sample i on rank r from slot src to slot dst."""
    slot_N[i] = dst
    tok_RB[r, src] -= slice_tokens_N[i]
    cost_RB[r, src] -= unit_cost_N[i]
    tok_RB[r, dst] += slice_tokens_N[i]
    cost_RB[r, dst] += unit_cost_N[i]


@njit(cache=True)
def _grow(tok_RB, cost_RB, height_B):
    """The grid with twice the slots (the new ones empty)."""
    n_ranks, cap = tok_RB.shape
    new_tok_RB = np.zeros((n_ranks, 2 * cap), np.int64)
    new_cost_RB = np.zeros((n_ranks, 2 * cap), np.float64)
    new_height_B = np.zeros(2 * cap, np.float64)
    new_tok_RB[:, :cap] = tok_RB
    new_cost_RB[:, :cap] = cost_RB
    new_height_B[:cap] = height_B
    return new_tok_RB, new_cost_RB, new_height_B


@njit(cache=True)
def _fill_order(unit_cost_N, sp_size_N):
    """The fill's order: widest group first, then costliest, ties by index."""
    key_N = -unit_cost_N - sp_size_N * (2.0 * np.abs(unit_cost_N).max() + 1.0) \
        if len(unit_cost_N) else np.zeros(0)
    return np.argsort(key_N, kind="mergesort")


@njit(cache=True)
def _fill(first_N, sp_size_N, slice_tokens_N, unit_cost_N, n_ranks, budget, n_open, order):
    """Greedy fill (module docstring) of a grid starting with `n_open` open slots, samples
    in `order` (`_fill_order`), then the local search. Returns slot_N, tok_RB, cost_RB, slots
    opened."""
    n = len(first_N)
    cap = n_open + 2
    tok_RB = np.zeros((n_ranks, cap), np.int64)
    cost_RB = np.zeros((n_ranks, cap), np.float64)
    height_B = np.zeros(cap, np.float64)
    slot_N = np.full(n, -1, np.int64)
    for o in range(n):
        i = order[o]
        a = first_N[i]
        k = sp_size_N[i]
        t = slice_tokens_N[i]
        c = unit_cost_N[i]
        b = _best_slot(a, k, t, c, n_open, tok_RB, cost_RB, height_B, budget)
        if b < 0:  # no open slot has room: open one (empty everywhere, so it fits)
            if n_open == tok_RB.shape[1]:
                tok_RB, cost_RB, height_B = _grow(tok_RB, cost_RB, height_B)
            b = n_open
            n_open += 1
        slot_N[i] = b
        for r in range(a, a + k):
            tok_RB[r, b] += t
            cost_RB[r, b] += c
            height_B[b] = max(height_B[b], cost_RB[r, b])
    align_search(slot_N, first_N, sp_size_N == 1, slice_tokens_N, unit_cost_N, tok_RB, cost_RB,
                 n_open, budget, 64)
    return slot_N, tok_RB, cost_RB, n_open


@njit(cache=True)
def _compact(slot_N, tok_RB, cost_RB, n_open):
    """Drop slots empty on every rank (order kept): no rank runs an all-empty micro-batch."""
    n_ranks = tok_RB.shape[0]
    new_B = np.full(n_open, -1, np.int64)
    n_slots = 0
    for b in range(n_open):
        if n_ranks and tok_RB[:, b].max() > 0:
            new_B[b] = n_slots
            n_slots += 1
    out_tok_RB = np.zeros((n_ranks, n_slots), np.int64)
    out_cost_RB = np.zeros((n_ranks, n_slots), np.float64)
    for b in range(n_open):
        if new_B[b] >= 0:
            out_tok_RB[:, new_B[b]] = tok_RB[:, b]
            out_cost_RB[:, new_B[b]] = cost_RB[:, b]
    for i in range(len(slot_N)):
        slot_N[i] = new_B[slot_N[i]]
    return slot_N, out_tok_RB, out_cost_RB, n_slots


@njit(cache=True)
def pack(first_N, sp_size_N, slice_tokens_N, unit_cost_N, n_ranks, budget, extra_slots=1,
         slot_cost=0.0):
    """Slot of every sample on its given rank (one slot for all slices of a split sample).

    Fills grids starting with M … M+extra_slots open slots, M the slots the token budget needs
    on the fullest rank, and keeps the least Σ heights + slots × ``slot_cost`` (a micro-batch's
    fixed cost on every rank; fewest slots on ties): a grid filled to the budget may have no
    room to even out slot costs, but a slot more costs its fixed cost. Returns slot_N, mb_tokens_RB,
    mb_cost_RB, n_slots. Requires slice_tokens_N <= budget (the split guarantees it).
    Deterministic: stable orders, lowest index on ties.
    """
    tokens_R = np.zeros(n_ranks, np.int64)
    for i in range(len(first_N)):
        for r in range(first_N[i], first_N[i] + sp_size_N[i]):
            tokens_R[r] += slice_tokens_N[i]
    m0 = -(-tokens_R.max() // budget) if n_ranks else 0
    best_sum = np.inf
    slot_N, tok_RB, cost_RB, n_open = (np.zeros(0, np.int64), np.zeros((n_ranks, 0), np.int64),
                                       np.zeros((n_ranks, 0), np.float64), 0)
    order = _fill_order(unit_cost_N, sp_size_N)  # sorted once for every fill
    for m in range(m0, m0 + extra_slots + 1):
        s_N, t_RB, c_RB, n_o = _fill(first_N, sp_size_N, slice_tokens_N, unit_cost_N, n_ranks,
                                     budget, m, order)
        total = 0.0
        for b in range(n_o):
            if t_RB[:, b].max() > 0:  # slots empty everywhere are dropped (_compact)
                total += c_RB[:, b].max() + slot_cost
        if total < best_sum * (1 - 1e-9):
            best_sum = total
            slot_N, tok_RB, cost_RB, n_open = s_N, t_RB, c_RB, n_o
    return _compact(slot_N, tok_RB, cost_RB, n_open)
