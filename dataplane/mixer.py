"""The mixer: which source each sample of each global batch comes from, following the schedule.

Accounting. Each drawn sample adds ``u`` units: 1 for ``samples`` accounting, its
``llm_tokens`` for ``tokens``, its ``target_tokens`` (the tokens the loss counts: a
conversation's assistant turns) for ``target_tokens``. Every source ``i`` keeps a cumulative target
``T_i = Σ w_i(x) · u`` over all draws so far (``w(x)``: the schedule's normalised weights at the
draw's position ``x``: the step number for a schedule over ``steps``, the tokens drawn before it
for one over ``tokens``) and a realized count ``R_i = Σ u`` over its own draws. The promise:
after every draw, hence at every step, ``|T_i - R_i|`` is at most one sample (``samples``) or
the largest sample's tokens (``tokens``), for constant schedules and for changing ones whose
ramps span at least a few draws per source (property-tested: ramps of 8+ steps). A schedule
that moves a source's share to 0 faster than the batch can follow (say, three sources to one
within three single-sample steps) can strand a positive deficit on the zeroed source, which the
others then carry as a matching negative one; it never grows after the ramp.

Selection. Plain largest-deficit (draw from ``argmax T - R``) overshoots that bound when
weights move (by up to ~20 % of a sample in simulation), so the mixer picks, among sources whose
deficit is not negative, the one whose deficit will soonest reach the bound ``B`` at its current
rate: earliest deadline ``(B - d_i) / w_i`` (``B`` = 1, or the largest next-sample size among
drawable sources). Ties go to the lowest source id. Sources with weight 0 are never drawn. In
``samples`` accounting the deficit counts this draw's target first, so it is always positive for
someone; if no source qualifies the largest deficit is drawn.

Batches. With ``global_batch_samples`` S a batch holds exactly S samples. With
``global_batch_tokens`` T the mixer picks the next sample as above and, if the batch already
holds one and that sample's tokens would take it past T, closes the batch (that sample
stays next in its source). A batch therefore never exceeds T unless a single sample does.

Exhaustion. A source that runs out (``stop`` or ``drop_source``; ``next_epoch`` only when it has
nothing servable at all) leaves the mix: its remaining deficit is shared among the rest by
their current weights and the schedule is renormalised over them; ``drop_source`` also removes
it from the catalog. Each event is recorded in :attr:`Mixer.exhausted`. When no source with a
positive weight is left, the batch drawn so far is returned and the next call raises
:class:`MixtureExhausted`.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from omniscale.dataplane.catalog import Catalog
from omniscale.dataplane.schedule import Schedule
from omniscale.refs import SampleRef

ACCOUNTING = ("samples", "tokens", "target_tokens")
_FEW = 16  # up to this many live sources, a pick runs on Python floats rather than arrays


class MixtureExhausted(Exception):
    """No source with a positive weight has a sample left: the data has run out."""


class Mixer:
    """Draws global batches from a catalog's sources in the schedule's proportions.

    Pure logic over the catalog: deterministic from (catalog state, schedule, mixer state), so
    :meth:`load_state_dict` followed by :meth:`next_batch` yields exactly the batches an
    uninterrupted run would have.
    """

    def __init__(self, catalog: Catalog, schedule: Schedule, accounting: str = "tokens", *,
                 global_batch_samples: int | None = None,
                 global_batch_tokens: int | None = None) -> None:
        if accounting not in ACCOUNTING:
            raise ValueError(f"accounting: unknown {accounting!r} (expected one of "
                             f"{', '.join(ACCOUNTING)})")
        if (global_batch_samples is None) == (global_batch_tokens is None):
            raise ValueError("give exactly one of global_batch_samples and global_batch_tokens")
        size = global_batch_samples if global_batch_tokens is None else global_batch_tokens
        if size < 1:
            raise ValueError(f"global batch size must be >= 1, got {size}")
        self.catalog, self.schedule, self.accounting = catalog, schedule, accounting
        self.batch_samples, self.batch_tokens = global_batch_samples, global_batch_tokens
        self.names = schedule.sources
        self.step = 0  # the step next_batch draws next
        self.tokens = 0  # llm_tokens drawn so far (the position of a schedule over tokens)
        self.samples = 0
        self.target_N = np.zeros(len(self.names))
        self.realized_N = np.zeros(len(self.names))
        self.exhausted: list[dict] = []  # {"source", "step", "policy"}, in order
        # Caches (see _weights_live): segment bounds for the schedule's row key, the active
        # mask, the weights in force and the live ids, the catalog's states by source id.
        self._segs = [(s.kind, float(s.start), math.inf if s.end is None else float(s.end),
                       None if s.at is None else float(s.at)) for s in schedule.segments]
        self._starts = [seg[1] for seg in self._segs]
        self._active: np.ndarray | None = None
        self._weights_cache: tuple | None = None
        self._w_list: list[float] = []
        self._invalidate()

    @classmethod
    def from_spec(cls, spec, catalog: Catalog | None = None, **batch) -> "Mixer":
        """A mixer for a :class:`dataplane.spec.MixSpec` (a fresh catalog unless given)."""
        catalog = catalog if catalog is not None else Catalog.from_spec(spec)
        return cls(catalog, spec.schedule, spec.accounting, **batch)

    # --- drawing -----------------------------------------------------------------------------

    def next_batch(self, step: int) -> list[SampleRef]:
        """Global batch ``step`` (which must be the next one), as refs in draw order.

        Raises :class:`MixtureExhausted` if not even one sample can be drawn.
        """
        if step != self.step:
            raise ValueError(f"next_batch: expected step {self.step}, got {step} (batches are "
                             "drawn in order; restore a state to go back)")
        # The catalog may have changed between batches (a reload, a restore, a quarantine and
        # replacement draw): the active mask is recomputed once here, then only on a retire.
        self._invalidate()
        batch: list[SampleRef] = []
        batch_tokens = 0
        peeked: dict[int, SampleRef] = {}  # per source, valid within this call
        self._peeked_live = None  # the live set every source of which is in ``peeked``
        self._drawn = -1  # the source drawn since, the one missing from ``peeked``
        samples = self.accounting == "samples"
        while self.batch_samples is None or len(batch) < self.batch_samples:
            choice = self._choose(peeked)
            if choice is None:
                if not batch:
                    raise MixtureExhausted(f"step {step}: every source with a positive weight "
                                           "is exhausted")
                break
            i, ref, w_N = choice
            if self.batch_tokens is not None and batch and \
                    batch_tokens + ref.llm_tokens > self.batch_tokens:
                break
            self._sources[i].next()  # the peeked ref: both read one cursor
            peeked.pop(i)
            self._drawn = i
            u = 1.0 if samples else float(self._units(ref))
            self.target_N += w_N * u
            self.realized_N[i] += u
            self.tokens += ref.llm_tokens
            self.samples += 1
            batch_tokens += ref.llm_tokens
            batch.append(ref)
            if self.batch_tokens is not None and batch_tokens >= self.batch_tokens:
                break
        self.step += 1
        return batch

    def _units(self, ref: SampleRef) -> int:
        """A sample's units under token accounting: its tokens, or its target tokens."""
        return ref.target_tokens if self.accounting == "target_tokens" else ref.llm_tokens

    def _choose(self, peeked: dict[int, SampleRef]) -> tuple[int, SampleRef, np.ndarray] | None:
        """The next source by earliest deadline, its next sample and the weights in force;
        None when no source can be drawn. Exhausted sources found on the way leave the mix."""
        while True:
            w_N, live = self._weights_live()
            if not live:
                return None
            # Peek every live source not peeked yet, in id order (the first exhausted one
            # retires): after a draw from an unchanged live set that is only the drawn one.
            todo = (self._drawn,) if live == self._peeked_live else live
            for i in todo:
                if i not in peeked:
                    ref = self._sources[i].peek()
                    if ref is None:
                        self._retire(i, w_N)
                        break
                    peeked[i] = ref
            else:
                self._peeked_live = live
                i = self._pick(live, w_N, peeked)
                return i, peeked[i], w_N

    def _pick(self, live: tuple[int, ...], w_N: np.ndarray, peeked: dict[int, SampleRef]
              ) -> int:
        if self.accounting == "samples":
            bound = 1.0
        else:
            bound = float(max(max(self._units(peeked[i]) for i in live), 1))
        if len(live) > _FEW:
            return self._pick_arrays(w_N, bound)
        # Few sources: the same elementwise IEEE arithmetic as the array version
        # (d = T - R (+ w), (B - d) / w), on Python floats, without numpy's per-call cost.
        target, realized, w = self.target_N.tolist(), self.realized_N.tolist(), self._w_list
        samples = self.accounting == "samples"
        # A deficit a rounding error below 0 is 0: floats must not flip which sources qualify.
        floor = -1e-9 * bound
        best, best_i, top, top_i = math.inf, -1, -math.inf, -1
        for i in live:
            d = target[i] - realized[i]
            if samples:
                d = d + w[i]  # this draw's share of the target, counted before choosing
            if d > top:  # the largest deficit, first of ties (used if none qualifies)
                top, top_i = d, i
            if d >= floor:
                deadline = (bound - d) / w[i]
                if best_i < 0 or deadline < best:  # strict: the first of ties, the lowest id
                    best, best_i = deadline, i
        if best_i >= 0:
            return best_i
        return top_i if top_i >= 0 else live[0]

    def _pick_arrays(self, w_N: np.ndarray, bound: float) -> int:
        live = self._live_L
        d_N = self.target_N - self.realized_N
        if self.accounting == "samples":
            d_N = d_N + w_N  # this draw's share of the target, counted before choosing
        d_L, w_L = d_N[live], w_N[live]
        # A deficit a rounding error below 0 is 0: floats must not flip which sources qualify.
        ok_L = d_L >= -1e-9 * bound
        if not ok_L.any():
            return int(live[np.argmax(d_L)])
        deadline_L = np.where(ok_L, (bound - d_L) / w_L, np.inf)
        return int(live[np.argmin(deadline_L)])  # argmin: first of ties, the lowest id

    def weights(self) -> np.ndarray:
        """The schedule's weights at the current position over the sources still in the mix,
        renormalised; all zero when none of them has weight here."""
        self._invalidate()
        return self._weights_live()[0].copy()

    def _weights_live(self) -> tuple[np.ndarray, tuple[int, ...]]:
        """:meth:`weights` (not to be modified) and the ids with a positive weight, cached
        for as long as the schedule's row and the active mask stay the same."""
        x = self.step if self.schedule.unit == "steps" else self.tokens
        key = self._row_key(x)
        cached = self._weights_cache
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        if self._active is None:
            self._active = self._active_N()
        w_N = self.schedule.weights_over(np.array([x], dtype=np.float64))[0]
        w_N = np.where(self._active, w_N, 0.0)
        total = w_N.sum()
        w_N = w_N / total if total > 0 else w_N
        w_N.flags.writeable = False
        live = tuple(np.flatnonzero(w_N > 0).tolist())
        self._weights_cache = (key, w_N, live)
        self._live_L = np.array(live, dtype=np.int64)
        self._w_list = w_N.tolist()
        return w_N, live

    def _row_key(self, x: float) -> tuple:
        """What the schedule's row at ``x`` depends on: the segment and, within it, what its
        shape reads (nothing for const, which side of ``at`` for step, ``t`` for a ramp).
        Equal keys mean bit-identical rows from Schedule.weights_over."""
        seg = self._seg_of(x)
        kind, start, end, at = self._segs[seg]
        if kind == "const":
            return (seg,)
        if kind == "step":
            return (seg, x >= at)
        t = (x - start) / (end - start) if end != math.inf else 0.0
        return (seg, min(max(t, 0.0), 1.0))

    def _seg_of(self, x: float) -> int:
        starts = self._starts
        if len(starts) == 1:
            return 0
        return max(bisect.bisect_right(starts, x) - 1, 0)

    def _invalidate(self) -> None:
        """Forget the active mask and the weights (the catalog or the exhausted set changed)."""
        self._active = None
        self._weights_cache = None
        self._sources = [self.catalog._sources.get(n) for n in self.names]

    def _active_N(self) -> np.ndarray:
        gone = {e["source"] for e in self.exhausted}
        return np.array([n in self.catalog and n not in gone and not self.catalog[n].exhausted
                         for n in self.names])

    def _retire(self, i: int, w_N: np.ndarray) -> None:
        """Source ``i`` ran out: share its deficit among the rest, take it out of the mix."""
        name = self.names[i]
        policy = self.catalog[name].on_exhausted
        self.exhausted.append({"source": name, "step": self.step, "policy": policy})
        rest_N = np.where(np.arange(len(w_N)) == i, 0.0, w_N)
        if rest_N.sum() > 0:
            self.target_N += (self.target_N[i] - self.realized_N[i]) * rest_N / rest_N.sum()
        self.target_N[i] = self.realized_N[i]
        if policy == "drop_source":
            self.catalog.drop(name)
        self._invalidate()

    # --- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Position, cumulative target and realized per source, exhaustion events and the
        catalog's state: small, JSON-able, enough to continue exactly."""
        return {"step": self.step, "tokens": self.tokens, "samples": self.samples,
                "accounting": self.accounting,
                "target": dict(zip(self.names, map(float, self.target_N))),
                "realized": dict(zip(self.names, map(float, self.realized_N))),
                "exhausted": [dict(e) for e in self.exhausted],
                "catalog": self.catalog.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`'s output (the catalog's state included)."""
        if state["accounting"] != self.accounting:
            raise ValueError(f"state was taken with {state['accounting']} accounting, this "
                             f"mixer counts {self.accounting}")
        self.catalog.load_state_dict(state["catalog"])
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.samples = int(state["samples"])
        # A source new to the schedule since the state was taken starts level: no debt.
        self.target_N = np.array([float(state["target"].get(n, 0.0)) for n in self.names])
        self.realized_N = np.array([float(state["realized"].get(n, 0.0)) for n in self.names])
        self.exhausted = [dict(e) for e in state["exhausted"]]
        self._invalidate()

    def proportions(self) -> dict[str, dict[str, float]]:
        """Per source: cumulative target and realized units and their shares of the total,
        for status reports."""
        total = max(float(self.realized_N.sum()), 1e-300)
        return {n: {"target": float(t), "realized": float(r), "target_share": float(t) / total,
                    "realized_share": float(r) / total}
                for n, t, r in zip(self.names, self.target_N, self.realized_N)}
