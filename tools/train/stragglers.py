"""Stragglers: a data rank that computes much slower than the plan predicts, step after step.

The plan predicts each rank's cost; ``cost_model.CostFit`` turns costs into seconds (``k``, fitted
over every rank and step so far). A rank is *slow* at a step when its compute seconds exceed
``watchdog.straggler_factor`` times ``k`` times its predicted cost, and a *straggler* once it
has been slow for ``watchdog.straggler_steps`` steps in a row -- one slow step is noise (a page
fault, a neighbour's burst), a run of them is a sick GPU, a throttled node, a bad host. It
stays one until a step that is not slow. Compute seconds exclude the time spent waiting for
the other ranks (``compute_clock``), so the rank that holds the job up is the one named, not
the ones waiting for it.

Every rank keeps the same tracker (every rank sees every rank's timing in ``records.flush``);
rank 0 prints the changes and tells the plane, so ``omniscale plane status`` names them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StragglerTracker:
    """Per data rank, its slow steps in a row (``runs``) and their summed slowdown
    (``run_slowdown``: the announced figure is their mean); the ranks now stragglers; the
    step the set last changed and the set the plane was last told."""

    runs: dict[int, int] = dataclasses.field(default_factory=dict)
    run_slowdown: dict[int, float] = dataclasses.field(default_factory=dict)
    ranks: set[int] = dataclasses.field(default_factory=set)
    changed_at: int | None = None
    told: frozenset[int] = frozenset()

    def observe(self, step: int, costs: list[float], secs: list[float], k: float | None,
                factor: float, steps: int) -> tuple[dict, list[str]]:
        """One step's per-rank predicted costs and compute seconds, ``k`` the cost fit from
        before this step: the row's fields (``rank_slowdown``, and ``stragglers`` when there
        are any) and the lines announcing who became a straggler or recovered."""
        known = k is not None and k > 0
        slowdown = [s / (k * c) if known and c > 0 else None for c, s in zip(costs, secs)]
        lines = []
        for rank, ratio in enumerate(slowdown):
            if ratio is None:  # nothing predicted for it: no evidence either way
                continue
            if ratio > factor:
                self.runs[rank] = self.runs.get(rank, 0) + 1
                self.run_slowdown[rank] = self.run_slowdown.get(rank, 0.0) + ratio
                if self.runs[rank] >= steps and rank not in self.ranks:
                    self.ranks.add(rank)
                    self.changed_at = step
                    lines.append(f"straggler: data rank {rank} took {self.slowdown(rank):.1f}× "
                                 f"its predicted compute for {self.runs[rank]} steps in a row "
                                 f"(step {step})")
                continue
            self.runs[rank], self.run_slowdown[rank] = 0, 0.0
            if rank in self.ranks:
                self.ranks.discard(rank)
                self.changed_at = step
                lines.append(f"straggler: data rank {rank} recovered: {ratio:.1f}× its "
                             f"predicted compute (step {step}; bound {factor:g}×)")
        fields = {"rank_slowdown": [None if r is None else round(r, 3) for r in slowdown]
                  if known else None}
        if self.ranks:  # only then: rows stay small
            fields["stragglers"] = sorted(self.ranks)
        return fields, lines

    def slowdown(self, rank: int) -> float:
        """The mean slowdown of ``rank``'s current run of slow steps."""
        return self.run_slowdown.get(rank, 0.0) / max(self.runs.get(rank, 0), 1)

    def tell(self, plane, writer: bool) -> None:
        """Rank 0 (``writer``) tells the plane (``plane``: the rank's
        ``plane_session.PlaneSession``, ``report_stragglers``) the stragglers when the set
        changed since it last did (not every step: it is news, not a heartbeat). An
        observation, so a plane that cannot take it -- an older one without the action --
        costs one line, not the run."""
        from omniscale.dataplane.client import PlaneError

        now = frozenset(self.ranks)
        if not writer or plane is None or now == self.told:
            return
        self.told = now
        ranks = sorted(now)
        try:
            plane.report_stragglers(self.changed_at, ranks,
                                    [round(self.slowdown(r), 3) for r in ranks])
        except PlaneError as e:
            print(f"straggler: the plane was not told ({str(e).splitlines()[0]})", flush=True)
