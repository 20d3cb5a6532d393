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
same key twice into one step, from two epochs, and each needs its own replacement: every rank of an SP group holding the
sample reports it, and a client may retry; all of them get the first report's replacement.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

from dataplane.refs import SampleRef

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


def draw_replacement(catalog, source: str, shard: str, key: str) -> SampleRef | None:
    """Quarantine the key and take the source's next servable sample (None: the source is gone
    or exhausted, and the loader simply leaves the sample out)."""
    if source not in catalog:
        return None
    state = catalog[source]
    state.quarantine(shard, key)
    return state.next()


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
            ref = draw_replacement(catalog, e["source"], e["shard"], e["key"])
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
