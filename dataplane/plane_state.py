"""The plane's state machine: what the log's records do, and nothing else.

Steps are grouped into windows of W global batches (window k = steps kW … kW+W-1). A window
is drawn from the mixer and planned by the balancer as a whole, ahead of the trainers.
Everything is deterministic from (spec, seed, mixer state at the window's start, ranks, cost
model), which is what the journal relies on: it stores that state at a window start (a
:class:`WindowStart`, in snapshots) and the records since, never the plans.

:class:`PlaneState` is built from the log's ``start`` record (:meth:`PlaneState.fresh`) or a
snapshot (:meth:`PlaneState.from_snapshot`) and advanced one record at a time by
:meth:`PlaneState.apply` -- the public replay API the plane's restart, ``plane audit`` and the
benchmarks share. It takes no locks and writes nothing: :class:`dataplane.plane.DataPlane`
adds the service (validation, the log, locking) around it.

Elasticity: a change of the number of ranks keeps the global batches; the steps of a drawn
window not yet committed are re-planned onto the new ranks (windows.replan_tail) and later
windows are planned for them from the start.

Rank speeds (``speeds`` records, the trainer's measurements): from their step on, the ranks'
relative speeds the planner gives work by. A window is drawn with the speeds in force before
its first step; a change at a step inside it re-plans its tail from there (each step keeps its
samples), so a slowed rank gets less work within a step or two, not a window later. The same
rule drawing live and replaying the log gives the same plans.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from omniscale.balancer.cost import Costs
from omniscale.dataplane.catalog import Catalog
from omniscale.dataplane.corrupt import CorruptLedger
from omniscale.dataplane.gc_pause import collector_paused
from omniscale.dataplane.journal import Journal
from omniscale.dataplane.mixer import Mixer, MixtureExhausted
from omniscale.dataplane.plan_table import window_rank_tables
from omniscale.dataplane.plane_config import PlaneConfig
from omniscale.dataplane.spec import MixSpec, spec_from_text
from omniscale.dataplane.suspect import SuspectLedger
from omniscale.dataplane.windows import Window, best_baseline, plan_policy, window_samples
from omniscale.plan import fingerprint, step_fingerprint
from omniscale.refs import RefTable

log = logging.getLogger(__name__)

RECORD_KINDS = ("start", "commit", "rank", "reload", "costs", "dp", "corrupt", "suspect",
                "speeds")


@dataclass
class WindowStart:
    """Everything a window's draw starts from: the mixer's state, the spec and the cost model
    in force (after the reloads, refits and corrupt reports that apply at this window)."""

    mixer_state: dict
    spec: dict  # a spec ref: {sha256, root, file} (the copy in the state dir's specs/)
    costs: tuple[float, float]

    def to_json(self) -> dict:
        return {"mixer_state": self.mixer_state, "spec": self.spec, "costs": list(self.costs)}

    @classmethod
    def from_json(cls, d: dict) -> "WindowStart":
        return cls(d["mixer_state"], d["spec"], tuple(d["costs"]))


class PlaneState:
    """The deterministic part of a plane; see the module docstring."""

    def __init__(self, config: PlaneConfig, store: Journal, cap: int, spec_ref: dict):
        self.config, self.store, self.cap = config, store, cap
        self._mix_from(spec_ref)
        self.costs = config.cost_model(config.cost_linear, config.cost_quadratic)
        self.next_window = self.next_step = 0
        self.exhausted_at: int | None = None
        self.windows: dict[int, Window] = {}
        self.starts: dict[int, WindowStart] = {}
        self.committed: set[int] = set()  # committed steps past next_step
        self.rank_commits: dict[int, set[int]] = {}
        self.committed_fps: dict[int, list[str]] = {}
        self.dp_changes: list[list[int]] = [[0, config.dp]]
        # [step, speeds or None (equal)]: the ranks' relative speeds from that step on (from
        # step 0 those the config knows ahead)
        self.speed_changes: list[list] = [] if config.rank_speed is None \
            else [[0, list(config.rank_speed)]]
        self.reloads: list[list] = []  # [window, spec ref], in order
        # [window, linear, quadratic]: refits of the cost model, applied from that window on.
        self.cost_changes: list[list] = []
        self.corrupt = CorruptLedger()
        self.suspects = SuspectLedger()

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def fresh(cls, start: dict, store: Journal, config: PlaneConfig | None = None
              ) -> "PlaneState":
        """The state at step 0 from the log's ``start`` record (``config``: this run's
        settings, which may differ from the start's in dp only)."""
        state = cls(config or PlaneConfig(**start["config"]), store, int(start["sample_cap"]),
                    start["spec"])
        state.dp_changes = [[0, int(start["config"]["dp"])]]
        return state

    @classmethod
    def from_snapshot(cls, snap: dict, store: Journal, config: PlaneConfig) -> "PlaneState":
        k = int(snap["window"])
        start = WindowStart.from_json(snap["start"])
        state = cls(config, store, int(snap["sample_cap"]), start.spec)
        state.mixer.load_state_dict(start.mixer_state)
        state.costs = config.cost_model(*start.costs)
        state.next_window, state.next_step = k, int(snap["step"])
        state.starts = {k: start}
        state.committed = set(snap["committed_ahead"])
        state.rank_commits = {int(s): set(r) for s, r in snap["rank_commits"].items()}
        state.committed_fps = {int(s): list(f) for s, f in snap["committed_fps"].items()}
        state.dp_changes = [list(c) for c in snap["dp_changes"]]
        state.speed_changes = [list(c) for c in snap.get("speed_changes", [])]  # older: none
        state.reloads = [list(r) for r in snap["reloads"]]
        state.cost_changes = [list(c) for c in snap["cost_changes"]]
        state.corrupt = CorruptLedger.from_state(snap["corrupt"])
        state.suspects = SuspectLedger.from_state(snap.get("suspect"), k)  # older: none
        return state

    def snapshot_body(self, wal_offset: int) -> dict:
        """What :meth:`from_snapshot` needs to stand at ``next_step`` again: the start of its
        window and the changes that apply from a later window."""
        step = self.next_step
        k = step // self.config.window
        if k not in self.starts:
            self.plan_through(k * self.config.window)
        return {
            "step": step, "window": k, "window_size": self.config.window,
            "start": self.starts[k].to_json(), "sample_cap": self.cap,
            "dp_changes": self.dp_changes, "speed_changes": self.speed_changes,
            "reloads": [r for r in self.reloads if r[0] > k],
            "cost_changes": [c for c in self.cost_changes if c[0] > k],
            "committed_fps": {str(s): f for s, f in self.committed_fps.items()},
            "committed_ahead": sorted(s for s in self.committed if s >= step),
            "rank_commits": {str(s): sorted(r) for s, r in self.rank_commits.items()
                             if s >= step},
            "wal_offset": wal_offset, "config": asdict(self.config),
            "corrupt": self.corrupt.state(k), "suspect": self.suspects.state()}

    def _mix_from(self, spec_ref: dict, mixer_state: dict | None = None) -> None:
        """A new mixer (and catalog) for the spec ``spec_ref``, at ``mixer_state`` if given."""
        self.spec_ref, self.spec = spec_ref, self.load_spec(spec_ref)
        self.mixer = Mixer.from_spec(self.spec, Catalog.from_spec(self.spec, max_tokens=self.cap),
                                     **self.config.batch)
        if mixer_state is not None:
            self.mixer.load_state_dict(mixer_state)

    def load_spec(self, ref: dict) -> MixSpec:
        """A spec the plane applied, from its copy in the state dir."""
        return spec_from_text(self.store.spec_text(ref["sha256"]), ref["file"],
                              root=Path(ref["root"]))

    # -- replay ---------------------------------------------------------------------------
    def apply(self, record: dict) -> None:
        """Advance by one logged record (a restart's or an audit's replay)."""
        kind = record["t"]
        if kind == "commit":
            self.rank_commits.pop(record["step"], None)
            self.remember_fps(record["step"], record["fp"])
            self.mark_committed(record["step"])
        elif kind == "rank":
            self.rank_commits.setdefault(record["step"], set()).add(record["rank"])
        elif kind == "reload":
            self.reloads.append([record["window"], record["spec"]])
        elif kind == "costs":
            self.cost_changes.append([record["window"], record["linear"], record["quadratic"]])
        elif kind == "dp":
            self.resize_from(record["step"], record["dp"])
        elif kind == "speeds":
            self.respeed_from(record["step"], record["speeds"])
        elif kind == "corrupt":
            self.corrupt.record(record, applied=False)
        elif kind == "suspect":
            self.suspects.record(record)
        elif kind == "start":
            raise ValueError("a second start record")
        else:
            raise ValueError(f"unknown record kind {kind!r}")

    def remember_fps(self, step: int, prints: list[str]) -> None:
        """Fingerprints of the recently committed steps (the last few windows): what a
        repeated commit is recognised by."""
        self.committed_fps[step] = list(prints)
        horizon = step - 4 * self.config.window
        for old in [s for s in self.committed_fps if s < horizon]:
            del self.committed_fps[old]

    def mark_committed(self, step: int) -> None:
        self.committed.add(step)
        while self.next_step in self.committed:
            self.committed.discard(self.next_step)
            self.next_step += 1
        done = self.next_step // self.config.window
        for k in [k for k in self.windows if k < done - 1]:
            del self.windows[k]  # fully trained; its start stays until a snapshot
        for k in [k for k in self.starts if k < done - 1]:
            del self.starts[k]

    def resize_from(self, step: int, dp: int) -> None:
        """Record the change and re-plan whatever is already drawn from ``step`` on."""
        self.dp_changes.append([step, dp])
        # Ranks' commits of re-planned steps were of plans that no longer exist: void them.
        self.rank_commits = {s: r for s, r in self.rank_commits.items() if s < step}
        for window in self.windows.values():
            window.resize(step, dp, self.costs_of(window.k), self.config,
                          self.speeds_at(step, dp))

    def respeed_from(self, step: int, speeds: list[float] | None) -> None:
        """The ranks' speeds from ``step`` on (module docstring): the drawn window holding it
        re-plans its tail from ``step``, later drawn windows are drawn again."""
        self.speed_changes.append([step, None if not speeds else [float(v) for v in speeds]])
        k = step // self.config.window
        window = self.windows.get(k)
        if window is not None and step < window.end_step:
            window.resize(step, self.dp_at(step), self.costs_of(k), self.config,
                          self.speeds_at(step, self.dp_at(step)))
        if k + 1 < self.next_window:
            self.rewind_to(k + 1)

    # -- planning -------------------------------------------------------------------------
    def dp_at(self, step: int) -> int:
        return [dp for s, dp in self.dp_changes if s <= step][-1]

    def speeds_at(self, step: int, dp: int, before: bool = False) -> tuple[float, ...] | None:
        """The ranks' relative speeds in force at ``step`` (``before``: set before it), None
        when equal or measured for another number of ranks than ``dp``."""
        now = [v for s, v in self.speed_changes if (s < step if before else s <= step)]
        return tuple(now[-1]) if now and now[-1] is not None and len(now[-1]) == dp else None

    def costs_of(self, k: int) -> Costs:
        """The cost model window ``k`` was planned with (a resize re-plans with the same)."""
        start = self.starts.get(k)
        return self.config.cost_model(*start.costs) if start is not None else self.costs

    def plan_through(self, step: int) -> None:
        """Draw and plan windows until ``step`` is planned or the data runs out."""
        while self.exhausted_at is None and self.next_window * self.config.window <= step:
            self._draw_window(self.next_window)

    def _draw_window(self, k: int) -> None:
        with collector_paused():
            self._draw_window_now(k)

    def _draw_window_now(self, k: int) -> None:
        W = self.config.window
        for window, ref in self.reloads:
            if window == k and ref != self.spec_ref:
                self._apply_reload(ref)
        for window, linear, quadratic in self.cost_changes:
            if window == k:
                self.costs = self.config.cost_model(linear, quadratic)
        self.corrupt.apply(self.mixer.catalog, k)  # reports that arrived before this window
        self.suspects.apply(self.mixer.catalog, k)
        start = WindowStart(_copy(self.mixer.state_dict()), self.spec_ref,
                            (self.costs.llm.alpha, self.costs.llm.beta))
        self.starts[k] = start
        batches = []
        for j in range(W):
            try:
                batches.append(self.mixer.next_batch_table(k * W + j))
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
        dp = self.dp_at(first)
        plans = plan_policy(samples, self.costs,
                            self.config.planner(dp, len(batches),
                                                self.speeds_at(first, dp, before=True)),
                            self.config.policy_of(k))
        window = Window(k, first, start.mixer_state, self.spec_ref,
                        RefTable(pa.concat_tables(batches)), samples, plans, [dp] * len(plans))
        respeeds = {s for s, _ in self.speed_changes if first <= s < window.end_step}
        for step in sorted(respeeds | {s for s, _ in self.dp_changes
                                       if first < s < window.end_step}):
            dp = self.dp_at(step)
            if step in respeeds or dp != window.dp_of_step[step - first]:
                window.resize(step, dp, self.costs, self.config, self.speeds_at(step, dp))
        self.windows[k] = window

    def _apply_reload(self, ref: dict) -> None:
        new = self.load_spec(ref)
        state = self.mixer.state_dict()
        catalog = self.mixer.catalog
        mixer = Mixer(catalog, new.schedule, new.accounting, **self.config.batch)
        mixer.load_state_dict(state)
        for source in new.sources:
            if source.name not in catalog:
                catalog.add(source.name, source.index, source.on_exhausted)
        for name in list(catalog.names):
            if name not in new.source_names:
                catalog.remove(name)
        self.mixer, self.spec, self.spec_ref = mixer, new, ref
        log.info("mixture reloaded from %s", ref["file"])

    def rewind_to(self, k: int) -> None:
        """Drop windows from ``k`` on (drawn ahead, never served) to draw them again under
        whatever changes now (a reload, new costs)."""
        for j in [j for j in self.windows if j >= k]:
            del self.windows[j]
        if k < self.next_window:
            start = self.starts[k]
            self._mix_from(start.spec, start.mixer_state)
            self.costs = self.config.cost_model(*start.costs)
            self.next_window, self.exhausted_at = k, None
            self.corrupt.unapply_after(k)
            self.suspects.unapply_after(k)
        for j in [j for j in self.starts if j > k]:
            del self.starts[j]

    def planned_steps(self) -> range:
        """The steps of the drawn windows still held (trained ones are dropped)."""
        W = self.config.window
        return range(min(self.windows, default=0) * W, self.next_window * W)

    def plan_samples(self, step: int, ranks) -> set[tuple]:
        """(source, shard, key, epoch) of every sample in ``ranks``' plans of ``step`` and of
        the step's replacements (a replacement may be bad too)."""
        known = set()
        for rank in ranks:
            table = self.table(step, rank)
            known |= set(zip(*(table.column(c).to_pylist()
                               for c in ("source", "shard", "key", "epoch"))))
        return known | {(r.source, r.shard, r.key, r.epoch)
                        for _, r in self.corrupt.replaced_at(step) if r is not None}

    def repeated_commit(self, step: int, rank: int | None, plan_fp: str | None
                        ) -> dict | None:
        """The reply to a commit this state already took for the same plan (``rank`` None: the
        whole step), else None: a client that lost the reply (the plane was killed after
        logging the commit, before answering) retries, and the retry must succeed, not fail as
        a duplicate."""
        if plan_fp is None:
            return None
        done = self.committed_fps.get(step)
        if done is not None and (plan_fp == step_fingerprint(done) if rank is None else
                                 rank < len(done) and done[rank] == plan_fp):
            return {"step": step, "committed": True, "next_step": self.next_step,
                    "repeated": True}
        ranks = self.rank_commits.get(step, set())
        if rank in ranks and step in self.planned_steps() and \
                plan_fp == self.fingerprint(step, rank):
            return {"step": step, "committed": False, "ranks": len(ranks),
                    "dp": self.dp_at(step), "repeated": True}
        return None

    def window_of(self, step: int) -> tuple[Window, int]:
        """The drawn window holding ``step`` and the step's index in it."""
        window = self.windows[step // self.config.window]
        return window, step - window.first_step

    def table(self, step: int, rank: int) -> pa.Table:
        """``rank``'s plan table of ``step``. The tables of the window's steps from ``step``
        on that are not built yet are built with it, at once (``window_rank_tables``)."""
        window, local = self.window_of(step)
        if (step, rank) not in window.tables:
            with collector_paused():
                self._build_tables(window, local)
        return window.tables[(step, rank)]

    def _build_tables(self, window: Window, local: int) -> None:
        todo = [j for j in range(local, len(window.plans))
                if (window.first_step + j, 0) not in window.tables]
        dps = [window.dp_of_step[j] for j in todo]
        sides = [best_baseline(window.samples, j, self.costs_of(window.k),
                               self.config.planner(dp, len(window.plans), self.speeds_at(
                                   window.first_step + j, dp)))
                 if self.config.policy_of(window.k) == "omniscale" else None
                 for j, dp in zip(todo, dps)]
        window.tables.update(window_rank_tables(
            [window.plans[j] for j in todo], window.refs,
            window.samples.item_offsets_N1[:-1], [window.first_step + j for j in todo],
            dps, sides, prints=window.prints))

    def fingerprint(self, step: int, rank: int) -> str:
        """``plan_table.fingerprint`` of ``table(step, rank)``, computed once per plan."""
        window, _ = self.window_of(step)
        if (step, rank) not in window.prints:
            window.prints[(step, rank)] = fingerprint(self.table(step, rank))
        return window.prints[(step, rank)]

    def step_fingerprints(self, step: int) -> list[str]:
        """:meth:`fingerprint` of every rank of ``step`` (built with the tables)."""
        window, local = self.window_of(step)
        return [self.fingerprint(step, r) for r in range(window.dp_of_step[local])]


def _copy(state: dict) -> dict:
    """A deep, JSON-clean copy (states go into snapshots verbatim)."""
    return json.loads(json.dumps(state))
