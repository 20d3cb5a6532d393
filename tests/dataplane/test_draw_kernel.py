"""The draw kernel's ramp over tokens: its rows are numpy's, bit for bit, a batch inside a
ramp is drawn in a few stops, not one per sample, and a source entering mid-ramp stops it.

Oracles: ``ndarray.sum`` for the kernel's summation; ``Schedule.weights_over`` masked and
renormalised the way the mixer did before the kernel moved ramps itself (written out here) for
its rows; the per-sample reference of tests/dataplane/test_bulk_draw.py (tokens schedules with
a linear segment) covers the draws themselves."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from omniscale.dataplane import mixer as mixer_module
from omniscale.dataplane.catalog import Catalog, SourceState
from omniscale.dataplane.draw_kernel import pairwise_sum, ramp_row
from omniscale.dataplane.mixer import Mixer
from omniscale.dataplane.schedule import Schedule, Segment
from tests.dataplane.plane_index import random_source


@pytest.mark.parametrize("n", [1, 7, 8, 9, 127, 128, 129, 136, 255, 256, 1000, 1031, 4099])
def test_pairwise_sum_is_numpys_sum_bit_for_bit(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        a = rng.random(n) * 10.0 ** rng.uniform(-6, 6, n)
        a[rng.random(n) < 0.3] = 0.0
        lo = int(rng.integers(0, 4))
        padded = np.concatenate([rng.random(lo), a, rng.random(3)])
        assert pairwise_sum(padded, lo, n) == a.sum()


def _row_as_before(schedule: Schedule, x: float, active_N: np.ndarray) -> np.ndarray:
    """The mixer's row before ramps moved into the kernel: the schedule's weights at ``x``,
    the inactive sources zeroed, renormalised."""
    w_N = schedule.weights_over(np.array([x], dtype=np.float64))[0]
    w_N = np.where(active_N, w_N, 0.0)
    total = w_N.sum()
    return w_N / total if total > 0 else w_N


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       span=st.floats(1.0, 1e12), where=st.floats(0.0, 1.0))
def test_ramp_rows_are_the_schedules_rows_bit_for_bit(n, seed, span, where):
    rng = np.random.default_rng(seed)
    names = tuple(f"s{i}" for i in range(n))
    w_from = {s: float(v) for s, v in zip(names, rng.choice([0.0, 0.5, 1.0, 3.0, 7.25], n))}
    w_to = {s: float(v) for s, v in zip(names, rng.choice([0.0, 0.5, 1.0, 3.0, 7.25], n))}
    w_from[names[0]] = w_to[names[-1]] = 1.0  # every map has a positive weight
    start = float(rng.integers(0, 10_000))
    schedule = Schedule(names, (Segment("const", 0, start, w_from, w_from),
                                Segment("linear", start, start + span, w_from, w_to),
                                Segment("const", start + span, None, w_to, w_to)), "tokens")
    active_N = rng.random(n) < 0.8
    x = start + where * span
    assume(start < x < start + span)  # where the kernel moves the row itself
    got_N = np.empty(n)
    ramp_row(x, start, start + span, *schedule.maps(1), active_N, got_N)
    assert np.array_equal(got_N, _row_as_before(schedule, x, active_N))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("ramp")
    return {name: random_source(root / name, seed, 4, 2000, 300)
            for seed, name in enumerate("abc")}


def test_a_batch_inside_a_ramp_over_tokens_is_drawn_in_a_few_stops(sources, monkeypatch):
    """A linear segment over tokens moves the row at every draw; before, the kernel stopped
    after each draw for Python to re-read it (a batch of N samples took N calls). The draws
    are those of the per-sample reference (test_bulk_draw.py); here, how many calls."""
    w0, w1 = {"a": 1, "b": 1, "c": 0}, {"a": 0, "b": 2, "c": 5}
    schedule = Schedule(("a", "b", "c"), (Segment("linear", 0, 2 * 10**6, w0, w1),
                                          Segment("const", 2 * 10**6, None, w1, w1)), "tokens")
    catalog = Catalog(3, [SourceState(n, i, sources[n], 3, "next_epoch")
                          for i, n in enumerate("abc")])
    mixer = Mixer(catalog, schedule, "tokens", global_batch_samples=2048)
    mixer.next_batch(0)  # the first draw sits on the ramp's start: the row there is read alone
    calls = []

    def counted(*args):
        calls.append(1)
        return draw(*args)

    draw = mixer_module.draw
    monkeypatch.setattr(mixer_module, "draw", counted)
    batch = mixer.next_batch(1)
    assert len(batch) == 2048 and {r.source for r in batch} == {"a", "b", "c"}
    assert 0 < mixer.tokens < 2 * 10**6  # all of it inside the ramp
    # a call per shard a source crosses (peeks), none per sample
    assert len(calls) < 40, len(calls)


def _draw_inside_a_ramp(to_N: np.ndarray):
    """The kernel alone, hand-set: two sources, source 1 weighted 0 at the ramp's start (so not
    live for the caller), 10 tokens a sample, a linear ramp over tokens 0..100 from (1, 0) to
    ``to_N``, five samples of each known."""
    from omniscale.dataplane.draw_kernel import draw

    picks_P = np.zeros(16, np.int64)
    got = draw(np.zeros(2), np.zeros(2), np.array([1.0, 0.0]), np.array([0], np.int64), True,
               True, np.full((2, 8), 10, np.int64), np.ones((2, 8), np.int64),
               np.zeros(2, np.int64), np.array([5, 5], np.int64), 16, -1, 0, 0, 0, 1e9,
               picks_P, np.array([0.0, 100.0]), np.array([1.0, 0.0]), to_N,
               np.array([True, True]))
    return got, picks_P


def test_a_source_entering_inside_a_ramp_stops_the_kernel_for_the_caller():
    """The ``MOVED`` safety net: once the row gives a source outside the caller's live set a
    weight (here after the first draw, at 10 tokens: t = 0.1, weights 0.95 / 0.05), the kernel
    returns for the caller to re-read which sources are live, having drawn only from the old
    set. Beside it, the same ramp keeping source 1 at 0 draws on until source 0's known
    samples run out (``NEED`` for source 0 after 5 draws)."""
    from omniscale.dataplane.draw_kernel import MOVED, NEED

    (status, n, batch_tokens, tokens, attempted, need), picks_P = \
        _draw_inside_a_ramp(np.array([0.5, 0.5]))
    assert (status, n, tokens, list(picks_P[:n])) == (MOVED, 1, 10, [0])
    (status, n, batch_tokens, tokens, attempted, need), picks_P = \
        _draw_inside_a_ramp(np.array([1.0, 0.0]))
    assert (status, n, tokens, need, list(picks_P[:n])) == (NEED, 5, 50, 0, [0] * 5)
