"""Corrupt samples reported by loaders: quarantine the key, replace it from the same source.

A loader that cannot decode a planned sample (policy ``skip``) reports it with
``report_corrupt``. The plane quarantines ``(shard, key)`` in the source's file state, so no
later epoch serves it, and draws a replacement from the same source's cursor. Both change the
mixer's state, so to stay deterministic they happen at a recorded point: just before window
``before_window`` is drawn (the plane's next window when the report arrived). The journal
record carries that point and the replacement; a replay applies the same events at the same
point, and the snapshot of window k keeps the events of the windows after k (those of window k
are already in its start state).

Reports are idempotent per (step, source, shard, key, epoch) -- a small source can put the
same key twice into one step, from two epochs, and each needs its own replacement: every rank of
an SP group holding the sample reports it, and a client may retry; all of them get the first
report's replacement.

A replacement takes the bad sample's place in the micro-batch(es) that held it, so it must fit
the token budget there (DESIGN: never exceeded): :func:`replacement_room` is the most LLM tokens
it may have, given what else the step packed into those micro-batches (for a sample split over
an SP group, on every rank of the group: the loader slices the replacement the same way). When
the source's next sample is longer, there is no replacement (the loader leaves the sample out)
and the source's cursor does not move, so that sample is served later as usual. The room is
journaled with the report, so a replay draws the same.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

import numpy as np

from omniscale.balancer.types import split_lengths
from omniscale.plan import rescale_lengths
from omniscale.refs import RefTable, SampleRef

log = logging.getLogger(__name__)

RECENT = 20  # reports kept for status


def ref_to_json(ref: SampleRef | None) -> str:
    """A ref as JSON text ("" for none): journal records and wire replies carry it as is."""
    if ref is None:
        return ""
    d = asdict(ref)
    d["members"] = [list(m) for m in ref.members]
    return json.dumps(d, sort_keys=True)


def ref_from_json(text: str) -> SampleRef | None:
    if not text:
        return None
    d = json.loads(text)
    d["members"] = tuple(tuple(m) for m in d["members"])
    for name in ("image_patches", "video_patches", "audio_frames"):
        d[name] = tuple(d[name])
    return SampleRef(**d)


def draw_replacement(catalog, source: str, shard: str, key: str,
                     max_tokens: int | None = None) -> SampleRef | None:
    """Quarantine the key and take the source's next servable sample if it has at most
    ``max_tokens`` LLM tokens (None: no limit). None when the source is gone or exhausted or
    its next sample is too long -- the loader then simply leaves the sample out, and a sample
    too long stays where it is in the source's order."""
    if source not in catalog:
        return None
    state = catalog[source]
    state.quarantine(shard, key)
    ref = state.peek()
    if ref is None or (max_tokens is not None and ref.llm_tokens > max_tokens):
        return None
    return state.next()


def replacement_room(plan, refs: "RefTable | list[SampleRef]", tokens_N, sample: tuple, budget: int,
                     occupants: dict | None = None) -> int | None:
    """The most LLM tokens a replacement of ``sample`` ((source, shard, key, epoch) of a sample
    the step planned) may have so that every micro-batch holding it stays within ``budget``
    tokens; None when the step does not place that sample.

    ``plan`` is the step's :class:`balancer.types.StepPlan`, ``refs`` and ``tokens_N`` the
    window's samples (window-local index = position) and their planned LLM tokens.
    ``occupants`` ({planned sample: its replacement or None}, :meth:`CorruptLedger.occupants`)
    are the step's earlier replacements: a micro-batch holds those instead of the samples
    they replaced. A sample split over an SP group of k ranks holds ceil(L/k) tokens on each;
    a replacement of L' tokens is split the same way, so it fits where ceil(L'/k) fits on
    every rank of the group. Slices sized by speed (``plan.sp_tokens_P``) are cut in
    proportion for a replacement (``omniscale.plan.rescale_lengths``): rank j's slice
    of L' is about T_j·L'/L (a token of rounding kept spare).
    """
    occupants = occupants or {}
    sample_P = np.asarray(plan.sample_P)
    rank_P, mb_P, k_P = (np.asarray(a) for a in (plan.rank_P, plan.micro_batch_P,
                                                  plan.sp_size_P))
    ids = {i: (refs[i].source, refs[i].shard, refs[i].key, refs[i].epoch)
           for i in np.unique(sample_P).tolist()}
    at = [i for i, sid in ids.items() if sid == tuple(sample)]
    if not at:
        return None
    rows = np.flatnonzero(sample_P == at[0])
    k = int(k_P[rows[0]])
    planned = int(tokens_N[at[0]])
    by_speed = plan.sp_tokens_P is not None and k > 1
    room = budget if not by_speed else None
    for r in rows:
        rank, mb = int(rank_P[r]), int(mb_P[r])
        used = int(plan.mb_tokens_RB[rank, mb]) - _slice_of(plan, r, planned)  # the others
        for o in np.flatnonzero((rank_P == rank) & (mb_P == mb)).tolist():
            i = int(sample_P[o])
            if i != at[0] and ids[i] in occupants:  # replaced (or left out) earlier
                now = occupants[ids[i]]
                used += _slice_of(plan, o, now.llm_tokens if now is not None else 0) \
                    - _slice_of(plan, o, int(tokens_N[i]))
        if by_speed:  # L' ≤ (room on this rank) × L / T_j
            share = int(plan.sp_tokens_P[r]) / planned
            fits = int((budget - used - 1) / share) if budget - used - 1 > 0 else 0
            room = fits if room is None else min(room, fits)
        else:
            room = min(room, budget - used)
    return max(room, 0) if by_speed else max(room, 0) * k


