"""Standing a plane up again from its state dir: the newest snapshot that verifies plus the log
after it, or the whole log when no snapshot does. The log is the truth; a snapshot only
shortens the replay, and a state dir that cannot be trusted is refused in one line.

Shared by the plane's start (:class:`dataplane.plane.DataPlane`) and ``plane audit``
(:func:`replay_log`), so the two cannot replay differently.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, fields

from omniscale.dataplane.journal import Journal, JournalError
from omniscale.dataplane.plane_config import PlaneConfig
from omniscale.dataplane.plane_state import PlaneState
from omniscale.errors import UserError

log = logging.getLogger(__name__)

# Settings that decide what the plane plans: a restart must keep them (dp may change).
PLANNING_FIELDS = ("micro_batch_tokens", "window", "global_batch_tokens",
                   "global_batch_samples", "sp_max", "epsilon", "cost_linear",
                   "cost_quadratic", "max_sample_tokens", "balance", "interleave", "costs",
                   "frozen_encoders", "attention_heads")
# what a state dir written before a field existed was planned with
DEFAULTS = {f.name: f.default for f in fields(PlaneConfig)}


def start_record(journal: Journal) -> tuple[int, dict] | None:
    """The log's ``start`` record and the offset after it; None for a new state dir."""
    first = journal.first_record()
    if first is None:
        if journal.snapshot_steps():
            raise JournalError(f"{journal.wal}: empty, but {journal.snapshots} has snapshots: "
                               "the log was lost or the state dir was written by an older "
                               "OmniScale; start a new state dir")
        return None
    if first[1]["t"] != "start":
        raise JournalError(f"{journal.wal}: the first record is {first[1]['t']!r}, not the "
                           "job's start (written by an older OmniScale?)")
    return first


def check_settings(start: dict, config: PlaneConfig) -> None:
    """A restart with other planning settings would plan other steps: refused in one line."""
    was = start["config"]
    for name in PLANNING_FIELDS:
        before = was.get(name, DEFAULTS[name])
        before = tuple(before) if isinstance(before, list) else before  # JSON has no tuples
        if before != getattr(config, name):
            # frozen_encoders is no flag: the trainer's optim.groups set it
            what = "frozen encoders (optim.groups)" if name == "frozen_encoders" else \
                f"--{name.replace('_', '-')}"
            hint = "; a run's plane: --set data.heads_by_speed=false resumes it with H/k heads" \
                if name == "attention_heads" and not before else ""
            raise UserError(f"{what} {getattr(config, name)}: this state dir was planned with "
                            f"{before} (only --dp may change on a restart{hint})")


def open_state(journal: Journal, config: PlaneConfig, restore_step: int | None = None
               ) -> tuple[PlaneState, int] | None:
    """The state the log leads to, and the log offset it stands at; None for a new state dir.

    ``restore_step``: the state of that step's snapshot instead (a trainer resuming from its
    checkpoint of that step; the caller rolls the log back to the offset returned)."""
    first = start_record(journal)
    if first is None:
        return None
    start_end, start = first
    check_settings(start, config)
    if restore_step is not None:
        return _state_at(journal, config, restore_step, start_end, start)
    snap = journal.load_snapshot()
    if snap is None:
        if journal.snapshot_steps():
            log.warning("%s: no snapshot verifies; replaying the whole log", journal.dir)
        state, offset = PlaneState.fresh(start, journal, config), start_end
    else:
        state, offset = PlaneState.from_snapshot(snap, journal, config), snap["wal_offset"]
    for end, record in journal.records(offset):
        state.apply(record)
        offset = end
    newest = max(journal.snapshot_steps(), default=0)
    if state.next_step < newest:
        raise JournalError(f"{journal.wal}: replays to step {state.next_step}, but a snapshot "
                           f"of step {newest} exists: the log lost committed steps")
    return state, offset


def _state_at(journal: Journal, config: PlaneConfig, step: int, start_end: int, start: dict
              ) -> tuple[PlaneState, int]:
    """The state of ``step``'s snapshot; without a valid one, the log replayed up to the
    commit that made ``step`` the next step to train."""
    try:
        snap = journal.load_snapshot(step)
        return PlaneState.from_snapshot(snap, journal, config), snap["wal_offset"]
    except JournalError as e:
        log.warning("%s; replaying the log to step %d instead", e, step)
    state, offset = PlaneState.fresh(start, journal, config), start_end
    for end, record in journal.records(start_end) if step > 0 else ():
        state.apply(record)
        offset = end
        if state.next_step >= step:
            break
    if state.next_step != step:
        raise JournalError(f"{journal.wal}: no snapshot of step {step} verifies and the log "
                           f"does not stop at it (it reaches step {state.next_step})")
    return state, offset


def replay_log(journal: Journal) -> Iterator[tuple[dict, PlaneState]]:
    """Every record of the log after the start, with the state as it stood before the record
    (the caller may inspect it; the record is applied when the caller asks for the next)."""
    first = start_record(journal)
    if first is None:
        raise UserError(f"{journal.dir}: the log is empty (is this a plane state dir?)")
    start_end, start = first
    state = PlaneState.fresh(start, journal)
    for _, record in journal.records(start_end):
        yield record, state
        state.apply(record)


def start_for(spec_ref: dict, config: PlaneConfig) -> dict:
    """The ``start`` record of a new job."""
    return {"t": "start", "spec": spec_ref, "config": asdict(config),
            "sample_cap": config.sample_cap}
