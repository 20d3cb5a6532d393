"""Mixture schedules: each source's share of the data as a function of training progress.

A schedule is a list of segments over ``steps`` or ``tokens`` (its ``unit``). Every segment
holds two weight maps, ``from`` and ``to`` (a ``const`` segment has one map, used as both),
and a shape that moves from one to the other:

- ``const``: ``from`` throughout;
- ``linear``: ``from + (to - from) * t`` with ``t = (x - start) / (end - start)``;
- ``cosine``: ``from + (to - from) * (1 - cos(pi * t)) / 2`` (half a cosine: flat at both ends);
- ``step``: ``from`` before ``at``, ``to`` from ``at`` on.

Weight maps are normalised to sum to 1 *before* interpolating, so the proportions themselves
follow the shape (a linear segment from 75/25 to 50/50 passes 62.5/37.5 at its midpoint) and
every point is a convex combination of two distributions. After a closed last segment its
final weights hold.

Pure computation, no I/O: the spec loader (``dataplane.spec``) builds schedules from YAML and
turns :class:`ScheduleError` into a one-line user error; the mixer and plots evaluate them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping

import numpy as np

Kind = Literal["const", "linear", "cosine", "step"]
Unit = Literal["steps", "tokens"]
KINDS: tuple[str, ...] = ("const", "linear", "cosine", "step")
UNITS: tuple[str, ...] = ("steps", "tokens")


class ScheduleError(ValueError):
    """An invalid schedule. ``path`` is the field relative to the schedule, e.g.
    ``segments[2].weights.web_text``; the spec loader prefixes the file and ``schedule.``."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True)
class Segment:
    """One piece of a schedule over ``[start, end)``; ``end=None`` means open-ended.

    ``weights_from`` / ``weights_to`` are relative (un-normalised) maps from source name to
    weight; a source absent from a map has weight 0 there. For ``const`` pass one map as both.
    """

    kind: Kind
    start: float
    end: float | None
    weights_from: Mapping[str, float]
    weights_to: Mapping[str, float]
    at: float | None = None

    def map_name(self, which: str) -> str:
        """The map's key in the spec: ``weights`` for const, ``from`` / ``to`` otherwise."""
        return "weights" if self.kind == "const" else which


