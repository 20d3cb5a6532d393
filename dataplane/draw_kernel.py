"""The mixer's selection loop, compiled: which source each draw of a batch takes.

:meth:`dataplane.mixer.Mixer.next_batch` decides a batch's draws here from numbers alone
(the cumulative target and realized units, the weights, and per source the tokens and units
of its next servable samples), then has the catalog consume and build the refs a source's run
at a time. Per draw this is the arithmetic the mixer's docstring describes, float for float
(no fast-math: each product is rounded before it is added, as numpy's ``target += w * u`` is),
so the draws are bit-identical to picking one sample at a time in Python -- at about 27 µs a
sample that was most of a 4,096-rank plane's window.

The loop stops and hands back to Python whenever a draw needs what only Python has: a source
whose known samples ran out (``NEED``: it must be peeked -- into the next shard, or found
exhausted and retired), a position where the schedule's row may change (``MOVED``), the batch
full (``DONE``) or its token budget reached before the next sample (``FULL``).

Inside a linear ramp over tokens every draw moves the row. Stopping there after each draw cost
about 100 µs a sample (0.85 s for a batch of 8,192: a curriculum over tokens held a 4,096-rank
plane to under one step a second), so the loop computes the ramp's row itself
(:func:`ramp_row`, which the mixer uses for those rows too), with numpy's arithmetic: the
same interpolation, and :func:`pairwise_sum` adds as ``ndarray.sum`` does (numpy's pairwise
summation), so the rows are the ones ``Schedule.weights_over`` gives, bit for bit
(tests/dataplane/test_draw_kernel.py). It stops (``MOVED``) if the set of sources with a
positive weight would change.
"""

from __future__ import annotations

import numpy as np
from numba import njit

DONE, FULL, NEED, MOVED = 0, 1, 2, 3
FEW = 16  # up to this many live sources the pick is the scalar one, beyond it the array one


@njit(cache=True)
def pairwise_sum(a, lo, n):
    """``a[lo:lo + n].sum()`` as numpy adds a contiguous float64 run: one by one under 8
    values, eight running sums up to 128, the two halves' sums (split at a multiple of 8)
    beyond. numpy recurses; this walks the same tree with a stack (a recursive function
    loaded from numba's cache crashed the process)."""
    if n <= 128:
        return _block_sum(a, lo, n)
    stack_lo = np.empty(128, np.int64)  # nodes to visit: start, length, halves summed yet
    stack_n = np.empty(128, np.int64)
    stack_join = np.empty(128, np.bool_)
    sums = np.empty(128)  # the sums of visited subtrees, left below right
    top, done = 0, 0
    stack_lo[0], stack_n[0], stack_join[0] = lo, n, False
    while top >= 0:
        at, m, join = stack_lo[top], stack_n[top], stack_join[top]
        top -= 1
        if join:  # both halves summed: left + right, as numpy's return expression
            sums[done - 2] = sums[done - 2] + sums[done - 1]
            done -= 1
        elif m <= 128:
            sums[done] = _block_sum(a, at, m)
            done += 1
        else:
            half = m // 2
            half -= half % 8
            stack_lo[top + 1], stack_n[top + 1], stack_join[top + 1] = at, m, True
            stack_lo[top + 2], stack_n[top + 2], stack_join[top + 2] = at + half, m - half, False
            stack_lo[top + 3], stack_n[top + 3], stack_join[top + 3] = at, half, False
            top += 3  # the left half is visited first, then the right, then their join
    return sums[0]


@njit(cache=True)
def _block_sum(a, lo, n):
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    whole = n - n % 8
    while i < whole:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(cache=True)
def ramp_row(x, start, end, from_N, to_N, active_N, w_N):
    """Into ``w_N``: a linear segment's row at ``x`` (``from_N``/``to_N`` its normalised
    maps) renormalised, over the ``active_N`` sources renormalised again -- the mixer's
    weights, in ``Schedule.weights_over``'s and ``Mixer._weights_live``'s operations."""
    t = min(max((x - start) / (end - start), 0.0), 1.0)
    for j in range(len(w_N)):
        w_N[j] = from_N[j] + t * (to_N[j] - from_N[j])
    total = pairwise_sum(w_N, 0, len(w_N))
    for j in range(len(w_N)):
        w_N[j] = w_N[j] / total if active_N[j] else 0.0
    total = pairwise_sum(w_N, 0, len(w_N))
    if total > 0:
        for j in range(len(w_N)):
            w_N[j] = w_N[j] / total


