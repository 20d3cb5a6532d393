"""The mixer: which source each sample of each global batch comes from, following the schedule.

Accounting. Each drawn sample adds ``u`` units: 1 for ``samples`` accounting, its
``llm_tokens`` for ``tokens``. Every source ``i`` keeps a cumulative target
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

import numpy as np

from dataplane.catalog import Catalog
from dataplane.refs import SampleRef
from dataplane.schedule import Schedule

ACCOUNTING = ("samples", "tokens")


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
            raise ValueError(f"accounting: unknown {accounting!r} (expected samples or tokens)")
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
        batch: list[SampleRef] = []
        batch_tokens = 0
        peeked: dict[int, SampleRef] = {}  # per source, valid within this call
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
            self.catalog[self.names[i]].next()  # the peeked ref: both read one cursor
            peeked.pop(i)
            u = 1.0 if self.accounting == "samples" else float(ref.llm_tokens)
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

    def _choose(self, peeked: dict[int, SampleRef]) -> tuple[int, SampleRef, np.ndarray] | None:
        """The next source by earliest deadline, its next sample and the weights in force;
        None when no source can be drawn. Exhausted sources found on the way leave the mix."""
        while True:
            w_N = self.weights()
            live = np.flatnonzero(w_N > 0)
            if not len(live):
                return None
            for i in map(int, live):
                if i not in peeked:
                    ref = self.catalog[self.names[i]].peek()
                    if ref is None:
                        self._retire(i, w_N)
                        break
                    peeked[i] = ref
            else:
                i = self._pick(live, w_N, peeked)
                return i, peeked[i], w_N

    def _pick(self, live: np.ndarray, w_N: np.ndarray, peeked: dict[int, SampleRef]) -> int:
        d_N = self.target_N - self.realized_N
        if self.accounting == "samples":
            d_N = d_N + w_N  # this draw's share of the target, counted before choosing
            bound = 1.0
        else:
            bound = float(max(max(peeked[i].llm_tokens for i in live), 1))
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
        x = self.step if self.schedule.unit == "steps" else self.tokens
        w_N = self.schedule.weights_over(np.array([x], dtype=np.float64))[0]
        w_N = np.where(self._active_N(), w_N, 0.0)
        total = w_N.sum()
        return w_N / total if total > 0 else w_N

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

    def proportions(self) -> dict[str, dict[str, float]]:
        """Per source: cumulative target and realized units and their shares of the total,
        for status reports."""
        total = max(float(self.realized_N.sum()), 1e-300)
        return {n: {"target": float(t), "realized": float(r), "target_share": float(t) / total,
                    "realized_share": float(r) / total}
                for n, t, r in zip(self.names, self.target_N, self.realized_N)}
