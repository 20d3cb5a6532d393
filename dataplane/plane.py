"""The data plane: one per job; owns the mixture, plans every step for every rank, and
remembers what was trained, so that nothing is lost or repeated across crashes and resizes.

Steps are grouped into windows of W global batches (window k = steps kW … kW+W-1). A window
is drawn from the mixer and planned by the balancer as a whole, ahead of the trainers, so a
``get_plan`` is a lookup. Everything is deterministic from (spec, seed, mixer state at the
window's start, ranks), which is what the journal relies on: it stores that state at a window
start (snapshots) and the events since (commits, reloads, resizes), never the plans.

Elasticity: a restore with a different number of ranks keeps the global batches; the steps of
the current window not yet committed are re-planned onto the new ranks (windows.replan_tail)
and later windows are planned for them from the start.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

from balancer.cost import Costs
from balancer.planner import plan_window
from dataplane.catalog import Catalog
from dataplane.corrupt import (CorruptLedger, draw_replacement, ref_to_json,
                               replacement_room)
from dataplane.errors import UserError
from dataplane.journal import Journal
from dataplane.mixer import Mixer, MixtureExhausted
from dataplane.plane_config import PlaneConfig  # noqa: F401  (public here too)
from dataplane.plan_table import fingerprint, rank_tables
from dataplane.server import RequestError
from dataplane.spec import MixSpec, load_spec
from dataplane.status import plane_status
from dataplane.windows import Window, window_samples

log = logging.getLogger(__name__)


class DataPlane:
    """Implements dataplane.server.PlaneService. Thread-safe: one lock around the state."""

    def __init__(self, spec: str | Path | None, state_dir: str | Path, config: PlaneConfig,
                 restore_step: int | None = None, readonly: bool = False):
        """Start fresh from ``spec`` or, when ``state_dir`` has snapshots, carry on from the
        latest (replaying the log after it) -- or from ``restore_step``'s snapshot, rolling the
        log back to it (a trainer resuming from its checkpoint of that step). ``readonly``:
        write nothing and replay nothing (audits replay the log themselves)."""
        self.config = config
        self.readonly = readonly
        self.costs = Costs.from_llm(config.cost_linear, config.cost_quadratic)
        self.journal = Journal(state_dir)
        self.lock = threading.RLock()
        self.windows: dict[int, Window] = {}
        self.rank_commits: dict[int, set[int]] = {}
        self.committed: set[int] = set()
        self.served_max = -1
        self.exhausted_at: int | None = None
        self.clients: dict[int, tuple[float, int]] = {}  # rank -> (monotonic time, step)
        snapshot = self.journal.load_snapshot(restore_step)
        if snapshot is None:
            if spec is None:
                raise UserError(f"{state_dir}: no snapshot to restore and no --spec to start")
            self._start_fresh(Path(spec).resolve())
        else:
            self._restore(snapshot, rolled_back=restore_step is not None)
        if readonly:
            return
        self._ensure_planned(self.next_step + config.window * (1 + config.plan_ahead) - 1)

    # -- start, restore, persist ------------------------------------------------------------
    def _start_fresh(self, spec_path: Path) -> None:
        self.spec_path = str(spec_path)
        self.spec = load_spec(spec_path)
        self.cap = self.config.sample_cap  # fixed for the job: plans must not depend on dp
        self.mixer = self._mixer(self.spec)
        self.next_window, self.next_step = 0, 0
        self.dp_changes: list[list[int]] = [[0, self.config.dp]]
        self.reloads: list[list] = []  # [window, spec path], in order
        # [window, cost_linear, cost_quadratic]: refits of the cost model (a trainer's measured
        # step times), applied from that window on, in order; in the log, so replays agree.
        self.cost_changes: list[list] = []
        self.window_costs = {0: self._cost_pair()}
        self.committed_fps: dict[int, list[str]] = {}
        self.window_states = {0: _copy(self.mixer.state_dict())}
        self.window_specs = {0: self.spec_path}
        self.corrupt = CorruptLedger()
        self.last_snapshot = -1
        self._write_snapshot()  # step 0: where audits start their replay

    def _restore(self, snap: dict, rolled_back: bool) -> None:
        step, k = int(snap["step"]), int(snap["window"])
        if snap["window_size"] != self.config.window:
            raise UserError(f"--window {self.config.window}: the state dir was planned with "
                            f"windows of {snap['window_size']} steps")
        self.spec_path = snap["spec"]
        self.spec = load_spec(self.spec_path)
        self.cap = int(snap["sample_cap"])
        self.mixer = self._mixer(self.spec)
        self.mixer.load_state_dict(snap["window_state"])
        self.next_window, self.next_step = k, step
        self.committed = set(snap["committed_ahead"])
        self.rank_commits = {int(s): set(r) for s, r in snap.get("rank_commits", {}).items()}
        self.dp_changes = [list(c) for c in snap["dp_changes"]]
        self.reloads = [list(r) for r in snap["reloads"]]
        self.cost_changes = [list(c) for c in snap.get("cost_changes", [])]
        self.committed_fps = {int(s): list(f) for s, f in snap.get("committed_fps", {}).items()}
        if "costs" in snap:
            self.costs = Costs.from_llm(*snap["costs"])
        self.window_costs = {k: self._cost_pair()}
        self.window_states = {k: _copy(snap["window_state"])}
        self.window_specs = {k: self.spec_path}
        self.corrupt = CorruptLedger.from_state(snap.get("corrupt"))
        self.last_snapshot = step
        if self.readonly:
            return
        if rolled_back:
            kept = self.journal.roll_back(snap["wal_offset"])
            self._retire_snapshots_after(step)
            if kept:
                log.warning("restored step %d: later log records moved to %s", step, kept)
        else:
            for record in self.journal.records(snap["wal_offset"]):
                self._replay(record)
        if self.dp_at(self.next_step) != self.config.dp:
            hold = self.config.micro_batch_tokens * min(
                self.config.sp_max, 1 << (self.config.dp.bit_length() - 1))
            if hold < self.cap:
                raise UserError(
                    f"--dp {self.config.dp}: this job plans samples of up to {self.cap} tokens, "
                    f"more than {self.config.dp} rank(s) can hold with --micro-batch-tokens "
                    f"{self.config.micro_batch_tokens} and --sp-max {self.config.sp_max}")
            self._change_dp(self.next_step, self.config.dp)

    def _replay(self, record: dict) -> None:
        kind = record["t"]
        if kind == "commit":
            self.rank_commits.pop(record["step"], None)
            self._remember_fps(record["step"], record["fp"])
            self._mark_committed(record["step"])
        elif kind == "rank":
            self.rank_commits.setdefault(record["step"], set()).add(record["rank"])
        elif kind == "reload":
            self.reloads.append([record["window"], record["spec"]])
        elif kind == "costs":
            self.cost_changes.append([record["window"], record["linear"], record["quadratic"]])
        elif kind == "dp":
            self._resize_from(record["step"], record["dp"])
        elif kind == "corrupt":
            self.corrupt.record(record, applied=False)

    def _change_dp(self, step: int, dp: int) -> None:
        log.warning("resizing: steps from %d are planned for %d ranks (were %d)", step, dp,
                    self.dp_at(step))
        self._resize_from(step, dp)
        self._log({"t": "dp", "step": step, "dp": dp})

    def _resize_from(self, step: int, dp: int) -> None:
        """Record the change and re-plan whatever is already drawn from ``step`` on."""
        self.dp_changes.append([step, dp])
        # Ranks' commits of re-planned steps were of plans that no longer exist: void them.
        self.rank_commits = {s: r for s, r in self.rank_commits.items() if s < step}
        for window in self.windows.values():
            window.resize(step, dp, self._costs_of(window.k), self.config)

    def _cost_pair(self) -> tuple[float, float]:
        return (self.costs.llm.alpha, self.costs.llm.beta)

    def _costs_of(self, k: int) -> Costs:
        """The cost model window ``k`` was planned with (a resize re-plans with the same)."""
        pair = self.window_costs.get(k)
        return Costs.from_llm(*pair) if pair is not None else self.costs

    def _log(self, record: dict, sync: bool = True) -> None:
        """Append to the log; with ``sync=False`` the caller makes it durable (``sync_to``)
        before it answers, outside the plane's lock."""
        if not self.readonly:
            self.journal.append(record, sync=sync)

    def _mixer(self, spec: MixSpec) -> Mixer:
        return Mixer.from_spec(spec, Catalog.from_spec(spec, max_tokens=self.cap),
                               **self.config.batch)

    def _retire_snapshots_after(self, step: int) -> None:
        aside = self.journal.snapshots / "rolled-back"
        for s in self.journal.snapshot_steps():
            if s > step:
                aside.mkdir(exist_ok=True)
                path = self.journal.snapshots / f"snap-{s:010d}.json"
                path.rename(aside / path.name)

    def _write_snapshot(self) -> Path | None:
        if self.readonly:
            return None
        step = self.next_step
        k = step // self.config.window
        self._ensure_state_of(k)
        # the log the snapshot follows must be on disk first (commits are synced after the
        # lock): a crash must not leave a snapshot whose wal_offset lies past the log's end
        self.journal.sync_to(self.journal.written)
        path = self.journal.write_snapshot({
            "step": step, "window": k, "window_size": self.config.window,
            "window_state": self.window_states[k], "spec": self.window_specs[k],
            "dp_changes": self.dp_changes, "reloads": [r for r in self.reloads if r[0] > k],
            "costs": list(self.window_costs.get(k, self._cost_pair())),
            "cost_changes": [c for c in self.cost_changes if c[0] > k],
            "committed_fps": {str(s): f for s, f in self.committed_fps.items()},
            "committed_ahead": sorted(s for s in self.committed if s >= step),
            "rank_commits": {str(s): sorted(r) for s, r in self.rank_commits.items()
                             if s >= step},
            "wal_offset": self.journal.size(), "config": asdict(self.config),
            "corrupt": self.corrupt.state(k),
            "sample_cap": self.cap})
        self.last_snapshot = step
        return path

    def _ensure_state_of(self, k: int) -> None:
        if k not in self.window_states:
            self._ensure_planned(k * self.config.window)

    # -- planning ---------------------------------------------------------------------------
    def dp_at(self, step: int) -> int:
        return [dp for s, dp in self.dp_changes if s <= step][-1]

    def _ensure_planned(self, step: int) -> None:
        """Draw and plan windows until ``step`` is planned or the data runs out."""
        while self.exhausted_at is None and self.next_window * self.config.window <= step:
            self._draw_window(self.next_window)

    def _draw_window(self, k: int) -> None:
        W = self.config.window
        for window, spec in self.reloads:
            if window == k and spec != self.spec_path:
                self._apply_reload(spec)
        for window, linear, quadratic in self.cost_changes:
            if window == k:
                self.costs = Costs.from_llm(linear, quadratic)
        self.window_costs[k] = self._cost_pair()
        self.corrupt.apply(self.mixer.catalog, k)  # reports that arrived before this window
        start = _copy(self.mixer.state_dict())
        self.window_states[k], self.window_specs[k] = start, self.spec_path
        batches = []
        for j in range(W):
            try:
                batches.append(self.mixer.next_batch(k * W + j))
            except MixtureExhausted:
                break
        self.next_window = k + 1
        if len(batches) < W:
            self.exhausted_at = k * W + len(batches)
            log.info("the mixture is exhausted: the last step is %d", self.exhausted_at - 1)
        if not batches:
            return
        samples = window_samples(batches, self.spec.media)
        first = k * W
        plans = plan_window(samples, self.costs, self.config.planner(self.dp_at(first),
                                                                      len(batches)))
        window = Window(k, first, start, self.spec_path, [r for b in batches for r in b],
                        samples, plans, [self.dp_at(first)] * len(plans))
        for step, dp in self.dp_changes:
            if first < step < window.end_step and dp != window.dp_of_step[step - first]:
                window.resize(step, dp, self.costs, self.config)
        self.windows[k] = window

    def _apply_reload(self, spec_path: str) -> None:
        new = load_spec(spec_path)
        state = self.mixer.state_dict()
        catalog = self.mixer.catalog
        mixer = Mixer(catalog, new.schedule, new.accounting, **self.config.batch)
        mixer.load_state_dict(state)
        for source in new.sources:
            if source.name not in catalog:
                catalog.add(source.name, source.path, source.on_exhausted)
        for name in list(catalog.names):
            if name not in new.source_names:
                catalog.remove(name)
        self.mixer, self.spec, self.spec_path = mixer, new, spec_path
        log.info("mixture reloaded from %s", spec_path)

    def _table(self, step: int, rank: int) -> pa.Table:
        window = self.windows[step // self.config.window]
        if (step, rank) not in window.tables:
            plan = window.plans[step - window.first_step]
            dp = window.dp_of_step[step - window.first_step]
            first_item_N = window.samples.item_offsets_N1[:-1]
            for r, table in enumerate(rank_tables(plan, window.refs, first_item_N, step, dp)):
                window.tables[(step, r)] = table
        return window.tables[(step, rank)]

    # -- the service ------------------------------------------------------------------------
    def get_plan(self, step: int, rank: int) -> pa.Table:
        with self.lock:
            self._check_step(step, "get_plan")
            dp = self.dp_at(step)
            if not 0 <= rank < dp:
                raise RequestError(f"rank {rank}: step {step} is planned for {dp} ranks "
                                   f"(0..{dp - 1})")
            self._ensure_planned(step)
            if self.exhausted_at is not None and step >= self.exhausted_at:
                raise RequestError(f"step {step}: the mixture is exhausted (the last step is "
                                   f"{self.exhausted_at - 1})")
            self.served_max = max(self.served_max, step)
            table = self._table(step, rank)
            self.clients[rank] = (time.monotonic(), step)  # for status: who is connected
            return table

    def _check_step(self, step: int, what: str) -> None:
        if step < 0:
            raise RequestError(f"step {step} is negative")
        if step < self.next_step or step in self.committed:
            raise RequestError(f"step {step} is already committed (the next step to "
                               f"train is {self.next_step})")
        horizon = (self.next_step // self.config.window + 1 + self.config.plan_ahead) \
            * self.config.window - 1
        if step > horizon:
            raise RequestError(f"step {step} is too far ahead: plans reach step "
                               f"{horizon} while step {self.next_step} is not committed")

    def commit(self, step: int, rank: int | None = None, plan_fp: str | None = None) -> dict:
        """Mark ``step`` trained, or only ``rank``'s share of it (the step is trained once
        every rank committed). A rank's commit is logged before it is acknowledged, so a
        plane restart does not forget it; ``plan_fp`` (the fingerprint of the plan the rank
        trained) makes the plane refuse a commit of a plan that was re-planned since.

        Group commit: the record is written under the lock and made durable after it, so the
        commits of many ranks arriving together share fsyncs (one each would serialise a
        step's commits behind the disk: ~5 ms × ranks on a slow one). The reply waits for
        everything written before it, a repeated commit's original record included."""
        reply = self._commit(step, rank, plan_fp)
        self.journal.sync_to(self.journal.written)
        return reply

    def _commit(self, step: int, rank: int | None, plan_fp: str | None) -> dict:
        with self.lock:
            repeated = self._repeated_commit(step, rank, plan_fp)
            if repeated is not None:
                return repeated
            self._check_step(step, "commit")
            self._ensure_planned(step)
            if self.exhausted_at is not None and step >= self.exhausted_at:
                raise RequestError(f"step {step} was never planned (the mixture is "
                                   f"exhausted after step {self.exhausted_at - 1})")
            dp = self.dp_at(step)
            if rank is not None:
                if not 0 <= rank < dp:
                    raise RequestError(f"rank {rank}: step {step} has {dp} ranks (0..{dp - 1})")
                ranks = self.rank_commits.setdefault(step, set())
                if rank in ranks:
                    raise RequestError(f"rank {rank} already committed step {step}")
                if plan_fp is not None and plan_fp != fingerprint(self._table(step, rank)):
                    raise RequestError(f"step {step} was re-planned for {dp} ranks since rank "
                                       f"{rank} fetched it: fetch it again")
                if len(ranks) + 1 < dp:  # durable before acknowledged (commit())
                    self._log({"t": "rank", "step": step, "rank": rank}, sync=False)
                ranks.add(rank)
                self.clients[rank] = (time.monotonic(), step)
                if len(ranks) < dp:
                    return {"step": step, "committed": False, "ranks": len(ranks), "dp": dp}
            prints = [fingerprint(self._table(step, r)) for r in range(dp)]
            self._log({"t": "commit", "step": step, "fp": prints}, sync=False)
            self._remember_fps(step, prints)
            self.rank_commits.pop(step, None)
            self._mark_committed(step)
            if self.next_step - self.last_snapshot >= self.config.snapshot_every:
                self._write_snapshot()
            self._ensure_planned(self.next_step + self.config.window
                                 * (1 + self.config.plan_ahead) - 1)
            return {"step": step, "committed": True, "next_step": self.next_step}

    def _repeated_commit(self, step: int, rank: int | None, plan_fp: str | None
                         ) -> dict | None:
        """The reply to a commit this plane already took from the same rank for the same
        plan: a client that lost the reply (the plane was killed after logging the commit,
        before answering) retries, and the retry must succeed, not fail as a duplicate."""
        if rank is None or plan_fp is None:
            return None
        done = self.committed_fps.get(step)
        if done is not None and rank < len(done) and done[rank] == plan_fp:
            return {"step": step, "committed": True, "next_step": self.next_step,
                    "repeated": True}
        ranks = self.rank_commits.get(step, set())
        if rank in ranks and step in self._planned_steps() and \
                plan_fp == fingerprint(self._table(step, rank)):
            return {"step": step, "committed": False, "ranks": len(ranks),
                    "dp": self.dp_at(step), "repeated": True}
        return None

    def _planned_steps(self) -> range:
        W = self.config.window
        return range(min(self.windows, default=0) * W, self.next_window * W)

    def _remember_fps(self, step: int, prints: list[str]) -> None:
        """Fingerprints of the recently committed steps (the last few windows): what a
        repeated commit is recognised by."""
        self.committed_fps[step] = list(prints)
        horizon = step - 4 * self.config.window
        for old in [s for s in self.committed_fps if s < horizon]:
            del self.committed_fps[old]

    def _mark_committed(self, step: int) -> None:
        self.committed.add(step)
        while self.next_step in self.committed:
            self.committed.discard(self.next_step)
            self.next_step += 1
        done = self.next_step // self.config.window
        for k in [k for k in self.windows if k < done - 1]:
            del self.windows[k]  # fully trained; its start state stays until a snapshot
        for k in [k for k in self.window_states if k < done - 1]:
            del self.window_states[k], self.window_specs[k]

    def snapshot(self, step: int | None = None) -> dict:
        with self.lock:
            if step is not None and step != self.next_step:
                raise RequestError(f"step {step}: only the next step to train "
                                   f"({self.next_step}) can be snapshotted")
            path = self._write_snapshot()
            return {"step": self.next_step, "path": str(path)}

    def reload(self, spec: str) -> dict:
        with self.lock:
            try:
                new = load_spec(spec)
            except UserError as e:
                raise RequestError(str(e)) from None
            if new.accounting != self.spec.accounting:
                raise RequestError(f"{spec}: accounting cannot change during a run "
                                   f"({self.spec.accounting} -> {new.accounting})")
            k = self._rewind_to_next_unserved()
            path = str(Path(spec).resolve())
            self.reloads.append([k, path])
            self._log({"t": "reload", "window": k, "spec": path})
            return {"applies_at_step": k * self.config.window, "spec": path}

    def _rewind_to_next_unserved(self) -> int:
        """The first window no rank has seen; windows from it that were drawn ahead are
        dropped, to be drawn again under whatever changes now (a reload, new costs)."""
        W = self.config.window
        k = max(self.next_step // W, self.served_max // W) + 1
        for j in [j for j in self.windows if j >= k]:
            del self.windows[j]
        if k < self.next_window:  # drawn ahead but never served: draw again
            self.spec, self.spec_path = load_spec(self.window_specs[k]), self.window_specs[k]
            self.mixer = self._mixer(self.spec)
            self.mixer.load_state_dict(self.window_states[k])
            self.costs = self._costs_of(k)
            self.next_window, self.exhausted_at = k, None
            self.corrupt.unapply_after(k)
        return k

    def set_costs(self, linear: float, quadratic: float) -> dict:
        """A refitted cost model ``c = linear·L + quadratic·L²`` (only the ratio matters to the
        planner) for the windows no rank has seen yet; logged, so a restart or an audit
        replays the same plans."""
        with self.lock:
            values = (linear, quadratic)
            if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                       for v in values) or not any(values):
                raise RequestError(f"costs: linear and quadratic must be finite, >= 0 and not "
                                   f"both 0, got {linear!r}, {quadratic!r}")
            k = self._rewind_to_next_unserved()
            self.cost_changes.append([k, float(linear), float(quadratic)])
            self._log({"t": "costs", "window": k, "linear": float(linear),
                       "quadratic": float(quadratic)})
            return {"applies_at_step": k * self.config.window}

    def report_corrupt(self, step: int, rank: int, source: str, shard: str, key: str,
                       reason: str, epoch: int = 0) -> dict:
        """A sample of ``rank``'s plan of ``step`` does not decode: quarantine it and
        return a replacement from the same source (``replacement``: a ref as JSON, "" when the
        source has none left). Journaled before acknowledged; see :mod:`dataplane.corrupt`."""
        with self.lock:
            self._check_step(step, "report_corrupt")
            self._ensure_planned(step)
            if self.exhausted_at is not None and step >= self.exhausted_at:
                raise RequestError(f"step {step} was never planned")
            table = self._table(step, rank) if 0 <= rank < self.dp_at(step) else None
            known = set() if table is None else set(zip(*(
                table.column(c).to_pylist() for c in ("source", "shard", "key", "epoch"))))
            known |= {(*r.uid, r.epoch) for _, r in self.corrupt.replaced_at(step)
                      if r is not None}  # a replacement may be bad too
            if table is None or (source, shard, key, epoch) not in known:
                raise RequestError(f"{source}/{key} ({shard}, epoch {epoch}) is not in rank "
                                   f"{rank}'s plan of step {step}")
            event = self.corrupt.find(step, source, shard, key, epoch)
            if event is None:  # the replacement must fit where the planned sample was
                window = self.windows[step // self.config.window]
                room = replacement_room(
                    window.plans[step - window.first_step], window.refs,
                    window.samples.tokens_N,
                    self.corrupt.planned_sample(step, (source, shard, key, epoch)),
                    self.config.micro_batch_tokens, self.corrupt.occupants(step))
                ref = draw_replacement(self.mixer.catalog, source, shard, key, room)
                event = {"t": "corrupt", "step": step, "rank": rank, "source": source,
                         "shard": shard, "key": key, "epoch": epoch,
                         "reason": " ".join(str(reason).split()),
                         "before_window": self.next_window, "replacement": ref_to_json(ref),
                         "max_tokens": room}
                self._log(event)
                self.corrupt.record(event, applied=True)
                log.warning("corrupt sample %s/%s (step %d, rank %d): %s", source, key, step,
                            rank, event["reason"])
            return {"step": step, "source": source, "key": key,
                    "replacement": event["replacement"]}

    def status(self) -> dict:
        """Mixture, progress, balance, clients, snapshots: see :mod:`dataplane.status`."""
        with self.lock:
            status = plane_status(self, time.monotonic())
            for row in status["sources"]:
                row["corrupt_reported"] = self.corrupt.counts.get(row["source"], 0)
            status["corrupt_recent"] = list(self.corrupt.recent)
            return status

    def audit(self) -> dict:
        from dataplane.audit import audit_state_dir

        with self.lock:
            return audit_state_dir(self.journal.dir, self.config)


def _copy(state: dict) -> dict:
    """A deep, JSON-clean copy (states go into snapshots verbatim)."""
    return json.loads(json.dumps(state))
