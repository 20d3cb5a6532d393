"""The tournament-tree versions of the greedy rules give exactly what the plain scans give.

The planner's LPT passes, its capped LPT, its local search and the SP-group placement find
ranks with tournament trees (``balancer.ranktree``) instead of scanning every rank per sample;
each is compared here with a plain-Python scan of the rule as documented (lowest index on
ties), on small random inputs full of ties, so that plans stay what they were.
"""

from __future__ import annotations

import numpy as np
import pytest

from omniscale.balancer import ranktree
from omniscale.balancer.assign import local_search, lpt, lpt_capped, place_sp_groups
from omniscale.balancer.baselines import _lpt, _pack

SEEDS = range(40)


def _costs(rng, n):
    """Costs with many exact ties (small integers) or none (lognormal), by seed."""
    return rng.integers(1, 5, n).astype(float) if rng.random() < 0.5 \
        else rng.lognormal(0.0, 1.5, n)


# -- oracles: the rules as plain scans ----------------------------------------------------
def lpt_scan(cost_N, order_N, load_R):
    rank_N = np.full(len(cost_N), -1)
    for i in order_N:
        best = min(range(len(load_R)), key=lambda r: (load_R[r], r))
        rank_N[i] = best
        load_R[best] += cost_N[i]
    return rank_N


def lpt_capped_scan(cost_N, tokens_N, order_N, load_R, tok_R, cap):
    rank_N = np.full(len(cost_N), -1)
    for i in order_N:
        room = [r for r in range(len(load_R)) if tok_R[r] + tokens_N[i] <= cap]
        best = min(room, key=lambda r: (load_R[r], r)) if room \
            else min(range(len(tok_R)), key=lambda r: (tok_R[r], r))
        rank_N[i] = best
        load_R[best] += cost_N[i]
        tok_R[best] += tokens_N[i]
    return rank_N


def local_search_scan(cost_N, rank_N, movable_N, load_R, max_iters, n_partners, tokens_N,
                      tok_R, cap):
    """The local search on equal ranks as documented: off the most loaded rank r (lowest
    index), the best move to the least loaded rank or swap with a sample of the n_partners
    least loaded, candidates in (load, rank) and index order, first of equals kept."""
    n_ranks = len(load_R)
    made = 0
    for _ in range(max_iters):
        r = max(range(n_ranks), key=lambda q: (load_R[q], -q))
        top = load_R[r]
        tiny = 1e-12 * max(abs(top), 1e-300)
        partners = [q for q in sorted(range(n_ranks), key=lambda q: (load_R[q], q))
                    if q != r][:n_partners]
        mine = [i for i in range(len(cost_N)) if rank_N[i] == r and movable_N[i]]
        best = (top, -1, -1, partners[0] if partners else -1)
        for i in mine if partners else []:
            q = partners[0]
            if cap >= 0 and tok_R[q] + tokens_N[i] > cap:
                continue
            new = max(top - cost_N[i], load_R[q] + cost_N[i])
            if new < best[0] - tiny:
                best = (new, i, -1, q)
        for j in range(len(cost_N)):
            q = rank_N[j]
            if not movable_N[j] or q not in partners:
                continue
            for i in mine:
                d = cost_N[i] - cost_N[j]
                if d <= 0 or (cap >= 0 and (tok_R[q] + tokens_N[i] - tokens_N[j] > cap
                                            or tok_R[r] + tokens_N[j] - tokens_N[i] > cap)):
                    continue
                new = max(top - d, load_R[q] + d)
                if new < best[0] - tiny:
                    best = (new, i, j, best[3])
        _, i, j, q = best
        if i < 0:
            break
        if j < 0:
            moved, back = cost_N[i], tokens_N[i]
            rank_N[i] = q
        else:
            q = rank_N[j]
            moved, back = cost_N[i] - cost_N[j], tokens_N[i] - tokens_N[j]
            rank_N[i], rank_N[j] = q, r
        load_R[r] -= moved
        load_R[q] += moved
        tok_R[r] -= back
        tok_R[q] += back
        made += 1
    return made