def _slice_of(plan, row: int, tokens: int) -> int:
    """Tokens placement ``row`` holds when its sample has ``tokens`` tokens: all of them
    whole, ceil(tokens / k) of equal slices, its cut of slices sized by speed."""
    k = int(plan.sp_size_P[row])
    if k == 1:
        return tokens
    if plan.sp_tokens_P is None:
        return -(-tokens // k)
    lengths = split_lengths(plan)[int(plan.sample_P[row])]
    return rescale_lengths(lengths, tokens)[int(plan.sp_index_P[row])] if tokens else 0


class CorruptLedger:
    """The reports of one job: events still to apply on a replay, and counts per source.

    ``applied`` (in memory only) says whether an event's quarantine and draw are in the live
    mixer's state; events read back from a snapshot or the log are not, until their window.
    """

    def __init__(self, events: list[dict] = (), counts: dict | None = None,
                 recent: list[dict] = ()) -> None:
        self.events = [dict(e, applied=False) for e in events]
        self.counts = {str(k): int(v) for k, v in (counts or {}).items()}
        self.recent = [dict(r) for r in recent]

    def planned_sample(self, step: int, sample: tuple) -> tuple:
        """The sample ``step`` planned in the place ``sample`` ((source, shard, key, epoch))
        now holds: ``sample`` itself, or what it replaced (replacements can be bad too)."""
        seen = {tuple(sample)}
        while True:
            for e in self.events:
                if e["step"] != step or not e["replacement"]:
                    continue
                ref = ref_from_json(e["replacement"])
                if (ref.source, ref.shard, ref.key, ref.epoch) == tuple(sample):
                    sample = (e["source"], e["shard"], e["key"], e["epoch"])
                    break
            else:
                return tuple(sample)
            if sample in seen:  # cannot happen (a replacement is never its own ancestor)
                return sample
            seen.add(sample)

    def occupants(self, step: int) -> dict[tuple, SampleRef | None]:
        """{sample ``step`` planned: what its place holds now (the last replacement of its
        chain; None: left out)} for every place a report of ``step`` changed."""
        # planned_sample's walk up each chain, with every replacement parsed once: calling it
        # per event re-parsed every event's JSON, quadratic in the step's reports (seconds of
        # plane time per report on a source that is mostly corrupt)
        mine = [(e, ref_from_json(e["replacement"])) for e in self.events if e["step"] == step]
        parent = {}  # replacement -> the sample it replaced (the first such event, as there)
        for e, ref in mine:
            if e["replacement"]:
                parent.setdefault((ref.source, ref.shard, ref.key, ref.epoch),
                                  (e["source"], e["shard"], e["key"], e["epoch"]))
        out = {}
        for e, ref in mine:  # in report order: a later link of a chain overrides
            sample = (e["source"], e["shard"], e["key"], e["epoch"])
            seen = {sample}
            while (up := parent.get(sample)) is not None:
                sample = up
                if sample in seen:  # cannot happen (a replacement is never its own ancestor)
                    break
                seen.add(sample)
            out[sample] = ref
        return out

    def find(self, step: int, source: str, shard: str, key: str, epoch: int) -> dict | None:
        for e in self.events:
            if (e["step"], e["source"], e["shard"], e["key"], e["epoch"]) == (
                    step, source, shard, key, epoch):
                return e
        return None

    def record(self, event: dict, applied: bool) -> None:
        """Count a (new or replayed) report and keep it for its window's replay."""
        self.events.append(dict(event, applied=applied))
        self.counts[event["source"]] = self.counts.get(event["source"], 0) + 1
        self.recent = (self.recent + [{n: event[n] for n in ("step", "source", "shard", "key",
                                                             "reason")}])[-RECENT:]

    def apply(self, catalog, k: int) -> None:
        """Apply the not-yet-applied reports of window ``k`` (its draw is about to start)."""
        for e in self.events:
            if e["before_window"] != k or e["applied"]:
                continue
            ref = draw_replacement(catalog, e["source"], e["shard"], e["key"],
                                   e.get("max_tokens"))  # absent in older journals: no limit
            if ref_to_json(ref) != e["replacement"]:
                # Only a mixture reload between the report and this draw can cause it.
                log.warning("corrupt %s/%s at step %d: the replay drew a different replacement",
                            e["source"], e["key"], e["step"])
                e["replacement"] = ref_to_json(ref)
            e["applied"] = True

    def unapply_after(self, k: int) -> None:
        """The mixer went back to window ``k``'s start state: later reports apply again."""
        for e in self.events:
            if e["before_window"] > k:
                e["applied"] = False

    def state(self, k: int) -> dict:
        """What the snapshot of window ``k`` must carry."""
        return {"events": [_record(e) for e in self.events if e["before_window"] > k],
                "counts": dict(self.counts), "recent": list(self.recent)}

    @classmethod
    def from_state(cls, state: dict | None) -> "CorruptLedger":
        state = state or {}
        return cls(state.get("events", []), state.get("counts"), state.get("recent", []))

    def replaced_at(self, step: int) -> list[tuple[tuple, SampleRef | None]]:
        """((source, shard, key, epoch) of the bad sample, its replacement) of every report of
        ``step``: what the audit counts instead of the planned sample."""
        return [((e["source"], e["shard"], e["key"], e["epoch"]),
                 ref_from_json(e["replacement"]))
                for e in self.events if e["step"] == step]


def _record(event: dict) -> dict:
    return {k: v for k, v in event.items() if k != "applied"}
