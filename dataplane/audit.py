"""``omniscale plane audit DIR``: did every sample train exactly once?

The plane never stores plans; it stores the state at step 0 and the log of what happened. The
audit replays that log on a read-only plane -- drawing and planning each window again, applying
reloads and resizes where they happened -- and for every committed step compares what each rank
got now with the fingerprint recorded when the step was committed. Then it counts, per epoch and
source: samples planned, committed, duplicated (committed more than once within the epoch) and
missing (an epoch the source has finished -- a later epoch has trained -- whose servable
samples were neither committed nor still in flight in a planned, uncommitted step).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.compute as pc

from dataplane.corrupt import ref_from_json
from dataplane.errors import UserError
from dataplane.journal import Journal
from dataplane.plan_table import fingerprint
from loaders.index_schema import read_index


def audit_state_dir(state_dir: str | Path, config=None) -> dict:
    from dataplane.plane import DataPlane, PlaneConfig

    journal = Journal(state_dir)
    steps = journal.snapshot_steps()
    if not steps or steps[0] != 0:
        raise UserError(f"{state_dir}: no snapshot of step 0 (is this a plane state dir?)")
    first = journal.load_snapshot(0)
    config = PlaneConfig(**first["config"])
    plane = DataPlane(None, state_dir, config, restore_step=0, readonly=True)
    W = config.window
    committed: Counter = Counter()  # (source, epoch, shard, key) -> times committed
    planned: set = set()
    in_flight: set = set()  # planned for steps not committed yet: pending, not missing
    mismatched: list[int] = []
    replacements: set = set()  # drawn off the cursor, ahead of the windows' epochs
    for record in journal.records(first["wal_offset"]):
        if record["t"] != "commit":
            plane._replay(record)
            continue
        step = record["step"]
        plane._ensure_planned(step)
        window = plane.windows[step // W]
        dp = window.dp_of_step[step - window.first_step]
        if [fingerprint(plane._table(step, r)) for r in range(dp)] != record["fp"]:
            mismatched.append(step)
        # A sample reported corrupt was not trained; its replacement was, at this step.
        swaps = dict(plane.corrupt.replaced_at(step))
        for i in window.plans[step - window.first_step].samples().tolist():
            ref = window.refs[i]
            replaced = False
            while ref is not None and (*ref.uid, ref.epoch) in swaps:  # bad replacements too
                ref, replaced = swaps.pop((*ref.uid, ref.epoch)), True
            if ref is None:
                continue
            if replaced:
                replacements.add((ref.source, ref.epoch, ref.shard, ref.key))
            committed[(ref.source, ref.epoch, ref.shard, ref.key)] += 1
        plane._mark_committed(step)
    for window in plane.windows.values():
        for plan in window.plans:
            for i in plan.samples().tolist():
                ref = window.refs[i]
                uid = (ref.source, ref.epoch, ref.shard, ref.key)
                planned.add(uid)
                if window.first_step + plan.step >= plane.next_step:
                    in_flight.add(uid)
    for event in plane.corrupt.events:
        if event["source"] in plane.mixer.catalog:  # its window may never have been re-drawn
            plane.mixer.catalog[event["source"]].quarantine(event["shard"], event["key"])
        if event["step"] >= plane.next_step and event["replacement"]:
            ref = ref_from_json(event["replacement"])
            in_flight.add((ref.source, ref.epoch, ref.shard, ref.key))
    catalog = plane.mixer.catalog  # a quarantined sample still in flight will be replaced
    in_flight = {u for u in in_flight
                 if u[0] not in catalog or (u[2], u[3]) not in catalog[u[0]].quarantined}
    planned |= set(committed)
    return _counts(plane, planned, committed, in_flight, mismatched, replacements)


def _counts(plane, planned: set, committed: Counter, in_flight: set,
            mismatched: list[int], replacements: set = frozenset()) -> dict:
    rows: dict[tuple[str, int], dict] = defaultdict(
        lambda: {"planned": 0, "committed": 0, "in_flight": 0, "duplicated": 0, "missing": 0})
    for source, epoch, _, _ in planned:
        rows[(source, epoch)]["planned"] += 1
    for (source, epoch, _, _), n in committed.items():
        rows[(source, epoch)]["committed"] += 1
        rows[(source, epoch)]["duplicated"] += n - 1
    for source, epoch, _, _ in in_flight - set(committed):
        rows[(source, epoch)]["in_flight"] += 1
    last_epoch = {}
    for uid in set(committed) - replacements:  # an epoch is finished once a later one trained
        source, epoch = uid[:2]
        last_epoch[source] = max(last_epoch.get(source, 0), epoch)
    catalog = plane.mixer.catalog
    for (source, epoch), row in rows.items():
        if epoch < last_epoch.get(source, 0) and source in catalog:
            row["missing"] = _servable(catalog[source]) - row["committed"] - row["in_flight"]
    return {"next_step": plane.next_step, "fingerprint_mismatches": mismatched,
            "rows": [{"source": s, "epoch": e, **r} for (s, e), r in sorted(rows.items())],
            "duplicated": sum(r["duplicated"] for r in rows.values()),
            "missing": sum(r["missing"] for r in rows.values())}


def _servable(state) -> int:
    """Samples one epoch of the source serves: index rows less corrupt and quarantined ones
    and media samples over the job's length cap."""
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
    return sum(1 for shard, key, good in keys if good and (shard, key) not in state.quarantined)
