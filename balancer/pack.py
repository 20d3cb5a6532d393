"""Packing: each rank's samples into micro-batches under a hard token budget, slots aligned.

The budget bounds activation memory, so it is never exceeded. Every rank runs the same number
of micro-batches (FSDP gathers parameters per micro-batch, so all ranks must issue the same
collectives; a rank with fewer real ones runs empty slots). The slices of a split sample run in
the same slot on all k ranks of its group, since the Ulysses all-to-alls pair them. Because
ranks wait for each other at every micro-batch, the step time is Σ_slots max_ranks(slot cost),
not the max of the per-rank sums; slots are ordered so heavy micro-batches run together.

Shape suffixes: N samples of the step, R ranks, B micro-batch slots.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _slot_capacity(first_N, sp_size_N, n_ranks):
    """Slots that are sure to suffice. A whole sample finds room among its rank's
    placements + 1 slots; a group of k among the slots used on its k ranks + 1, at most
    k × (placements on the busiest rank)."""
    count_R = np.zeros(n_ranks, np.int64)
    k_max = 1
    for i in range(len(first_N)):
        k_max = max(k_max, sp_size_N[i])
        for r in range(first_N[i], first_N[i] + sp_size_N[i]):
            count_R[r] += 1
    busiest = count_R.max() if n_ranks else 0
    return max(1, min(len(first_N), k_max * busiest))


@njit(cache=True)
def pack(first_N, sp_size_N, slice_tokens_N, unit_cost_N, n_ranks, budget):
    """Slot of every sample (one slot for all slices of a split sample), and the grid.

    Split samples first (costliest slice first), each into the lowest slot free on all ranks of
    its group; then whole samples first-fit decreasing by tokens on their rank. Finally each
    rank's unpinned micro-batches (those without an SP slice) are sorted by cost, heaviest
    first, into that rank's unpinned positions, so that slot b holds similarly heavy work on
    every rank. Returns slot_N, mb_tokens_RB, mb_cost_RB, n_slots.
    Requires slice_tokens_N <= budget (the split guarantees it).
    """
    n = len(first_N)
    cap = _slot_capacity(first_N, sp_size_N, n_ranks)
    tok_RB = np.zeros((n_ranks, cap), np.int64)
    cost_RB = np.zeros((n_ranks, cap), np.float64)
    pinned_RB = np.zeros((n_ranks, cap), np.bool_)
    slot_N = np.full(n, -1, np.int64)
    # Split samples: costliest slice first (ties by index), so the heaviest slices share the
    # lowest slots wherever their groups do not collide.
    cost_key = np.empty(n, np.float64)
    for i in range(n):
        cost_key[i] = -unit_cost_N[i] if sp_size_N[i] > 1 else np.inf
    order = np.argsort(cost_key, kind="mergesort")
    for o in range(n):
        i = order[o]
        if sp_size_N[i] == 1:
            break
        t = slice_tokens_N[i]
        a = first_N[i]
        b = 0
        while True:
            ok = True
            for r in range(a, a + sp_size_N[i]):
                if tok_RB[r, b] + t > budget:
                    ok = False
                    break
            if ok:
                break
            b += 1
        slot_N[i] = b
        for r in range(a, a + sp_size_N[i]):
            tok_RB[r, b] += t
            cost_RB[r, b] += unit_cost_N[i]
            pinned_RB[r, b] = True
    # Whole samples: first fit decreasing by tokens, ties by index.
    key = np.empty(n, np.int64)
    for i in range(n):
        key[i] = -slice_tokens_N[i] if sp_size_N[i] == 1 else 1
    order = np.argsort(key, kind="mergesort")
    for o in range(n):
        i = order[o]
        if sp_size_N[i] > 1:
            break
        r = first_N[i]
        t = slice_tokens_N[i]
        b = 0
        while tok_RB[r, b] + t > budget:
            b += 1
        slot_N[i] = b
        tok_RB[r, b] += t
        cost_RB[r, b] += unit_cost_N[i]
    # Align: per rank, unpinned micro-batches heaviest first into the unpinned positions.
    new_slot_RB = np.empty((n_ranks, cap), np.int64)
    out_tok_RB = np.zeros((n_ranks, cap), np.int64)
    out_cost_RB = np.zeros((n_ranks, cap), np.float64)
    n_slots = 0
    for r in range(n_ranks):
        free = np.empty(cap, np.int64)
        n_free = 0
        for b in range(cap):
            if pinned_RB[r, b]:
                new_slot_RB[r, b] = b
            else:
                free[n_free] = b
                n_free += 1
        free = free[:n_free]
        by_cost = free[np.argsort(-cost_RB[r, free], kind="mergesort")]
        for m in range(n_free):
            new_slot_RB[r, by_cost[m]] = free[m]
        for b in range(cap):
            nb = new_slot_RB[r, b]
            out_tok_RB[r, nb] = tok_RB[r, b]
            out_cost_RB[r, nb] = cost_RB[r, b]
            if tok_RB[r, b] > 0:
                n_slots = max(n_slots, nb + 1)
    for i in range(n):
        if sp_size_N[i] == 1:
            slot_N[i] = new_slot_RB[first_N[i], slot_N[i]]
    return slot_N, out_tok_RB[:, :n_slots].copy(), out_cost_RB[:, :n_slots].copy(), n_slots
