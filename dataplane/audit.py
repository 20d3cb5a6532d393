"""``omniscale plane audit DIR``: did every sample train exactly once?

The plane never stores plans; it stores how the job started and the log of what happened. The
audit replays that log from its start (:func:`dataplane.restore.replay_log`, on a state of its
own: it needs no snapshot and never takes a running plane's lock) -- drawing and planning each
window again, applying reloads and resizes where they happened -- and for every committed step
compares what each rank got now with the fingerprint recorded when the step was committed.

Then it counts, per source and epoch: samples planned, committed, duplicated (committed more
than once within the epoch), in flight (planned for a step not committed yet), not drawn yet
(still ahead of the source's cursor in its current epoch) and missing: servable samples of the
epoch that are none of those. An epoch is ``complete`` once the cursor has passed its end; a
mid-epoch "missing 0" then still means something, since the samples ahead are counted by key.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.compute as pc

from omniscale.dataplane.corrupt import ref_from_json
from omniscale.dataplane.journal import Journal
from omniscale.dataplane.restore import replay_log
from omniscale.index_schema import read_index, read_shard


def audit_state_dir(state_dir: str | Path) -> dict:
    journal = Journal(state_dir, readonly=True)
    committed: Counter = Counter()  # (source, epoch, shard, key) -> times committed
    mismatched: list[int] = []
    plane = None
    for record, plane in replay_log(journal):  # each record applied once the loop moves on
        if record["t"] != "commit":
            continue
        step = record["step"]
        plane.plan_through(step)
        window, local = plane.window_of(step)
        if plane.step_fingerprints(step) != record["fp"]:
            mismatched.append(step)
        # A sample reported corrupt was not trained; its replacement was, at this step.
        swaps = dict(plane.corrupt.replaced_at(step))
        for i in window.plans[local].samples().tolist():
            ref = window.refs[i]
            while ref is not None and (*ref.uid, ref.epoch) in swaps:  # bad replacements too
                ref = swaps.pop((*ref.uid, ref.epoch))
            if ref is not None:
                committed[(ref.source, ref.epoch, ref.shard, ref.key)] += 1
    if plane is None:  # a log with nothing after its start
        from omniscale.dataplane.plane_state import PlaneState
        from omniscale.dataplane.restore import start_record

        plane = PlaneState.fresh(start_record(journal)[1], journal)
    # Reports are applied when the window they precede is drawn; the live plane had drawn
    # up to there, so the audit does too (their replacements moved the sources' cursors).
    pending = [e["before_window"] for e in plane.corrupt.events if not e["applied"]]
    if pending:
        plane.plan_through(max(pending) * plane.config.window)
    planned: set = set(committed)
    in_flight: set = set()  # planned for steps not committed yet: pending, not missing
    for window in plane.windows.values():
        for plan in window.plans:
            for i in plan.samples().tolist():
                ref = window.refs[i]
                uid = (ref.source, ref.epoch, ref.shard, ref.key)
                planned.add(uid)
                if window.first_step + plan.step >= plane.next_step:
                    in_flight.add(uid)
    catalog = plane.mixer.catalog
    for event in plane.corrupt.events:
        if event["source"] in catalog:  # its window may never have been re-drawn
            catalog[event["source"]].quarantine(event["shard"], event["key"])
        if event["step"] >= plane.next_step and event["replacement"]:
            ref = ref_from_json(event["replacement"])
            in_flight.add((ref.source, ref.epoch, ref.shard, ref.key))
    # a quarantined sample still in flight will be replaced
    in_flight = {u for u in in_flight
                 if u[0] not in catalog or (u[2], u[3]) not in catalog[u[0]].quarantined}
    return _counts(plane, planned, committed, in_flight, mismatched)


def _counts(plane, planned: set, committed: Counter, in_flight: set,
            mismatched: list[int]) -> dict:
    rows: dict[tuple[str, int], dict] = defaultdict(
        lambda: {"planned": 0, "committed": 0, "in_flight": 0, "duplicated": 0,
                 "not_drawn": 0, "missing": 0, "complete": None})
    by_epoch: dict[tuple[str, int], set] = defaultdict(set)  # (shard, key) committed/in flight
    for source, epoch, shard, key in planned:
        rows[(source, epoch)]["planned"] += 1
    for (source, epoch, shard, key), n in committed.items():
        rows[(source, epoch)]["committed"] += 1
        rows[(source, epoch)]["duplicated"] += n - 1
        by_epoch[(source, epoch)].add((shard, key))
    for source, epoch, shard, key in in_flight - set(committed):
        rows[(source, epoch)]["in_flight"] += 1
        by_epoch[(source, epoch)].add((shard, key))
    catalog = plane.mixer.catalog
    servable, ahead = {}, {}
    for (source, epoch), row in rows.items():
        if source not in catalog:  # removed by a reload: nothing left to expect
            continue
        state = catalog[source]
        if source not in servable:
            servable[source], ahead[source] = _servable(state), _not_drawn(state)
        if epoch > state.epoch:  # drawn past the cursor the log leads to: cannot judge
            row["complete"], row["not_drawn"] = False, len(servable[source])
            continue
        current = epoch == state.epoch and not state.exhausted
        not_drawn = ahead[source] if current else set()
        row["complete"] = not not_drawn
        row["not_drawn"] = len(not_drawn & servable[source])
        row["missing"] = len(servable[source] - by_epoch[(source, epoch)] - not_drawn)
    return {"next_step": plane.next_step, "fingerprint_mismatches": mismatched,
            "rows": [{"source": s, "epoch": e, **r} for (s, e), r in sorted(rows.items())],
            "duplicated": sum(r["duplicated"] for r in rows.values()),
            "missing": sum(r["missing"] for r in rows.values())}


def _servable(state) -> set[tuple[str, str]]:
    """(shard, key) of every sample one epoch of the source serves: index rows less corrupt
    and quarantined ones and media samples over the job's length cap."""
    table = read_index(state.path, columns=["shard", "key", "error", "llm_tokens",
                                            "image_patches", "video_patches", "audio_frames"])
    ok = pc.is_null(table.column("error"))
    if state.max_tokens is not None:
        media = pc.or_(pc.or_(pc.greater(pc.list_value_length(table.column("image_patches")), 0),
                              pc.greater(pc.list_value_length(table.column("video_patches")), 0)),
                       pc.greater(pc.list_value_length(table.column("audio_frames")), 0))
        too_long = pc.and_(pc.greater(table.column("llm_tokens"), state.max_tokens),
                           pc.fill_null(media, False))
        ok = pc.and_(ok, pc.invert(pc.fill_null(too_long, False)))
    keys = zip(table.column("shard").to_pylist(), table.column("key").to_pylist(),
               ok.to_pylist())
    return {(shard, key) for shard, key, good in keys
            if good and (shard, key) not in state.quarantined}


def _not_drawn(state) -> set[tuple[str, str]]:
    """(shard, key) of the rows still ahead of the source's cursor in its current epoch, in
    the source's seeded shard and row order."""
    if state.exhausted:
        return set()
    order, ahead = state.shard_order(state.epoch), set()
    for pos in range(state.shard_pos, len(state.shards)):
        shard = state.shards[order[pos]]
        keys = read_shard(state.path, shard, columns=["key"]).column("key").to_pylist()
        rows = state.row_order(state.epoch, pos, len(keys))
        first = state.sample_pos if pos == state.shard_pos else 0
        ahead.update((shard, keys[r]) for r in rows[first:])
    return ahead
