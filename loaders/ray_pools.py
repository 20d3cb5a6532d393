"""Which actors make up the job's decoding pools: one :class:`PoolLayout`, kept by a named Ray
actor (:class:`PoolDirectory`) that every rank's loader reads, so all ranks send to the same
actors and a death is handled once.

A layout names the actor in each slot of each source's pool. Names are never reused (a dead
actor's name stays taken for a while after its node is lost), so replacing an actor is a new
name in its slot. When a pool actor dies, the first loader to report it asks the layout
(:meth:`PoolLayout.lost`): with room on the cluster's nodes for one more actor, the slot gets
a new actor; without (a node lost and no autoscaler to bring one back), the pool shrinks by
that slot -- or, if it was the source's only actor, the largest other pool gives one up. The
room is counted from the layout (the actors it names), not from Ray's view of free CPUs,
which lags behind a death by up to a resource report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import ray

from omniscale.loaders.ray_cluster import PoolPlan


@dataclass
class Loss:
    """What :meth:`PoolLayout.lost` decided: the new actor's name for the dead one's slot
    (None: the slot was given up, or another loader had already reported the death), and
    actors to retire to make room for it."""

    started: str | None = None
    retired: list[str] = field(default_factory=list)
    handled: bool = True  # False: another loader reported this death first


class PoolLayout:
    """The actor names of each source's pool, for ``plan`` (names ``PREFIX/SOURCE/N``)."""

    def __init__(self, plan: PoolPlan, prefix: str) -> None:
        self.plan, self.prefix, self._made = plan, prefix, 0
        self.deaths = {"replaced": 0, "retired": 0}  # the job's, as decided here
        self.names = {s: [self._fresh(s) for _ in range(n)] for s, n in plan.replicas.items()}

    def _fresh(self, source: str) -> str:
        self._made += 1
        return f"{self.prefix}/{source}/{self._made}"

    def _resized(self) -> None:
        self.plan = PoolPlan({s: len(n) for s, n in self.names.items()}, self.plan.actor_cpus)

    def set_plan(self, plan: PoolPlan) -> list[str]:
        """Pools resized to ``plan`` (same actor size): the last actors of a shrinking pool
        retired (returned, for the planner to kill), new names at the end of a growing one."""
        retired = []
        for source, names in self.names.items():
            retired += names[plan.replicas[source]:]
            del names[plan.replicas[source]:]
            names += [self._fresh(source) for _ in range(plan.replicas[source] - len(names))]
        self.plan = plan
        return retired

    def lost(self, source: str, name: str, room: int, autoscaling: bool = False) -> Loss:
        """The actor ``name`` of ``source``'s pool died. ``room``: how many actors of the
        plan's size the cluster's nodes hold for the job now. With an autoscaler the actor is
        always started again (the standing request brings a node back)."""
        names = self.names[source]
        if name not in names:
            return Loss(handled=False)
        slot = names.index(name)
        live = sum(len(n) for n in self.names.values()) - 1  # the dead one aside
        if autoscaling or live < room:
            names[slot] = self._fresh(source)
            self.deaths["replaced"] += 1
            return Loss(names[slot])
        if len(names) > 1:  # no room: the pool goes on with its other actors
            del names[slot]
            self._resized()
            self.deaths["retired"] += 1
            return Loss()
        # the source's only actor: the largest other pool (if any has two) gives one up
        donor = max((s for s in self.names if len(self.names[s]) > 1),
                    key=lambda s: (len(self.names[s]), s), default=None)
        retired = [self.names[donor].pop()] if donor is not None else []
        names[slot] = self._fresh(source)
        self._resized()
        self.deaths["replaced"] += 1
        return Loss(names[slot], retired)


def room_on(nodes: list[float], actor_cpus: float) -> int:
    """How many actors of ``actor_cpus`` the nodes hold (each node packed on its own)."""
    return sum(math.floor(c / actor_cpus + 1e-9) for c in nodes)


@ray.remote(num_cpus=0)
class PoolDirectory:
    """The job's :class:`PoolLayout` under a name in the job's namespace: the loader that plans
    writes it, every loader reads it, and deaths are reported to it (calls run one at a time,
    so two loaders meeting the same death get one decision). ``reserved_cpus``: CPUs others
    held on the cluster when the pools were planned (the plane's actor, other jobs)."""

    def __init__(self, plan: PoolPlan, prefix: str, reserved_cpus: float = 0.0) -> None:
        self._layout = PoolLayout(plan, prefix)
        self._reserved = reserved_cpus

    def reserved(self) -> float:
        return self._reserved

    def layout(self) -> tuple[PoolPlan, dict[str, list[str]]]:
        return self._layout.plan, self._layout.names

    def deaths(self) -> dict[str, int]:
        """The job's dead actors so far: replaced, and not replaced (no room)."""
        return self._layout.deaths

    def set_plan(self, plan: PoolPlan) -> list[str]:
        return self._layout.set_plan(plan)

    def lost(self, source: str, name: str, room: int, autoscaling: bool) -> Loss:
        return self._layout.lost(source, name, room, autoscaling)
