"""Grouped reordering: move the samples of a window of W global batches between its W steps.

The mixer fills each global batch with the right mixture but is blind to cost, so one batch may
draw several of the window's longest samples. Re-dealing the window's samples over its steps
spreads the heavy ones (so each step can be balanced over ranks) while every step keeps its
token count within ±ε of the window's mean and each source's token share within ±ε of the
window's share. A sample moves at most W-1 steps: the window is planned as a whole.

Shape suffixes: N samples of the window, S steps (W of them), C sources present in the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit


@dataclass(frozen=True)
class Reorder:
    step_N: np.ndarray  # int32: the step (0..W-1) each sample runs in
    tokens_S: np.ndarray  # int64: tokens per step
    token_target: float  # T: the window's tokens / W
    token_dev_S: np.ndarray  # float64: |tokens_S / T - 1|, to compare with ε
    source_dev_S: np.ndarray  # float64: max over sources of |share in step - share in window|
    load_S: np.ndarray  # float64: summed rank cost of each step


@njit(cache=True)
def _violation(tok, src_C, share_C, lo_tok, hi_tok, eps):
    """How far (in tokens) a step is outside its token and source-share bounds; 0 = inside."""
    v = max(0.0, tok - hi_tok) + max(0.0, lo_tok - tok)
    for c in range(len(share_C)):
        v += max(0.0, src_C[c] - (share_C[c] + eps) * tok)
        v += max(0.0, (share_C[c] - eps) * tok - src_C[c])
    return v


@njit(cache=True)
def _greedy(order_N, tokens_N, source_N, load_N, n_steps, n_sources, share_C, eps, target):
    """Heaviest first, each onto the least-loaded step whose token and source budgets fit it."""
    n = len(order_N)
    step_N = np.zeros(n, np.int32)
    tok_S = np.zeros(n_steps, np.float64)
    src_SC = np.zeros((n_steps, n_sources), np.float64)
    load_S = np.zeros(n_steps, np.float64)
    hi_tok = target * (1.0 + eps)
    # A source budget that still leaves the share within ε if the step ends at T(1-ε); a source
    # whose share + ε reaches 1 can never be over its share, so it has no budget.
    hi_src_C = np.empty(n_sources, np.float64)
    for c in range(n_sources):
        hi_src_C[c] = (np.inf if share_C[c] + eps >= 1.0
                       else (share_C[c] + eps) * target * (1.0 - eps))
    for o in range(n):
        i = order_N[o]
        t = tokens_N[i]
        c = source_N[i]
        best = -1
        for s in range(n_steps):
            if tok_S[s] + t <= hi_tok and src_SC[s, c] + t <= hi_src_C[c]:
                if best < 0 or load_S[s] < load_S[best]:
                    best = s
        if best < 0:  # no step has room: the one with the most token room
            best = 0
            for s in range(1, n_steps):
                if tok_S[s] < tok_S[best]:
                    best = s
        step_N[i] = best
        tok_S[best] += t
        src_SC[best, c] += t
        load_S[best] += load_N[i]
    return step_N, tok_S, src_SC, load_S


@njit(cache=True)
def _repair(step_N, tokens_N, source_N, load_N, tok_S, src_SC, load_S, share_C, eps, target,
            max_iters, max_evals):
    """Moves, then swaps, between steps while they shrink the total bound violation.

    Best-effort and bounded: a window whose bounds cannot all hold (one sample bigger than ε·T)
    keeps the best plan found. Every accepted change strictly lowers the total violation.
    """
    n = len(step_N)
    n_steps = len(tok_S)
    lo_tok = target * (1.0 - eps)
    hi_tok = target * (1.0 + eps)
    v_S = np.empty(n_steps, np.float64)
    tiny = 1e-9 * max(target, 1.0)
    evals = 0
    for _ in range(max_iters):
        for s in range(n_steps):
            v_S[s] = _violation(tok_S[s], src_SC[s], share_C, lo_tok, hi_tok, eps)
        a = np.argmax(v_S)
        if v_S[a] <= tiny or evals >= max_evals:
            return
        best_gain = tiny
        best_i = -1
        best_j = -1
        best_b = -1
        best_peak = np.inf
        # Moves of one sample into or out of the worst step. Among those that shrink the
        # violation, the one leaving the two steps' larger load smallest wins (then the larger
        # gain): small samples fix token deficits before heavy ones are pulled together.
        for i in range(n):
            t = tokens_N[i]
            c = source_N[i]
            src = step_N[i]
            if src == a:
                dsts = range(n_steps)
            else:
                dsts = range(a, a + 1)
            src_SC[src, c] -= t
            v_src = _violation(tok_S[src] - t, src_SC[src], share_C, lo_tok, hi_tok, eps)
            src_SC[src, c] += t
            for b in dsts:
                if b == src:
                    continue
                src_SC[b, c] += t
                v_dst = _violation(tok_S[b] + t, src_SC[b], share_C, lo_tok, hi_tok, eps)
                src_SC[b, c] -= t
                evals += 1
                gain = v_S[src] + v_S[b] - v_src - v_dst
                if gain <= tiny:
                    continue
                peak = max(load_S[src] - load_N[i], load_S[b] + load_N[i])
                if peak < best_peak or (peak == best_peak and gain > best_gain):
                    best_gain, best_i, best_b, best_peak = gain, i, b, peak
        # Swaps, only when no move helps: first improvement within the evaluation budget.
        if best_i < 0:
            for i in range(n):
                if step_N[i] != a or best_i >= 0 or evals >= max_evals:
                    continue
                ti = tokens_N[i]
                ci = source_N[i]
                for j in range(n):
                    b = step_N[j]
                    if b == a:
                        continue
                    tj = tokens_N[j]
                    cj = source_N[j]
                    if ti == tj and ci == cj:
                        continue
                    evals += 1
                    src_SC[a, ci] -= ti
                    src_SC[a, cj] += tj
                    va = _violation(tok_S[a] - ti + tj, src_SC[a], share_C, lo_tok, hi_tok, eps)
                    src_SC[a, ci] += ti
                    src_SC[a, cj] -= tj
                    src_SC[b, cj] -= tj
                    src_SC[b, ci] += ti
                    vb = _violation(tok_S[b] - tj + ti, src_SC[b], share_C, lo_tok, hi_tok, eps)
                    src_SC[b, cj] += tj
                    src_SC[b, ci] -= ti
                    if v_S[a] + v_S[b] - va - vb > tiny:
                        best_i, best_j, best_b = i, j, b
                        break
        if best_i < 0:
            return
        if best_j < 0:
            _move(best_i, step_N[best_i], best_b, step_N, tokens_N, source_N, load_N, tok_S,
                  src_SC, load_S)
        else:
            _move(best_i, a, best_b, step_N, tokens_N, source_N, load_N, tok_S, src_SC, load_S)
            _move(best_j, best_b, a, step_N, tokens_N, source_N, load_N, tok_S, src_SC, load_S)


@njit(cache=True)
def _move(i, src, dst, step_N, tokens_N, source_N, load_N, tok_S, src_SC, load_S):
    step_N[i] = dst
    tok_S[src] -= tokens_N[i]
    tok_S[dst] += tokens_N[i]
    src_SC[src, source_N[i]] -= tokens_N[i]
    src_SC[dst, source_N[i]] += tokens_N[i]
    load_S[src] -= load_N[i]
    load_S[dst] += load_N[i]


def _fill_empty_steps(step_N: np.ndarray, tokens_N: np.ndarray, n_steps: int) -> None:
    """No step may be left empty while another has two samples or more: an empty step idles
    every rank. When the token bounds cannot hold (a sample bigger than a step's share) the
    greedy pass can starve a step; give it the smallest sample of the fullest step."""
    while True:
        count_S = np.bincount(step_N, minlength=n_steps)
        empty = np.flatnonzero(count_S == 0)
        tokens_S = np.bincount(step_N, weights=tokens_N, minlength=n_steps)
        donors = np.flatnonzero(count_S >= 2)
        if not len(empty) or not len(donors):
            return
        donor = donors[np.argmax(tokens_S[donors])]
        mine = np.flatnonzero(step_N == donor)
        step_N[mine[np.argmin(tokens_N[mine])]] = empty[0]


def _dense(source_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct sources in order, each sample's index among them): np.unique with
    return_inverse, by counting when the ids are small integers (a window of half a million
    samples sorts in tens of milliseconds, counts in one)."""
    if len(source_N) and np.issubdtype(source_N.dtype, np.integer):
        lo, hi = int(source_N.min()), int(source_N.max())
        if hi - lo <= 4 * len(source_N) + 1024:
            present = np.bincount(source_N - lo, minlength=hi - lo + 1) > 0
            dense_of = np.cumsum(present) - 1
            return np.flatnonzero(present) + lo, dense_of[source_N - lo].astype(np.int64)
    sources_C, dense_N = np.unique(source_N, return_inverse=True)
    return sources_C, dense_N.astype(np.int64)


def reorder_window(tokens_N: np.ndarray, source_N: np.ndarray, batch_N: np.ndarray,
                   load_N: np.ndarray, unit_cost_N: np.ndarray, n_steps: int,
                   epsilon: float) -> Reorder:
    """Deal the window's samples over `n_steps` steps; deterministic for the same inputs.

    `load_N` is what a sample adds to its step's summed rank cost (k·unit cost for a sample
    split over k ranks); `unit_cost_N` is what it puts on each of its ranks and sets the order:
    heaviest units first, ties by sample index, so the largest are spread before small ones
    fill the gaps. Bounds that cannot all hold are met as closely as a bounded repair gets;
    the returned deviations say how close.
    """
    n = len(tokens_N)
    tokens_N = np.asarray(tokens_N, np.int64)
    sources_C, dense_N = _dense(np.asarray(source_N))
    total = float(tokens_N.sum())
    target = total / n_steps
    share_C = np.bincount(dense_N, weights=tokens_N, minlength=len(sources_C)) / max(total, 1.0)
    # heaviest first, ties by index: a stable sort of the negated costs
    order_N = np.argsort(-np.asarray(unit_cost_N, np.float64), kind="stable")
    load_N = np.asarray(load_N, np.float64)
    step_N, tok_S, src_SC, load_S = _greedy(order_N, tokens_N, dense_N, load_N, n_steps,
                                            len(sources_C), share_C, float(epsilon), target)
    if n_steps > 1:
        _repair(step_N, tokens_N, dense_N, load_N, tok_S, src_SC, load_S, share_C,
                float(epsilon), target, 2 * n + 64, 4_000_000)
    _fill_empty_steps(step_N, tokens_N, n_steps)
    displacement_N = np.abs(step_N - np.asarray(batch_N))
    assert n == 0 or displacement_N.max() <= n_steps - 1, "reorder left its window"
    tokens_S = np.bincount(step_N, weights=tokens_N, minlength=n_steps).astype(np.int64)
    n_sources = len(sources_C)
    src_SC = np.bincount(step_N.astype(np.int64) * n_sources + dense_N, weights=tokens_N,
                         minlength=n_steps * n_sources).reshape(n_steps, n_sources)
    with np.errstate(invalid="ignore", divide="ignore"):
        src_share_SC = np.where(tokens_S[:, None] > 0, src_SC / tokens_S[:, None], share_C)
    return Reorder(
        step_N=step_N,
        tokens_S=tokens_S,
        token_target=target,
        token_dev_S=np.abs(tokens_S / target - 1.0) if target > 0 else np.zeros(n_steps),
        source_dev_S=np.abs(src_share_SC - share_C).max(axis=1) if len(sources_C)
        else np.zeros(n_steps),
        load_S=np.bincount(step_N, weights=load_N, minlength=n_steps),
    )
