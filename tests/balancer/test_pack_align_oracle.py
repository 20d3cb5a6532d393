"""The alignment search (``pack.align_search``) skips candidates that cannot win; it must choose
exactly what the plain scan of every move and swap chooses (the first candidate, in scan order,
with the largest gain). The oracle here is that scan written out in Python from the rule in
align_search's docstring, compared on random grids: integer costs (many equal gains, so ties
decide) and real ones."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniscale.balancer.pack import align_search


def _height(cost_RB, b):
    top, second, arg = -np.inf, -np.inf, -1
    for r in range(cost_RB.shape[0]):
        v = cost_RB[r, b]
        if v > top:
            second, top, arg = top, v, r
        elif v > second:
            second = v
    return top, second, arg


def _relocate(i, r, src, dst, slot_N, tokens_N, unit_N, tok_RB, cost_RB):
    slot_N[i] = dst
    tok_RB[r, src] -= tokens_N[i]
    cost_RB[r, src] -= unit_N[i]
    tok_RB[r, dst] += tokens_N[i]
    cost_RB[r, dst] += unit_N[i]


def scan_every_candidate(slot_N, rank_N, tokens_N, unit_N, tok_RB, cost_RB, n_slots, budget,
                         max_passes):
    """Every slot's tallest rank r: every move of one of r's samples in the slot to another of
    r's slots and every swap with a cheaper one of r's, the best by net drop of Σ heights."""
    members = {r: [i for i in range(len(rank_N)) if rank_N[i] == r]
               for r in range(cost_RB.shape[0])}
    height_B = [_height(cost_RB, b)[0] for b in range(n_slots)]
    made = 0
    for _ in range(max_passes):
        improved = False
        for b in range(n_slots):
            top, second, r = _height(cost_RB, b)
            if r < 0 or top <= second:
                continue
            best = (1e-12 * max(abs(top), 1e-300), -1, -1, -1)
            for i in members[r]:
                if slot_N[i] != b:
                    continue
                ci, ti = unit_N[i], tokens_N[i]
                for d in range(n_slots):
                    if d != b and tok_RB[r, d] + ti <= budget:
                        gain = top - max(second, top - ci) \
                            - max(0.0, cost_RB[r, d] + ci - height_B[d])
                        if gain > best[0]:
                            best = (gain, i, -1, d)
                for j in members[r]:
                    d = slot_N[j]
                    if d == b or unit_N[j] >= ci:
                        continue
                    tj = tokens_N[j]
                    if tok_RB[r, b] - ti + tj > budget or tok_RB[r, d] - tj + ti > budget:
                        continue
                    delta = ci - unit_N[j]
                    gain = top - max(second, top - delta) \
                        - max(0.0, cost_RB[r, d] + delta - height_B[d])
                    if gain > best[0]:
                        best = (gain, i, j, d)
            _, i, j, d = best
            if i < 0:
                continue
            _relocate(i, r, b, d, slot_N, tokens_N, unit_N, tok_RB, cost_RB)
            if j >= 0:
                _relocate(j, r, d, b, slot_N, tokens_N, unit_N, tok_RB, cost_RB)
            for s in (b, d):
                height_B[s] = _height(cost_RB, s)[0]
            made += 1
            improved = True
        if not improved:
            break
    return made


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(1, 6), st.integers(1, 40),
       st.booleans())
def test_the_search_chooses_what_the_full_scan_chooses(seed, dp, n_slots, n, integer_costs):
    rng = np.random.default_rng(seed)
    budget = 100
    rank_N = rng.integers(0, dp, n)
    tokens_N = rng.integers(1, 30, n)
    unit_N = rng.integers(1, 8, n).astype(float) if integer_costs else rng.lognormal(0, 1, n)
    slot_N = rng.integers(0, n_slots, n)
    tok_RB = np.zeros((dp, n_slots), np.int64)
    cost_RB = np.zeros((dp, n_slots))
    for i in range(n):  # in index order, as the oracle's own additions would round
        tok_RB[rank_N[i], slot_N[i]] += tokens_N[i]
        cost_RB[rank_N[i], slot_N[i]] += unit_N[i]
    if tok_RB.max() > budget:
        return  # not a placement the fill makes
    ours = slot_N.copy(), tok_RB.copy(), cost_RB.copy()
    made = align_search(ours[0], rank_N, np.ones(n, np.bool_), tokens_N, unit_N, ours[1],
                        ours[2], n_slots, budget, 64)
    want = slot_N.copy(), tok_RB.copy(), cost_RB.copy()
    assert made == scan_every_candidate(want[0], rank_N, tokens_N, unit_N, want[1], want[2],
                                        n_slots, budget, 64)
    np.testing.assert_array_equal(ours[0], want[0])
    np.testing.assert_array_equal(ours[1], want[1])
    np.testing.assert_array_equal(ours[2], want[2])
