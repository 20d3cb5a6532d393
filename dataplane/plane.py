"""The data plane: one per job; owns the mixture, plans every step for every rank, and
remembers what was trained, so that nothing is lost or repeated across crashes and resizes.

:class:`DataPlane` is the service around the state machine of :mod:`dataplane.plane_state`:
it opens the state dir (:mod:`dataplane.restore`), validates every state-changing request and
tries it on the state *before* the request reaches the log (a refused request changes nothing
and is one line), runs the commit protocol, and answers status. The log is the truth; snapshots
only shorten a restart's replay.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pyarrow as pa

from omniscale.dataplane.actions import (
    REPORT_KINDS,
    Reason,
    RequestError,
    check_costs,
    check_speeds,
    check_stragglers,
    suspect_sample,
)
from omniscale.dataplane.corrupt import draw_replacement, ref_to_json, replacement_room
from omniscale.dataplane.journal import Journal
from omniscale.dataplane.plane_config import PlaneConfig  # noqa: F401  (public here too)
from omniscale.dataplane.plane_state import PlaneState
from omniscale.dataplane.restore import open_state, start_for
from omniscale.dataplane.spec_file import read_reload_spec, read_spec_file
from omniscale.dataplane.status import plane_status
from omniscale.errors import UserError
from omniscale.plan import step_fingerprint

log = logging.getLogger(__name__)


def _read_through(name: str) -> property:
    """``plane.<name>``: the state's attribute, read through ``plane.state`` (which a failed
    change or a restore replaces whole, so nothing of it is copied onto the plane)."""
    return property(lambda plane: getattr(plane.state, name),
                    doc=f"``state.{name}`` (:class:`dataplane.plane_state.PlaneState`)")


class DataPlane:
    """Implements :data:`dataplane.actions.PlaneService` around ``state`` (a
    :class:`PlaneState`). Thread-safe: one lock around the state."""

    state: PlaneState  # from the state dir or fresh; replaced whole when a failed change reopens

    # What status, tools and tests read on a plane; planning itself (plan_through, table …)
    # is ``plane.state``'s.
    next_step = _read_through("next_step")
    next_window = _read_through("next_window")
    exhausted_at = _read_through("exhausted_at")
    committed = _read_through("committed")
    rank_commits = _read_through("rank_commits")
    committed_fps = _read_through("committed_fps")
    windows = _read_through("windows")
    mixer = _read_through("mixer")
    spec = _read_through("spec")
    corrupt = _read_through("corrupt")
    suspects = _read_through("suspects")
    dp_at = _read_through("dp_at")

    def __init__(self, spec: str | Path | None, state_dir: str | Path, config: PlaneConfig,
                 restore_step: int | None = None, spec_root: str | Path | None = None):
        """Start fresh from ``spec`` or, when ``state_dir`` has a log, carry on where it
        ends -- or from ``restore_step``'s snapshot, rolling the log back to it (a trainer
        resuming from its checkpoint of that step). ``spec_root``: the directory a ``reload``
        may read specs under (default: the starting spec's directory)."""
        self.config = config
        self.journal = Journal(state_dir)
        self.lock = threading.RLock()
        self.served_max = -1
        self.ray_namespace: str | None = None  # set by a plane running as a Ray actor
        self.served: dict[int, set[int]] = {}  # step -> ranks it was served to (this process)
        self.clients: dict[int, tuple[float, int]] = {}  # rank -> (monotonic time, step)
        # the trainer's latest straggler report (report_stragglers): in memory only
        self.stragglers: dict = {"ranks": [], "step": None, "slowdown": []}
        self.last_snapshot = -1
        opened = open_state(self.journal, config, restore_step)
        if opened is None:
            if spec is None:
                raise UserError(f"{state_dir}: a new state dir needs --spec to start")
            self._start_fresh(Path(spec))
        else:
            self.state, offset = opened
            if restore_step is not None:
                self._roll_back_to(restore_step, offset)
            self.last_snapshot = max(self.journal.snapshot_steps(), default=-1)
            self._apply_dp(config.dp)
        root = spec_root if spec_root is not None else Path(self.start_spec_file).parent
        self.spec_root = Path(os.path.realpath(root))
        self.state.plan_through(self._horizon())

    # -- opening ----------------------------------------------------------------------------
    def _start_fresh(self, spec_path: Path) -> None:
        text = read_spec_file(spec_path, limit=None)
        ref = self._spec_ref(text, spec_path)
        start = start_for(ref, self.config)
        self.state = PlaneState.fresh(start, self.journal, self.config)
        self.state.plan_through(self._horizon())  # plans, or refuses before anything is logged
        self.journal.append(start)
        self._write_snapshot()  # step 0: a restart's shortcut

    def _spec_ref(self, text: str, path: Path) -> dict:
        """Copy the spec into the state dir (content-addressed); its ref for the log."""
        path = Path(os.path.abspath(path))
        return {"sha256": self.journal.store_spec(text), "root": str(path.parent),
                "file": str(path)}

    @property
    def start_spec_file(self) -> str:
        first = self.journal.first_record()
        return first[1]["spec"]["file"] if first else self.state.spec_ref["file"]

    @property
    def spec_path(self) -> str:
        return self.state.spec_ref["file"]

    def _roll_back_to(self, step: int, offset: int) -> None:
        kept = self.journal.roll_back(offset)
        aside = self.journal.snapshots / "rolled-back"
        for s in self.journal.snapshot_steps():
            if s > step:
                aside.mkdir(exist_ok=True)
                path = self.journal.snapshots / f"snap-{s:010d}.json"
                path.rename(aside / path.name)
        if kept:
            log.warning("restored step %d: later log records moved to %s", step, kept)

    def _apply_dp(self, dp: int) -> None:
        """A restart with another number of ranks: re-plan from the next step, then log it."""
        if self.state.dp_at(self.state.next_step) == dp:
            return
        hold = self.config.micro_batch_tokens * min(self.config.sp_max,
                                                    1 << (dp.bit_length() - 1))
        if hold < self.state.cap:
            raise UserError(
                f"--dp {dp}: this job plans samples of up to {self.state.cap} tokens, more than "
                f"{dp} rank(s) can hold with --micro-batch-tokens "
                f"{self.config.micro_batch_tokens} and --sp-max {self.config.sp_max}")
        log.warning("resizing: steps from %d are planned for %d ranks (were %d)",
                    self.state.next_step, dp, self.state.dp_at(self.state.next_step))
        self.state.resize_from(self.state.next_step, dp)
        try:
            self.state.plan_through(self._horizon())
        except Exception as e:  # noqa: BLE001 -- refused: nothing was logged
            raise UserError(f"--dp {dp}: the next windows do not plan on {dp} ranks "
                            f"({_one_line(e)})") from None
        self._log({"t": "dp", "step": self.state.next_step, "dp": dp})

    def _reopen(self) -> None:
        """Back to what the log says (a change failed after it touched the state)."""
        self.state, _ = open_state(self.journal, self.config)
        self.state.plan_through(self._horizon())

    def _horizon(self) -> int:
        return self.state.next_step + self.config.window * (1 + self.config.plan_ahead) - 1

    # -- persistence --------------------------------------------------------------------------
    def _log(self, record: dict, sync: bool = True) -> None:
        """Append to the log; with ``sync=False`` the caller makes it durable (``sync_to``)
        before it answers, outside the plane's lock."""
        self.journal.append(record, sync=sync)

    def _write_snapshot(self) -> Path:
        # the log the snapshot follows must be on disk first (commits are synced after the
        # lock): a crash must not leave a snapshot whose wal_offset lies past the log's end
        self.journal.sync_to(self.journal.written)
        path = self.journal.write_snapshot(self.state.snapshot_body(self.journal.written))
        self.last_snapshot = self.state.next_step
        return path

    def _change(self, what: str, record: dict, k: int) -> None:
        """Try a change (already made to the state from window ``k`` on) by planning window
        ``k`` with it, then log it; a failure restores the state from the log and refuses."""
        try:
            self.state.plan_through(k * self.config.window)
        except Exception as e:  # noqa: BLE001 -- whatever broke, the change is refused
            self._reopen()
            raise RequestError(f"{what}: refused, window {k} does not plan with it "
                               f"({_one_line(e)})", Reason.UNPLANNABLE) from None
        try:
            self._log(record)
        except BaseException:
            self._reopen()
            raise

    # -- the service ------------------------------------------------------------------------
    def get_plan(self, step: int, rank: int) -> pa.Table:
        with self.lock:
            self._check_step(step, "get_plan")
            dp = self.state.dp_at(step)
            if not 0 <= rank < dp:
                raise RequestError(f"rank {rank}: step {step} is planned for {dp} ranks "
                                   f"(0..{dp - 1})", Reason.UNKNOWN_RANK)
            self._check_planned(step, "step {step}: the mixture is exhausted (the last step "
                                      "is {last})")
            self.served_max = max(self.served_max, step)
            self.served.setdefault(step, set()).add(rank)
            self.clients[rank] = (time.monotonic(), step)  # for status: who is connected
            return self.state.table(step, rank)

    def _check_step(self, step: int, what: str) -> None:
        if step < 0:
            raise RequestError(f"step {step} is negative", Reason.INVALID)
        if step < self.state.next_step or step in self.state.committed:
            raise RequestError(f"step {step} is already committed (the next step to "
                               f"train is {self.state.next_step})", Reason.COMMITTED)
        horizon = (self.state.next_step // self.config.window + 1 + self.config.plan_ahead) \
            * self.config.window - 1
        if step > horizon:
            raise RequestError(f"step {step} is too far ahead: plans reach step "
                               f"{horizon} while step {self.state.next_step} is not committed",
                               Reason.TOO_FAR_AHEAD)

    def _check_planned(self, step: int, message: str) -> None:
        self.state.plan_through(step)
        if self.state.exhausted_at is not None and step >= self.state.exhausted_at:
            raise RequestError(message.format(step=step, last=self.state.exhausted_at - 1),
                               Reason.EXHAUSTED)

    def commit(self, step: int, rank: int | None = None, plan_fp: str | None = None) -> dict:
        """Mark ``rank``'s share of ``step`` trained (the step is trained once every rank
        committed), or the whole step when ``rank`` is None. ``plan_fp``: the fingerprint of
        what was trained -- the rank's plan (plan_table.fingerprint; a rank may leave it out
        only for a plan this plane served it), or for the whole step every rank's
        (plan_table.step_fingerprint; required). A commit of a plan that was re-planned since
        is refused. Logged before it is acknowledged, so a restart does not forget it.

        Group commit: the record is written under the lock and made durable after it, so the
        commits of many ranks arriving together share fsyncs (one each would serialise a
        step's commits behind the disk: ~5 ms × ranks on a slow one). The reply waits for
        everything written before it, a repeated commit's original record included."""
        reply = self._commit(step, rank, plan_fp)
        self.journal.sync_to(self.journal.written)
        return reply

    def commit_many(self, rank: int, steps: list[int], plan_fps: list[str | None]) -> dict:
        """One rank's commits of several steps, in order, made durable together (one fsync):
        what a loader whose trainer outpaced the commit round trip has queued. Each is exactly
        a :meth:`commit`; the first refusal is raised, the commits before it standing (durable,
        and repeated harmlessly when sent again with their plan_fp). Replies with the next step
        to train and, per step, whether it is now committed (every rank's share in)."""
        if len(steps) != len(plan_fps) or not steps:
            raise RequestError(f"commit_many: {len(steps)} steps and {len(plan_fps)} plan_fps "
                               "(one each, at least one)", Reason.INVALID)
        replies = []
        try:
            for step, plan_fp in zip(steps, plan_fps):
                replies.append(self._commit(step, rank, plan_fp))
        finally:
            self.journal.sync_to(self.journal.written)
        return {"next_step": self.state.next_step,
                "committed": [bool(r.get("committed")) for r in replies]}

    def _commit(self, step: int, rank: int | None, plan_fp: str | None) -> dict:
        with self.lock:
            repeated = self.state.repeated_commit(step, rank, plan_fp)
            if repeated is not None:
                return repeated
            self._check_step(step, "commit")
            self._check_planned(step, "step {step} was never planned (the mixture is "
                                       "exhausted after step {last})")
            dp = self.state.dp_at(step)
            prints = self.state.step_fingerprints(step)
            if rank is None:
                if plan_fp is None:
                    raise RequestError(f"step {step}: a whole-step commit needs plan_fp, the "
                                       "step fingerprint of every rank's plan "
                                       "(plan_table.step_fingerprint)", Reason.INVALID)
                if plan_fp != step_fingerprint(prints):
                    raise RequestError(f"step {step}: plan_fp does not match the step's plans "
                                       f"on {dp} ranks: fetch them again", Reason.REPLANNED)
            else:
                if not 0 <= rank < dp:
                    raise RequestError(f"rank {rank}: step {step} has {dp} ranks (0..{dp - 1})",
                                       Reason.UNKNOWN_RANK)
                ranks = self.state.rank_commits.setdefault(step, set())
                if rank in ranks:
                    raise RequestError(f"rank {rank} already committed step {step}",
                                       Reason.RANK_COMMITTED)
                if plan_fp is None and rank not in self.served.get(step, ()):
                    raise RequestError(f"step {step} was never served to rank {rank}: fetch "
                                       "its plan first (or send its plan_fp)", Reason.NOT_SERVED)
                if plan_fp is not None and plan_fp != prints[rank]:
                    raise RequestError(f"step {step} was re-planned for {dp} ranks since rank "
                                       f"{rank} fetched it: fetch it again", Reason.REPLANNED)
                if len(ranks) + 1 < dp:  # durable before acknowledged (commit())
                    self._log({"t": "rank", "step": step, "rank": rank}, sync=False)
                ranks.add(rank)
                self.clients[rank] = (time.monotonic(), step)
                if len(ranks) < dp:
                    return {"step": step, "committed": False, "ranks": len(ranks), "dp": dp}
            self._log({"t": "commit", "step": step, "fp": prints}, sync=False)
            self.state.apply({"t": "commit", "step": step, "fp": prints})
            for s in [s for s in self.served if s < self.state.next_step]:
                del self.served[s]
            if self.state.next_step - self.last_snapshot >= self.config.snapshot_every:
                self._write_snapshot()
            self.state.plan_through(self._horizon())
            return {"step": step, "committed": True, "next_step": self.state.next_step}

    def snapshot(self, step: int | None = None) -> dict:
        with self.lock:
            if step is not None and step != self.state.next_step:
                raise RequestError(f"step {step}: only the next step to train "
                                   f"({self.state.next_step}) can be snapshotted", Reason.INVALID)
            path = self._write_snapshot()
            return {"step": self.state.next_step, "path": str(path)}

    def reload(self, spec: str) -> dict:
        """Apply the mixing spec at ``spec`` (a path on the plane's host) from the first window
        no rank has seen. Only a regular file under ``spec_root`` of at most MAX_SPEC_BYTES is
        read, outside the lock; errors name the file and field, never its contents."""
        path, text, new = read_reload_spec(self.spec_root, spec)
        with self.lock:
            old = self.state.spec.accounting
            if new.accounting != old:
                raise RequestError(f"{path}: accounting cannot change during a run "
                                   f"({old} -> {new.accounting})", Reason.SPEC)
            ref = self._spec_ref(text, path)
            k = self._rewind_to_next_unserved()
            self.state.reloads.append([k, ref])
            self._change(f"reload {path}", {"t": "reload", "window": k, "spec": ref}, k)
            return {"applies_at_step": k * self.config.window, "spec": str(path)}

    def _rewind_to_next_unserved(self) -> int:
        """The first window no rank has seen; windows from it that were drawn ahead are
        dropped, to be drawn again under whatever changes now (a reload, new costs)."""
        W = self.config.window
        k = max(self.state.next_step // W, self.served_max // W) + 1
        self.state.rewind_to(k)
        return k

    def set_costs(self, linear: float, quadratic: float) -> dict:
        """A refitted cost model ``c = linear·L + quadratic·L²`` (only the ratio matters to the
        planner) for the windows no rank has seen yet; logged, so a restart or an audit
        replays the same plans."""
        with self.lock:
            check_costs(linear, quadratic)
            k = self._rewind_to_next_unserved()
            self.state.cost_changes.append([k, float(linear), float(quadratic)])
            self._change("costs", {"t": "costs", "window": k, "linear": float(linear),
                                   "quadratic": float(quadratic)}, k)
            return {"applies_at_step": k * self.config.window}

    def report_corrupt(self, step: int, rank: int, source: str, shard: str, key: str,
                       reason: str, epoch: int = 0) -> dict:
        """A sample of ``rank``'s plan of ``step`` does not decode: quarantine it and
        return a replacement from the same source (``replacement``: a ref as JSON, "" when the
        source has none left). Journaled before acknowledged; see :mod:`dataplane.corrupt`."""
        with self.lock:
            self._check_step(step, "report_corrupt")
            self._check_planned(step, "step {step} was never planned")
            if not (0 <= rank < self.state.dp_at(step) and (source, shard, key, epoch)
                    in self.state.plan_samples(step, (rank,))):
                raise RequestError(f"{source}/{key} ({shard}, epoch {epoch}) is not in rank "
                                   f"{rank}'s plan of step {step}", Reason.UNKNOWN_SAMPLE)
            event = self.state.corrupt.find(step, source, shard, key, epoch)
            if event is None:  # the replacement must fit where the planned sample was
                window, local = self.state.window_of(step)
                room = replacement_room(
                    window.plans[local], window.refs, window.samples.tokens_N,
                    self.state.corrupt.planned_sample(step, (source, shard, key, epoch)),
                    self.config.micro_batch_tokens, self.state.corrupt.occupants(step))
                ref = draw_replacement(self.state.mixer.catalog, source, shard, key, room)
                event = {"t": "corrupt", "step": step, "rank": rank, "source": source,
                         "shard": shard, "key": key, "epoch": epoch,
                         "reason": " ".join(str(reason).split())[:500],
                         "before_window": self.state.next_window, "replacement": ref_to_json(ref),
                         "max_tokens": room}
                self._log(event)
                self.state.corrupt.record(event, applied=True)
                log.warning("corrupt sample %s/%s (step %d, rank %d): %s", source, key, step,
                            rank, event["reason"])
            return {"step": step, "source": source, "key": key,
                    "replacement": event["replacement"]}

    def report_suspect(self, step: int, samples: list, reason: str) -> dict:
        """The trainer did not apply ``step`` (``tools.train.guard``: a non-finite or spiking
        loss): its ``samples`` ({source, shard, key, epoch} each) are suspect -- kept in the
        state dir, quarantined from later epochs, listed by status. Journaled before
        acknowledged, idempotent per step; see :mod:`dataplane.suspect`."""
        with self.lock:
            self._check_step(step, "report_suspect")
            self._check_planned(step, "step {step} was never planned")
            event = self.state.suspects.find(step)
            if event is None:
                wanted = sorted({suspect_sample(s) for s in samples})
                known = self.state.plan_samples(step, range(self.state.dp_at(step)))
                unknown = [s for s in wanted if s not in known]
                if unknown or not wanted:
                    what = "/".join(map(str, unknown[0][::2])) if unknown else "no samples"
                    raise RequestError(f"report_suspect: {what} is not in step {step}'s plans",
                                       Reason.UNKNOWN_SAMPLE)
                event = {"t": "suspect", "step": step,
                         "samples": [dict(zip(("source", "shard", "key", "epoch"), s))
                                     for s in wanted],
                         "reason": " ".join(str(reason).split())[:500],
                         "before_window": self.state.next_window}
                self._log(event)
                self.state.suspects.record(event, self.state.mixer.catalog)
                log.warning("step %d not applied by the trainer (%s): its %d samples are "
                            "suspect, quarantined", step, event["reason"], len(wanted))
            return {"step": step, "samples": len(event["samples"])}

    def set_speeds(self, step: int, speeds: list, from_step: int | None = None) -> dict:
        """The data ranks' relative speeds as the trainer measured them up to ``step``
        (``tools.train.rank_speeds``; ``[]``: equal again). From the first step no rank has
        been served, plans give each rank work in proportion to its speed (the planner; a
        baseline is placed as before and only reported with them); logged, so a restart or an
        audit replays the same plans (``plane_state.PlaneState.respeed_from``).

        ``from_step``: the first step no rank has *started*, which the trainer vouches for
        (every rank waits for the reply before it takes that step's batch, and its loader then
        drops what it fetched of it and later: ``StepLoader.replan_from``). The speeds then
        apply from there -- within a step of being measured instead of after every plan the
        loaders fetched ahead. Not once a rank may have been told the mixture ends (its loader
        could not fetch again): then, as without it, from the first step not served."""
        with self.lock:
            check_speeds(step, speeds)
            at = max(self.state.next_step, self.served_max + 1)
            if from_step is not None:
                started = max((s for s, ranks in self.state.rank_commits.items() if ranks),
                              default=self.state.next_step - 1)
                if from_step <= max(started, self.state.next_step - 1):
                    raise RequestError(f"speeds: from_step {from_step} is committed by a rank "
                                       f"already (the next step to train is "
                                       f"{self.state.next_step})", Reason.INVALID)
                if self.state.exhausted_at is None:
                    at = min(at, from_step)
            dp = self.state.dp_at(at)
            if speeds and len(speeds) != dp:
                raise RequestError(f"speeds: {len(speeds)} speeds for step {at}, which is "
                                   f"planned for {dp} data ranks", Reason.INVALID)
            top = max(speeds, default=1.0)
            relative = [round(v / top, 4) for v in speeds]  # the fastest is 1
            self.state.respeed_from(at, relative)
            for s in [s for s in self.served if s >= at]:  # served before: fetched again
                del self.served[s]
            try:
                self.state.plan_through(self._horizon())
            except Exception as e:  # noqa: BLE001 -- whatever broke, the change is refused
                self._reopen()
                raise RequestError(f"speeds: refused, step {at} does not plan with them "
                                   f"({_one_line(e)})", Reason.UNPLANNABLE) from None
            try:
                self._log({"t": "speeds", "step": at, "speeds": relative, "as_of": step})
            except BaseException:
                self._reopen()
                raise
            log.info("rank speeds from step %d (measured to step %d): %s", at, step,
                     ", ".join(f"{v:.2f}" for v in relative) or "equal")
            return {"applies_at_step": at, "speeds": relative}

    def report_stragglers(self, step: int, ranks: list, slowdown: list) -> dict:
        """The trainer's stragglers as of ``step`` (``tools.train.stragglers``): data ranks
        computing much slower than their plans predict, each with its slowdown; ``[]`` once
        they recovered. Kept in memory for status and never journaled: an observation of the
        hardware, not plane state -- a restart or an audit plans the same without it, and
        the trainer reports again when the set changes."""
        with self.lock:
            check_stragglers(step, ranks, slowdown)
            order = sorted(range(len(ranks)), key=ranks.__getitem__)
            self.stragglers = {"ranks": [ranks[i] for i in order], "step": step,
                               "slowdown": [slowdown[i] for i in order]}
            if ranks:
                log.info("stragglers as of step %d: data rank(s) %s", step,
                            ", ".join(map(str, self.stragglers["ranks"])))
            return {"step": step, "ranks": len(ranks)}

    def status(self) -> dict:
        """Mixture, progress, balance, clients, snapshots: see :mod:`dataplane.status`."""
        with self.lock:
            status = plane_status(self, time.monotonic())
            for row in status["sources"]:
                row["corrupt_reported"] = self.state.corrupt.counts.get(row["source"], 0)
            status["corrupt_recent"] = list(self.state.corrupt.recent)
            status["suspect"] = self.state.suspects.status()
            status["stragglers"] = dict(self.stragglers)
            changes = self.state.speed_changes
            status["rank_speeds"] = {"step": changes[-1][0], "speeds": changes[-1][1]} \
                if changes else None
            if self.ray_namespace is not None:  # trainers' decoding pools go there too
                status["ray_namespace"] = self.ray_namespace
            return status

    def reports(self, kind: str) -> dict:
        """Every ``kind`` record of the log (``corrupt``, ``suspect``: the reports a launcher
        lists after a run, all of them -- status keeps only the latest). Read off the plane's
        lock, as :meth:`audit`: records are appended whole, and one being written is not
        read yet."""
        if kind not in REPORT_KINDS:
            raise RequestError(f"reports: kind must be one of {', '.join(REPORT_KINDS)}, got "
                               f"{kind!r}", Reason.INVALID)
        return {"kind": kind, "records": [r for _, r in self.journal.records() if r["t"] == kind]}

    def audit(self) -> dict:
        """Replays the log from its start on a state of its own: off the plane's lock, so a
        long audit does not stall fetches and commits."""
        from omniscale.dataplane.audit import audit_state_dir

        return audit_state_dir(self.journal.dir)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__
