"""Schedule math: each segment shape, normalisation, the tail, and invariants under hypothesis."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniscale.dataplane.schedule import Schedule, ScheduleError, Segment

AB = ("a", "b")


def one(kind, start=0, end=100, frm=None, to=None, at=None, unit="steps"):
    frm = frm or {"a": 3, "b": 1}
    to = to if to is not None else frm
    return Schedule(AB, (Segment(kind, start, end, frm, to, at),), unit)


def test_const_is_normalised_everywhere():
    s = one("const", end=None)
    for x in (0, 1, 10**9):
        assert s.weights_at(x) == {"a": 0.75, "b": 0.25}


def test_normalisation_ignores_scale_and_missing_sources():
    s = Schedule(("a", "b", "c"), (Segment("const", 0, None, {"a": 10.0}, {"a": 10.0}),))
    assert s.weights_at(5) == {"a": 1.0, "b": 0.0, "c": 0.0}


def test_linear_endpoints_and_exact_midpoint():
    s = one("linear", frm={"a": 3, "b": 1}, to={"a": 1, "b": 1})
    assert s.weights_at(0) == {"a": 0.75, "b": 0.25}
    assert s.weights_at(50) == {"a": 0.625, "b": 0.375}  # proportions move linearly
    assert s.weights_at(25)["a"] == pytest.approx(0.6875)
    assert s.weights_at(100) == {"a": 0.5, "b": 0.5}


def test_cosine_endpoints_midpoint_and_flat_ends():
    s = one("cosine", frm={"a": 1}, to={"b": 1})
    assert s.weights_at(0) == {"a": 1.0, "b": 0.0}
    assert s.weights_at(50)["a"] == pytest.approx(0.5, abs=1e-12)
    assert s.weights_at(100) == {"a": 0.0, "b": 1.0}
    # half a cosine is flatter near the ends than a line
    assert s.weights_at(10)["b"] < 0.1
    assert s.weights_at(10)["b"] == pytest.approx((1 - math.cos(math.pi * 0.1)) / 2)


def test_step_before_and_after_at():
    s = one("step", end=None, frm={"a": 1}, to={"b": 1}, at=40)
    assert s.weights_at(39.999) == {"a": 1.0, "b": 0.0}
    assert s.weights_at(40) == {"a": 0.0, "b": 1.0}
    assert s.weights_at(10**6) == {"a": 0.0, "b": 1.0}


def test_final_weights_hold_after_a_closed_last_segment():
    s = one("linear", frm={"a": 1}, to={"a": 1, "b": 3})
    assert s.weights_at(100) == s.weights_at(10**7) == {"a": 0.25, "b": 0.75}
    assert s.end == 100


def test_unit_tokens_counts_tokens():
    s = one("linear", start=0, end=2e9, frm={"a": 1}, to={"b": 1}, unit="tokens")
    assert s.unit == "tokens"
    assert s.weights_at(1e9) == {"a": 0.5, "b": 0.5}


def test_multi_segment_boundaries_and_continuity_at_joins():
    segs = (Segment("const", 0, 100, {"a": 3, "b": 1}, {"a": 3, "b": 1}),
            Segment("linear", 100, 400, {"a": 3, "b": 1}, {"a": 1, "b": 1}),
            Segment("step", 400, None, {"a": 1, "b": 1}, {"b": 1}, at=500))
    s = Schedule(AB, segs)
    assert s.boundaries == (0.0, 100.0, 400.0)
    assert s.end is None
    assert s.weights_at(99.9999) == pytest.approx(s.weights_at(100))
    assert s.weights_at(250) == {"a": 0.625, "b": 0.375}
    assert s.weights_at(499) == {"a": 0.5, "b": 0.5}
    assert s.weights_at(500) == {"a": 0.0, "b": 1.0}


def test_weights_over_matches_weights_at():
    segs = (Segment("cosine", 0, 10, {"a": 1}, {"b": 1}),
            Segment("linear", 10, 20, {"b": 1}, {"a": 2, "b": 1}))
    s = Schedule(AB, segs)
    xs = np.linspace(-1, 30, 77)
    out = s.weights_over(xs)
    assert out.shape == (77, 2)
    for x, row in zip(xs, out):
        assert list(s.weights_at(x).values()) == pytest.approx(row.tolist())


def test_constant_constructor():
    s = Schedule.constant({"a": 1, "b": 0})
    assert s.weights_at(123) == {"a": 1.0, "b": 0.0}


@pytest.mark.parametrize("segments, path", [
    ((), "segments"),
    ((Segment("const", 5, None, {"a": 1}, {"a": 1}),), "segments[0].start"),
    ((Segment("const", 0, 10, {"a": -1, "b": 1}, {"a": -1, "b": 1}),), "segments[0].weights.a"),
    ((Segment("const", 0, 10, {"a": 0}, {"a": 0}),), "segments[0].weights"),
    ((Segment("linear", 0, 10, {"a": 1}, {"zz": 1}),), "segments[0].to.zz"),
    ((Segment("linear", 0, None, {"a": 1}, {"b": 1}),), "segments[0].end"),
    ((Segment("step", 0, 10, {"a": 1}, {"b": 1}, at=10),), "segments[0].at"),
    ((Segment("const", 0, 10, {"a": 1}, {"a": 1}, at=3),), "segments[0].at"),
    ((Segment("const", 0, 10, {"a": 1}, {"a": 1}),
      Segment("const", 8, 20, {"a": 1}, {"a": 1})), "segments[1].start"),
])
def test_invalid_schedules_name_the_field(segments, path):
    with pytest.raises(ScheduleError) as e:
        Schedule(AB, segments)
    assert e.value.path == path


# --- properties ------------------------------------------------------------------------------

weight_maps = st.dictionaries(st.sampled_from(("a", "b", "c")),
                              st.floats(0, 1e6, allow_nan=False), min_size=1).filter(
    lambda m: any(v > 0 for v in m.values()))


@st.composite
def schedules(draw):
    n = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.floats(0.5, 1e4), min_size=n, max_size=n))
    open_end = draw(st.booleans())
    segs, start = [], 0.0
    for i, length in enumerate(lengths):
        kind = draw(st.sampled_from(("const", "linear", "cosine", "step")))
        last = i == n - 1
        end = None if (last and open_end and kind in ("const", "step")) else start + length
        frm, to = draw(weight_maps), draw(weight_maps)
        if kind == "const":
            to = frm
        at = None
        if kind == "step":
            hi = start + length if end is None else end
            at = draw(st.floats(start, hi, exclude_max=True))
        segs.append(Segment(kind, start, end, frm, to, at))
        start = start + length
    return Schedule(("a", "b", "c"), tuple(segs))


@settings(max_examples=150, deadline=None)
@given(schedules(), st.lists(st.floats(-10, 1e5), min_size=1, max_size=20))
def test_weights_are_finite_nonnegative_and_sum_to_one(schedule, xs):
    w = schedule.weights_over(np.array(xs))
    assert np.isfinite(w).all()
    assert (w >= 0).all()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-12)


@settings(max_examples=150, deadline=None)
@given(schedules(), st.floats(0, 1), st.floats(1e-6, 1e-3))
def test_ramps_are_continuous(schedule, where, eps):
    for seg in schedule.segments:
        if seg.kind not in ("linear", "cosine"):
            continue
        span = seg.end - seg.start
        x = seg.start + where * span * (1 - 2 * eps)  # x and x + eps * span inside
        w0, w1 = schedule.weights_over(np.array([x, x + eps * span]))
        # |dw/dt| <= pi/2 per unit of t for a cosine (1 for a line), and |to - from| <= 1
        assert np.abs(w1 - w0).max() <= math.pi / 2 * eps + 1e-9
