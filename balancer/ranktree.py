"""Tournament trees over ranks: the least-loaded rank in O(1), a change of load in O(log R).

The greedy rules of the planner and the baselines (LPT: each sample onto the least-loaded
rank, lowest index on ties) scanned every rank for every sample, O(N·R) a step: at 16,384
ranks × 8 samples that alone was a second. A tournament tree gives the same rank -- the
lowest index among the least loaded, because on equal keys the left child (lower indices)
wins -- after O(log R) work per change, so the greedy passes cost O(N log R) and their
results are exactly those of the scans they replace.

A tree over R keys is (key_P, win_V): ``key_P`` the keys padded with +inf to a power of two
P, ``win_V`` (2P entries, 1-based heap layout) the winning leaf of every node; the root
``win_V[1]`` is the arg-min. A max tree is a min tree of the negated keys (negation is exact,
so ties stay ties and the lowest index still wins).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def build(value_R):
    """(key_P, win_V) of a min tree over ``value_R`` (copied; at least one leaf)."""
    n = len(value_R)
    size = 1
    while size < n:
        size *= 2
    key_P = np.full(size, np.inf)
    key_P[:n] = value_R
    win_V = np.empty(2 * size, np.int64)
    for i in range(size):
        win_V[size + i] = i
    for v in range(size - 1, 0, -1):
        a, b = win_V[2 * v], win_V[2 * v + 1]
        win_V[v] = a if key_P[a] <= key_P[b] else b
    return key_P, win_V


@njit(cache=True)
def update(key_P, win_V, i, value):
    """Leaf ``i``'s key becomes ``value``; the winners on its path to the root follow."""
    key_P[i] = value
    v = (len(key_P) + i) >> 1
    while v >= 1:
        a, b = win_V[2 * v], win_V[2 * v + 1]
        win_V[v] = a if key_P[a] <= key_P[b] else b
        v >>= 1


@njit(cache=True)
def smallest(key_P, win_V, count, skip, out):
    """The ``count`` leaves with the least keys (ties: lowest index), in that order, leaving
    out leaf ``skip`` (-1: none), into ``out``; returns how many were found (fewer when the
    tree has fewer real leaves). The tree is as before on return."""
    found = 0
    popped = np.empty(count + 1, np.int64)
    saved = np.empty(count + 1, np.float64)
    n_popped = 0
    while found < count and n_popped < count + 1:
        q = win_V[1]
        if key_P[q] == np.inf:
            break
        popped[n_popped] = q
        saved[n_popped] = key_P[q]
        n_popped += 1
        update(key_P, win_V, q, np.inf)
        if q != skip:
            out[found] = q
            found += 1
    for p in range(n_popped - 1, -1, -1):
        update(key_P, win_V, popped[p], saved[p])
    return found


@njit(cache=True)
def least_within(load_key, load_win, tok_key, tok_win, limit):
    """The leaf of least load (ties: lowest index) among those whose token key is at most
    ``limit``, or -1 when none is: a descent that skips every subtree whose fewest tokens
    exceed the limit or whose least load cannot beat the best found."""
    best = -1
    stack = np.empty(64, np.int64)
    stack[0] = 1
    top = 1
    while top > 0:
        top -= 1
        v = stack[top]
        if tok_key[tok_win[v]] > limit:
            continue
        a = load_win[v]  # the least-loaded leaf of the subtree
        if best >= 0 and (load_key[a] > load_key[best]
                          or (load_key[a] == load_key[best] and a > best)):
            continue  # nothing under v beats best: its loads are >= a's, its indices >= a
        if tok_key[a] <= limit:
            best = a
            continue
        stack[top] = 2 * v + 1  # the left child (lower indices) is searched first
        stack[top + 1] = 2 * v
        top += 2
    return best


@njit(cache=True)
def build2(major_G, minor_G, size):
    """A min tree on (major, minor) pairs, compared in that order (ties: lowest index), over
    the first len(major_G) of ``size`` leaves (a power of two): (major_P, minor_P, win_V)."""
    major_P = np.full(size, np.inf)
    minor_P = np.full(size, np.inf)
    major_P[:len(major_G)] = major_G
    minor_P[:len(minor_G)] = minor_G
    win_V = np.empty(2 * size, np.int64)
    for i in range(size):
        win_V[size + i] = i
    for v in range(size - 1, 0, -1):
        win_V[v] = _winner2(major_P, minor_P, win_V[2 * v], win_V[2 * v + 1])
    return major_P, minor_P, win_V


@njit(cache=True)
def update2(major_P, minor_P, win_V, i, major, minor):
    """Leaf ``i`` of a pair tree becomes (major, minor); the winners above it follow."""
    major_P[i] = major
    minor_P[i] = minor
    v = (len(major_P) + i) >> 1
    while v >= 1:
        win_V[v] = _winner2(major_P, minor_P, win_V[2 * v], win_V[2 * v + 1])
        v >>= 1


@njit(cache=True)
def _winner2(major_P, minor_P, a, b):
    """a (the lower index) unless b's pair is strictly smaller."""
    if major_P[b] < major_P[a] or (major_P[b] == major_P[a] and minor_P[b] < minor_P[a]):
        return b
    return a
