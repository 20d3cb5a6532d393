"""Samples of steps the trainer did not apply (``tools.train.guard``: a non-finite loss or
gradient norm, a loss spike): listed, kept in the state dir, quarantined from later epochs.

The trainer reports a skipped step's samples with ``report_suspect`` before it commits the
step. The step itself stays trained as far as the plane is concerned (its samples were served
and are not served again in this epoch); what changes is that none of them is served in a
later epoch either: each ``(shard, key)`` is quarantined in its source's file state. That
changes the mixer's state, so as with corrupt reports (:mod:`dataplane.corrupt`) it happens at
a recorded point -- just before window ``before_window`` is drawn -- and a replay applies it
there. Reports are idempotent per step (every retry gets the first report back).

Unlike a corrupt sample, a suspect one is not replaced: the step it was in is over.
"""

from __future__ import annotations

RECENT = 20  # reports kept whole for status (the count and the state dir keep every one)


class SuspectLedger:
    """The suspect reports of one job: every report (steps are few: a run stops after
    ``guard.max_skipped_steps`` in a row), and whether each is in the live mixer's state
    (``applied``, in memory only)."""

    def __init__(self, events: list[dict] = ()) -> None:
        self.events = [dict(e, applied=False) for e in events]

    def find(self, step: int) -> dict | None:
        return next((e for e in self.events if e["step"] == step), None)

    def record(self, event: dict, catalog=None) -> None:
        """Keep a new (``catalog``: the live one, quarantined now) or replayed report."""
        self.events.append(dict(event, applied=catalog is not None))
        if catalog is not None:
            _quarantine(catalog, event)

    def apply(self, catalog, k: int) -> None:
        """Quarantine the not-yet-applied reports of window ``k`` (its draw is about to start)."""
        for e in self.events:
            if e["before_window"] == k and not e["applied"]:
                _quarantine(catalog, e)
                e["applied"] = True

    def unapply_after(self, k: int) -> None:
        """The mixer went back to window ``k``'s start state: later reports apply again."""
        for e in self.events:
            if e["before_window"] > k:
                e["applied"] = False

    def state(self) -> list[dict]:
        """What a snapshot carries: every report (the listing needs the old ones too)."""
        return [{n: v for n, v in e.items() if n != "applied"} for e in self.events]

    @classmethod
    def from_state(cls, events: list[dict] | None, k: int) -> "SuspectLedger":
        """The ledger of a snapshot of window ``k``: reports before it are in its mixer state."""
        ledger = cls(events or [])
        for e in ledger.events:
            e["applied"] = e["before_window"] <= k
        return ledger

    def status(self) -> dict:
        samples = [dict(s, step=e["step"], reason=e["reason"]) for e in self.events
                   for s in e["samples"]]
        return {"steps": len(self.events), "samples": len(samples), "recent": samples[-RECENT:]}


def _quarantine(catalog, event: dict) -> None:
    for s in event["samples"]:
        if s["source"] in catalog:  # a source a reload removed since
            catalog[s["source"]].quarantine(s["shard"], s["key"])