def place_sp_groups_scan(unit_N, k_N, order_N, load_R):
    first_N = np.full(len(unit_N), -1)
    for i in order_N:
        k = k_N[i]
        g = min(range(len(load_R) // k),
                key=lambda g: (max(load_R[g * k:(g + 1) * k]),
                               sum(load_R[g * k:(g + 1) * k].tolist()), g))
        first_N[i] = g * k
        load_R[g * k:(g + 1) * k] += unit_N[i]
    return first_N


# -- the comparisons ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_tree_primitives_match_argmin(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    value_R = rng.integers(0, 4, n).astype(float)
    key_P, win_V = ranktree.build(value_R)
    for _ in range(30):
        assert win_V[1] == int(np.argmin(value_R))  # lowest index among the least
        order = sorted(range(n), key=lambda r: (value_R[r], r))
        skip = int(rng.integers(-1, n))
        out = np.empty(4, np.int64)
        found = ranktree.smallest(key_P, win_V, 3, skip, out)
        assert out[:found].tolist() == [r for r in order if r != skip][:3]
        i = int(rng.integers(0, n))
        value_R[i] += float(rng.integers(-2, 3))
        ranktree.update(key_P, win_V, i, value_R[i])


@pytest.mark.parametrize("seed", SEEDS)
def test_lpt_and_capped_lpt_match_the_scans(seed):
    rng = np.random.default_rng(seed)
    n, dp = int(rng.integers(0, 120)), int(rng.integers(1, 40))
    cost_N = _costs(rng, n)
    tokens_N = rng.integers(1, 50, n)
    order_N = np.argsort(-cost_N, kind="stable")[:max(0, n - 3)]  # a few not in the order
    start_R = rng.integers(0, 3, dp).astype(float)
    load_R = start_R.copy()
    assert lpt(cost_N, order_N, load_R).tolist() == \
        lpt_scan(cost_N, order_N, start_R.copy()).tolist()
    assert _lpt(cost_N, order_N, dp).tolist() == \
        np.maximum(lpt_scan(cost_N, order_N, np.zeros(dp)), 0).tolist()
    cap = int(tokens_N.sum() / dp * rng.uniform(0.6, 1.3)) + 1
    tok0_R = rng.integers(0, 10, dp)
    load_R, tok_R = start_R.copy(), tok0_R.copy()
    got = lpt_capped(cost_N, tokens_N, order_N, load_R, tok_R, cap, np.ones(dp), True)
    want_load, want_tok = start_R.copy(), tok0_R.copy()
    want = lpt_capped_scan(cost_N, tokens_N, order_N, want_load, want_tok, cap)
    assert got.tolist() == want.tolist() and tok_R.tolist() == want_tok.tolist()
    assert load_R.tolist() == want_load.tolist()


@pytest.mark.parametrize("seed", SEEDS)
def test_local_search_matches_the_scan(seed):
    rng = np.random.default_rng(seed)
    n, dp = int(rng.integers(1, 90)), int(rng.integers(2, 25))
    cost_N = _costs(rng, n)
    tokens_N = rng.integers(1, 50, n)
    rank_N = rng.integers(0, max(1, dp // 3), n)  # a bad start: few ranks hold everything
    movable_N = rng.random(n) < 0.9
    load_R = np.bincount(rank_N, cost_N, minlength=dp).astype(float)
    tok_R = np.bincount(rank_N, tokens_N, minlength=dp).astype(np.int64)
    cap = -1 if seed % 2 else int(tokens_N.sum() / dp * 1.5) + 50
    want_rank, want_load, want_tok = rank_N.copy(), load_R.copy(), tok_R.copy()
    want = local_search_scan(cost_N, want_rank, movable_N, want_load, 2 * dp + 16, 4,
                             tokens_N, want_tok, cap)
    if cap < 0:
        got = local_search(cost_N, rank_N, movable_N, load_R, 2 * dp + 16, 4)
    else:
        got = local_search(cost_N, rank_N, movable_N, load_R, 2 * dp + 16, 4, tokens_N,
                           tok_R, cap)
        assert tok_R.tolist() == want_tok.tolist()
    assert got == want and rank_N.tolist() == want_rank.tolist()
    assert load_R.tolist() == want_load.tolist()


@pytest.mark.parametrize("seed", SEEDS)
def test_sp_group_placement_matches_the_scan(seed):
    rng = np.random.default_rng(seed)
    dp = int(rng.integers(2, 40))
    n = int(rng.integers(1, 30))
    sizes = [k for k in (2, 4, 8, 16) if k <= dp]
    k_N = rng.choice(sizes, n)
    unit_N = _costs(rng, n)
    order_N = np.lexsort((np.arange(n), -unit_N, -k_N))
    start_R = rng.integers(0, 3, dp).astype(float)
    load_R = start_R.copy()
    got = place_sp_groups(unit_N, k_N, order_N, load_R)
    want_load = start_R.copy()
    assert got.tolist() == place_sp_groups_scan(unit_N, k_N, order_N, want_load).tolist()
    assert load_R.tolist() == want_load.tolist()


def test_sp_group_sizes_must_be_powers_of_two_within_the_ranks():
    with pytest.raises(ValueError, match="powers of two"):
        place_sp_groups(np.ones(2), np.array([3, 2]), np.array([0, 1]), np.zeros(8))
    with pytest.raises(ValueError, match="powers of two"):
        place_sp_groups(np.ones(1), np.array([16]), np.array([0]), np.zeros(8))


def test_baseline_packing_grows_past_its_first_grid():
    """A group's new slot lies past every slot its ranks used, so a rank's last slot can
    exceed the most pieces any rank holds (the packer's first grid): here rank 3 holds three
    pieces but its last is slot 5 (consecutive packing, budget 1: a piece fills a slot)."""
    k_N = np.array([1, 1, 1, 4, 2, 2])
    first_N = np.array([0, 0, 0, 0, 2, 2])
    mb_N = _pack(np.ones(6, np.int64), first_N, k_N, np.arange(6), 8, 1, False)
    assert mb_N.tolist() == [0, 1, 2, 3, 4, 5]
