"""What ``DataPlane.status()`` reports: one JSON-able dict that the CLI, the Prometheus
exporter and tests all read, so the three can never disagree.

Kept apart from plane.py because it only reads the plane's state (under the plane's lock,
taken by the caller) and has no say in planning.

Counters come from the mixer and the catalog, which run *ahead* of training: shares, served
samples and tokens are as drawn through ``planned_through`` (what the plane has handed or will
hand out), not as committed. ``next_step`` is what training has finished.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

CLIENT_WINDOW_S = 60.0  # a rank that fetched a plan this recently counts as connected


def plane_status(plane, now: float) -> dict:
    """The status of ``plane`` (a :class:`dataplane.plane.DataPlane`; caller holds its lock)
    at monotonic time ``now``."""
    W = plane.config.window
    planned_through = (plane.next_window * W - 1 if plane.exhausted_at is None
                       else plane.exhausted_at - 1)
    mixer = plane.mixer
    weights = dict(zip(mixer.names, map(float, mixer.weights())))
    mixture = [{"source": n, "weight": weights.get(n, 0.0), **p,
                "deviation": p["realized_share"] - p["target_share"]}
               for n, p in mixer.proportions().items()]
    recent, next_rank_cost = _steps(plane)
    return {
        "spec": plane.spec_path, "accounting": plane.spec.accounting,
        "dp": plane.dp_at(plane.next_step), "window": W,
        # what a trainer checks before it joins; JSON-ready (a tuple would come back a list)
        "config": json.loads(json.dumps(dataclasses.asdict(plane.config))),
        "next_step": plane.next_step, "served_max_step": plane.served_max,
        "planned_through": planned_through,
        "plans_ahead": max(planned_through - plane.next_step, 0),  # beyond next_step
        "mixture_through_step": mixer.step - 1,
        "mixture": mixture,
        "sources": [{"source": n, **s} for n, s in mixer.catalog.stats().items()],
        # each source's index's special tokens: its samples' token counts depend on them
        "special_tokens": {s.name: None if s.special_tokens is None
                           else dataclasses.asdict(s.special_tokens) for s in mixer.catalog},
        "recent_steps": recent,
        "next_step_rank_cost": next_rank_cost,
        "clients": _clients(plane.clients, now),
        "client_window_s": CLIENT_WINDOW_S,
        "snapshot": {"last_step": plane.last_snapshot, "every": plane.config.snapshot_every,
                     "state_dir": str(plane.journal.dir),
                     "steps_since": plane.next_step - plane.last_snapshot},
        "last_snapshot": plane.last_snapshot,
        "exhausted_at": plane.exhausted_at,
        "exhausted": [dict(e) for e in mixer.exhausted],
        "dropped": sorted(mixer.catalog.dropped),
    }


def _steps(plane) -> tuple[list[dict], list[float]]:
    """Balance of every step still in memory (the last trained window onwards), and the
    predicted cost of each rank at the next step to train (empty when it is not planned)."""
    rows, next_rank_cost = [], []
    for k in sorted(plane.windows):
        window = plane.windows[k]
        for local, plan in enumerate(window.plans):
            step = window.first_step + local
            cost_R = plan.rank_cost_R
            rows.append({
                "step": step, "dp": int(window.dp_of_step[local]),
                "committed": step < plane.next_step or step in plane.committed,
                "max_cost": float(cost_R.max()) if len(cost_R) else 0.0,
                "mean_cost": float(cost_R.mean()) if len(cost_R) else 0.0,
                "lower_bound": float(plan.lower_bound), "imbalance": float(plan.imbalance)})
            if step == plane.next_step:
                next_rank_cost = [float(c) for c in np.asarray(cost_R)]
    return rows, next_rank_cost


def _clients(seen: dict[int, tuple[float, int]], now: float) -> list[dict]:
    return [{"rank": rank, "last_step": step, "seen_s_ago": round(now - at, 3)}
            for rank, (at, step) in sorted(seen.items()) if now - at <= CLIENT_WINDOW_S]