@dataclass(frozen=True)
class Schedule:
    """A validated list of segments over named sources; evaluate with :meth:`weights_at`.

    Construction checks every rule of docs/mixing-spec.md that concerns the schedule and raises
    :class:`ScheduleError` naming the first offending field.
    """

    sources: tuple[str, ...]
    segments: tuple[Segment, ...]
    unit: Unit = "steps"
    # Per-segment arrays for vectorised evaluation (S segments, N sources).
    _start_S: np.ndarray = field(init=False, repr=False, compare=False)
    _end_S: np.ndarray = field(init=False, repr=False, compare=False)
    _at_S: np.ndarray = field(init=False, repr=False, compare=False)
    _from_SN: np.ndarray = field(init=False, repr=False, compare=False)
    _to_SN: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "segments", tuple(self.segments))
        self._check()
        set_ = object.__setattr__
        segs = self.segments
        set_(self, "_start_S", np.array([s.start for s in segs], dtype=np.float64))
        set_(self, "_end_S", np.array([math.inf if s.end is None else s.end for s in segs]))
        set_(self, "_at_S", np.array([math.nan if s.at is None else s.at for s in segs]))
        set_(self, "_from_SN", np.stack([self._normalised(s.weights_from) for s in segs]))
        set_(self, "_to_SN", np.stack([self._normalised(s.weights_to) for s in segs]))
        for a in (self._start_S, self._end_S, self._at_S, self._from_SN, self._to_SN):
            a.flags.writeable = False

    @classmethod
    def constant(cls, weights: Mapping[str, float], unit: Unit = "steps") -> "Schedule":
        """One open-ended ``const`` segment: what per-source ``weight:`` keys mean."""
        seg = Segment("const", 0.0, None, dict(weights), dict(weights))
        return cls(tuple(weights), (seg,), unit)

    @property
    def boundaries(self) -> tuple[float, ...]:
        """Segment starts, in order: where the data plane may align a change of mixture with
        a planning window. (Within a ``step`` segment the jump happens at its ``at``.)"""
        return tuple(float(s.start) for s in self.segments)

    @property
    def end(self) -> float | None:
        """Where the last segment ends (its final weights hold after), or None if open."""
        return self.segments[-1].end

    def weights_at(self, x: float) -> dict[str, float]:
        """Normalised weights (summing to 1) at ``x`` steps or tokens, per ``unit``."""
        row = self.weights_over(np.array([x], dtype=np.float64))[0]
        return {name: float(w) for name, w in zip(self.sources, row)}

    def maps(self, segment: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment ``segment``'s weight maps, each normalised to sum to 1, over
        :attr:`sources` (read-only): where it starts from and where it goes."""
        return self._from_SN[segment], self._to_SN[segment]

    def weights_over(self, xs: np.ndarray) -> np.ndarray:
        """Weights at every ``x`` in ``xs``: an array ``[len(xs), len(sources)]``, rows sum to 1.

        Points before 0 take the first segment's starting weights.
        """
        x_X = np.asarray(xs, dtype=np.float64).reshape(-1)
        seg_X = np.clip(np.searchsorted(self._start_S, x_X, side="right") - 1, 0, None)
        start, end, at = self._start_S[seg_X], self._end_S[seg_X], self._at_S[seg_X]
        with np.errstate(invalid="ignore", divide="ignore"):
            t_X = np.where(np.isfinite(end), (x_X - start) / (end - start), 0.0)
        t_X = np.clip(t_X, 0.0, 1.0)
        kinds = np.array([s.kind for s in self.segments])[seg_X]
        frac_X = np.select(
            [kinds == "linear", kinds == "cosine", kinds == "step"],
            [t_X, (1.0 - np.cos(np.pi * t_X)) / 2.0, (x_X >= at).astype(np.float64)],
            default=0.0)
        w_XN = self._from_SN[seg_X] + frac_X[:, None] * (self._to_SN[seg_X] - self._from_SN[seg_X])
        # Convex combinations of distributions already sum to 1 up to rounding; make it exact
        # enough that consumers can rely on it without re-normalising.
        return w_XN / w_XN.sum(axis=1, keepdims=True)

    def _normalised(self, weights: Mapping[str, float]) -> np.ndarray:
        w_N = np.array([float(weights.get(name, 0.0)) for name in self.sources])
        return w_N / w_N.sum()

    def _check(self) -> None:
        if self.unit not in UNITS:
            raise ScheduleError("unit", f"unknown unit {self.unit!r} (expected steps or tokens)")
        if not self.sources:
            raise ScheduleError("sources", "no sources to weigh")
        if not self.segments:
            raise ScheduleError("segments", "must hold at least one segment")
        for i, seg in enumerate(self.segments):
            self._check_segment(i, seg)

    def _check_segment(self, i: int, seg: Segment) -> None:
        here = f"segments[{i}]"
        last = i == len(self.segments) - 1
        if seg.kind not in KINDS:
            raise ScheduleError(f"{here}.kind", f"unknown kind {seg.kind!r} "
                                "(expected const, linear, cosine or step)")
        _check_number(f"{here}.start", seg.start)
        if i == 0 and seg.start != 0:
            raise ScheduleError(f"{here}.start", f"the first segment must start at 0, "
                                f"got {_fmt(seg.start)}")
        if i > 0:
            prev = self.segments[i - 1]
            if seg.start < prev.start:
                raise ScheduleError(f"{here}.start", f"segments out of order: starts at "
                                    f"{_fmt(seg.start)}, before segments[{i - 1}] "
                                    f"(starts at {_fmt(prev.start)})")
            if seg.start < prev.end:
                raise ScheduleError(f"{here}.start", f"overlaps segments[{i - 1}], which ends "
                                    f"at {_fmt(prev.end)}")
            if seg.start > prev.end:
                raise ScheduleError(f"{here}.start", f"gap after segments[{i - 1}], which ends "
                                    f"at {_fmt(prev.end)}")
        if seg.end is None:
            if not last:
                raise ScheduleError(f"{here}.end", "only the last segment may be open-ended "
                                    "(end: null)")
            if seg.kind in ("linear", "cosine"):
                raise ScheduleError(f"{here}.end", f"a {seg.kind} segment needs an end")
        else:
            _check_number(f"{here}.end", seg.end)
            if seg.end <= seg.start:
                raise ScheduleError(f"{here}.end", f"must be > start ({_fmt(seg.start)}), "
                                    f"got {_fmt(seg.end)}")
        if seg.kind == "step":
            self._check_at(here, seg)
        elif seg.at is not None:
            raise ScheduleError(f"{here}.at", f"only a step segment has `at`, not {seg.kind}")
        self._check_map(f"{here}.{seg.map_name('from')}", seg.weights_from)
        if seg.kind != "const":
            self._check_map(f"{here}.to", seg.weights_to)

    @staticmethod
    def _check_at(here: str, seg: Segment) -> None:
        if seg.at is None:
            raise ScheduleError(f"{here}.at", "required for a step segment")
        _check_number(f"{here}.at", seg.at)
        end = "" if seg.end is None else f" and < end ({_fmt(seg.end)})"
        if seg.at < seg.start or (seg.end is not None and seg.at >= seg.end):
            raise ScheduleError(f"{here}.at", f"must be >= start ({_fmt(seg.start)}){end}, "
                                f"got {_fmt(seg.at)}")

    def _check_map(self, path: str, weights: Mapping[str, float]) -> None:
        known = set(self.sources)
        for name, w in weights.items():
            if name not in known:
                raise ScheduleError(f"{path}.{name}", f"unknown source {name!r} (sources: "
                                    f"{', '.join(self.sources)})")
            if isinstance(w, bool) or not isinstance(w, (int, float)):
                raise ScheduleError(f"{path}.{name}", f"must be a number, got {w!r}")
            if not math.isfinite(w):
                raise ScheduleError(f"{path}.{name}", f"must be finite, got {w}")
            if w < 0:
                raise ScheduleError(f"{path}.{name}", f"must be >= 0, got {_fmt(w)}")
        if not any(w > 0 for w in weights.values()):
            raise ScheduleError(path, "all weights are 0 (at least one must be > 0)")


def _check_number(path: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ScheduleError(path, f"must be a finite number >= 0, got {v!r}")


def _fmt(v: float | None) -> str:
    """``100`` rather than ``100.0``: users wrote integers."""
    if v is None:
        return "null"
    return str(int(v)) if float(v).is_integer() else repr(float(v))
