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
import pyarrow as pa

from omniscale.dataplane.catalog import Catalog
from omniscale.dataplane.draw_kernel import DONE, FULL, MOVED, NEED, draw, ramp_row
from omniscale.dataplane.schedule import Schedule
from omniscale.refs import SampleRef, table_to_refs

ACCOUNTING = ("samples", "tokens", "target_tokens")
_NO_RAMP = np.empty(0)  # draw()'s ramp when the row holds still between its stops


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
        self._invalidate()

    @classmethod
    def from_spec(cls, spec, catalog: Catalog | None = None, **batch) -> "Mixer":
        """A mixer for a :class:`dataplane.spec.MixSpec` (a fresh catalog unless given)."""
        catalog = catalog if catalog is not None else Catalog.from_spec(spec)
        return cls(catalog, spec.schedule, spec.accounting, **batch)

    # --- drawing -----------------------------------------------------------------------------

    def next_batch(self, step: int) -> list[SampleRef]:
        """Global batch ``step`` (which must be the next one), as refs in draw order:
        :meth:`next_batch_table`'s rows."""
        return table_to_refs(self.next_batch_table(step))

    def next_batch_table(self, step: int) -> pa.Table:
        """Global batch ``step`` (which must be the next one), as a :data:`REF_SCHEMA` table,
        a row per sample in draw order.

        Raises :class:`MixtureExhausted` if not even one sample can be drawn.

        The draws are decided by :func:`draw_kernel.draw` from the sources' next samples'
        token counts and consumed a source's run at a time (``SourceState.take_table``);
        between its stops this does what picking one sample at a time did at that point --
        peek the live sources that have nothing known ahead (retiring the exhausted, in id
        order), re-read the weights where the schedule's row may change -- so the batch, the
        accounting and every source's cursor end exactly as they did.
        """
        if step != self.step:
            raise ValueError(f"next_batch: expected step {self.step}, got {step} (batches are "
                             "drawn in order; restore a state to go back)")
        return self._draw_batch(step)

    def _draw_batch(self, step: int) -> pa.Table:
        # The catalog may have changed between batches (a reload, a restore, a quarantine and
        # replacement draw): the active mask is recomputed once here, then only on a retire.
        self._invalidate()
        N = len(self.names)
        samples = self.accounting == "samples"
        # Tokens per sample are needed while drawing only when something depends on them;
        # otherwise a source's known samples are just a count (the rest of its open shard).
        values = not samples or self.batch_tokens is not None or self.schedule.unit == "tokens"
        K = max(64, min(1024, (1 << 20) // max(N, 1))) if values else 0
        llm_NK = np.zeros((N, K), np.int64)
        unit_NK = np.zeros((N, K), np.int64)
        pos_N, end_N = np.zeros(N, np.int64), np.zeros(N, np.int64)
        settled = np.zeros(N, bool)  # peeked since drawn last: the cursor rests on a sample
        chunks: list[list[pa.Table]] = [[] for _ in range(N)]  # per source: taken rows
        picks: list[np.ndarray] = []
        drawn, batch_tokens = 0, 0
        room = -1 if self.batch_samples is None else self.batch_samples
        picks_P = np.empty(room if room >= 0 else 4096, np.int64)
        while True:
            w_N, live = self._weights_live()
            if not live:
                break
            ramp = self._ramp_at(self.tokens)
            if ramp is None:
                seg, ramp_SE, x_limit = 0, _NO_RAMP, float(self._key_until())
            else:  # the kernel moves the row itself, draw by draw, up to the ramp's end
                seg, start, end = ramp
                ramp_SE, x_limit = np.array([start, end]), end
            from_N, to_N = self.schedule.maps(seg)
            status, n, batch_tokens, _, attempted, need = draw(
                self.target_N, self.realized_N, w_N.copy(), self._live_L, samples, values,
                llm_NK, unit_NK, pos_N, end_N, room - drawn if room >= 0 else len(picks_P),
                -1 if self.batch_tokens is None else self.batch_tokens, drawn, batch_tokens,
                self.tokens, x_limit, picks_P, ramp_SE, from_N, to_N, self._active)
            if attempted:
                settled[self._live_L] = True
            if n:
                drawn += n
                picks.append(picks_P[:n].copy())
                self._consume(picks[-1], chunks)
                if status in (DONE, MOVED):
                    settled[picks[-1][-1]] = False  # drawn, and not peeked since
            if status == FULL or (status == DONE and (
                    drawn == room or (self.batch_tokens is not None
                                      and batch_tokens >= self.batch_tokens))):
                break
            if status == NEED:  # the weights where the draws stopped (a ramp moved them)
                self._peek(need, self._weights_live()[0], values, llm_NK, unit_NK, pos_N,
                           end_N)
        if not drawn:
            raise MixtureExhausted(f"step {step}: every source with a positive weight is "
                                   "exhausted")
        for i in np.flatnonzero(settled).tolist():
            if self._sources[i] is not None:
                self._sources[i].settle()
        self.step += 1
        return _interleave(np.concatenate(picks), chunks)

    def _consume(self, picks_P: np.ndarray, chunks: list) -> None:
        """Take the drawn samples from their sources: their rows, tokens and counts."""
        count_N = np.bincount(picks_P, minlength=len(self.names))
        for i in np.flatnonzero(count_N).tolist():
            source = self._sources[i]
            before = source.served_tokens
            chunks[i].append(source.take_table(int(count_N[i])))
            self.tokens += source.served_tokens - before
        self.samples += len(picks_P)

    def _peek(self, need: int, w_N: np.ndarray, values: bool, llm_NK: np.ndarray,
              unit_NK: np.ndarray, pos_N: np.ndarray, end_N: np.ndarray) -> None:
        """Peek the live sources with nothing known ahead, in id order from ``need`` (the
        first of them): load what each has ahead in its open shard, or retire it when it is
        exhausted (then the weights change: the caller re-reads them)."""
        for i in self._weights_live()[1]:
            if i < need or pos_N[i] < end_N[i]:
                continue
            source = self._sources[i]
            if not source.settle():
                self._retire(i, w_N)
                return
            llm_K, target_K = source.ahead()
            if values:
                m = min(len(llm_K), llm_NK.shape[1])
                llm_NK[i, :m] = llm_K[:m]
                unit_NK[i, :m] = target_K[:m] if self.accounting == "target_tokens" \
                    else llm_K[:m]
            else:
                m = len(llm_K)
            pos_N[i], end_N[i] = 0, m

    def _key_until(self) -> float:
        """Where the schedule's row may next change: the draw position (the step, or the
        tokens drawn) from which ``_row_key`` may differ from now (inf: not in this batch).
        Only a bound: stopping earlier just re-reads the same cached row."""
        if self.schedule.unit == "steps":
            return math.inf  # the step is the same all batch
        x, starts = self.tokens, self._starts
        seg = self._seg_of(x)
        later = [s for s in starts[seg + 1:] if s > x]
        nxt = later[0] if later else math.inf
        kind, start, end, at = self._segs[seg]
        if kind == "const":
            return nxt
        if kind == "step":
            return min(nxt, at) if x < at else nxt
        if end == math.inf or x >= end:  # t stays 0, or stays 1
            return nxt
        if x <= start:  # a ramp not begun: t is 0 until the tokens pass its start
            return min(nxt, math.floor(start) + 1)
        return x + 1  # within a ramp every token moves t

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
        ramp = self._ramp_at(x)
        if ramp is not None:  # the kernel's own rows (the same as below, bit for bit)
            seg, start, end = ramp
            w_N = np.empty(len(self.names))
            ramp_row(float(x), start, end, *self.schedule.maps(seg), self._active, w_N)
        else:
            w_N = self.schedule.weights_over(np.array([x], dtype=np.float64))[0]
            w_N = np.where(self._active, w_N, 0.0)
            total = w_N.sum()
            w_N = w_N / total if total > 0 else w_N
        w_N.flags.writeable = False
        live = tuple(np.flatnonzero(w_N > 0).tolist())
        self._weights_cache = (key, w_N, live)
        self._live_L = np.array(live, dtype=np.int64)
        return w_N, live

    def _ramp_at(self, x: float) -> tuple[int, float, float] | None:
        """(segment, start, end) when ``x`` lies strictly inside a linear segment of a
        schedule over tokens, where every token drawn moves the row; else None."""
        if self.schedule.unit != "tokens":
            return None
        seg = self._seg_of(x)
        kind, start, end, _ = self._segs[seg]
        return (seg, start, end) if kind == "linear" and start < x < end else None

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


def _interleave(picks_P: np.ndarray, chunks: list[list[pa.Table]]) -> pa.Table:
    """The batch in draw order: draw p is the next of source ``picks_P[p]``'s samples (each
    source's taken rows in order, in ``chunks``)."""
    at_P = np.empty(len(picks_P), np.int64)
    at_P[np.argsort(picks_P, kind="stable")] = np.arange(len(picks_P))
    runs = [run for source_runs in chunks for run in source_runs]  # by source, as taken
    return pa.concat_tables(runs).take(pa.array(at_P)).combine_chunks()