@njit(cache=True)
def draw(target_N, realized_N, w_N, live_L, samples, values, llm_NK, unit_NK, pos_N, end_N,
         room, budget, drawn, batch_tokens, tokens, x_limit, picks_P, ramp, from_N, to_N,
         active_N):
    """Draw until a stop; returns (status, draws made, batch tokens, tokens, whether a pick
    was attempted, the source to peek for ``NEED``).

    ``target_N``/``realized_N``/``pos_N`` are updated in place and ``picks_P[:draws]`` gets
    the sources drawn. ``samples``: samples accounting (the unit is 1 and the bound 1).
    ``values``: ``llm_NK``/``unit_NK`` hold source i's next samples' tokens and units at
    ``pos_N[i]`` .. ``end_N[i]``; without them only how many (tokens count as 0). ``room``:
    draws left before the batch is full (-1: none counted); ``budget``: the batch's token
    budget (-1: none); ``drawn``: samples already in the batch; ``x_limit``: stop once
    ``tokens`` reaches it (the schedule's row may change there). ``ramp``: (start, end) of
    the linear segment over tokens in force, or an empty array: before each pick ``w_N``
    (then written) is that segment's row at ``tokens`` (:func:`ramp_row`).
    """
    n = 0
    attempted = False
    few = len(live_L) <= FEW
    choice = -1  # the source drawn last: after the first pick, the only one that can run out
    while True:
        if room >= 0 and n >= room:
            return DONE, n, batch_tokens, tokens, attempted, -1
        if tokens >= x_limit:
            return MOVED, n, batch_tokens, tokens, attempted, -1
        if len(ramp) and n:  # the row at the tokens drawn so far (the first is the caller's)
            ramp_row(float(tokens), ramp[0], ramp[1], from_N, to_N, active_N, w_N)
            if not _same_live(w_N, live_L):  # a source enters or leaves: the caller re-reads
                return MOVED, n, batch_tokens, tokens, attempted, -1
        # A pick begins: every live source must have its next sample known (peeked).
        attempted = True
        if choice < 0:
            for i in live_L:
                if pos_N[i] >= end_N[i]:
                    return NEED, n, batch_tokens, tokens, attempted, i
        elif pos_N[choice] >= end_N[choice]:
            return NEED, n, batch_tokens, tokens, attempted, choice
        bound = 1.0
        if not samples:
            top_u = 1
            for i in live_L:
                if unit_NK[i, pos_N[i]] > top_u:
                    top_u = unit_NK[i, pos_N[i]]
            bound = float(top_u)
        choice = _pick(target_N, realized_N, w_N, live_L, samples, bound, few)
        llm = llm_NK[choice, pos_N[choice]] if values else 0
        if budget >= 0 and drawn + n > 0 and batch_tokens + llm > budget:
            return FULL, n, batch_tokens, tokens, attempted, -1
        u = 1.0 if samples else float(unit_NK[choice, pos_N[choice]])
        pos_N[choice] += 1
        for j in range(len(target_N)):
            target_N[j] += w_N[j] * u
        realized_N[choice] += u
        tokens += llm
        batch_tokens += llm
        picks_P[n] = choice
        n += 1
        if budget >= 0 and batch_tokens >= budget:
            return DONE, n, batch_tokens, tokens, attempted, -1


@njit(cache=True)
def _same_live(w_N, live_L):
    """Whether the sources with a positive weight in ``w_N`` are exactly ``live_L``."""
    positive = 0
    for j in range(len(w_N)):
        if w_N[j] > 0:
            positive += 1
    if positive != len(live_L):
        return False
    for i in live_L:
        if not w_N[i] > 0:
            return False
    return True


@njit(cache=True)
def _pick(target_N, realized_N, w_N, live_L, samples, bound, few):
    """Earliest deadline among the sources whose deficit is not negative, else the largest
    deficit (the mixer's rule). ``few``: the scalar loop's tie and overflow behaviour, else
    numpy's ``argmin`` over ``where(ok, deadline, inf)`` (they differ only when every
    deadline overflows to inf)."""
    # A deficit a rounding error below 0 is 0: floats must not flip which sources qualify.
    floor = -1e-9 * bound
    best = np.inf
    best_k = -1
    top = -np.inf
    top_k = -1
    any_ok = False
    for k in range(len(live_L)):
        i = live_L[k]
        d = target_N[i] - realized_N[i]
        if samples:
            d = d + w_N[i]  # this draw's share of the target, counted before choosing
        if few:
            if d > top:
                top, top_k = d, k
        elif top_k < 0 or d > top or (np.isnan(d) and not np.isnan(top)):
            top, top_k = d, k  # np.argmax: the first maximum, a NaN before all
        ok = d >= floor
        any_ok = any_ok or ok
        if few:
            if ok:
                deadline = (bound - d) / w_N[i]
                if best_k < 0 or deadline < best:  # strict: the first of ties, the lowest id
                    best, best_k = deadline, k
        else:
            deadline = (bound - d) / w_N[i] if ok else np.inf
            if best_k < 0 or deadline < best or (np.isnan(deadline) and not np.isnan(best)):
                best, best_k = deadline, k  # np.argmin: the first minimum, a NaN before all
    if any_ok:
        return live_L[best_k]
    return live_L[top_k] if top_k >= 0 else live_L[0]
