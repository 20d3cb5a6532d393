"""Ray-backed source loaders (``data.loader: ray``): per-source pools of decoding actors.

Sources differ wildly in decode cost (a caption costs microseconds, a video clip tens of
milliseconds), so one shared worker pool sized for the average starves the expensive sources.
Here every source gets its own pool of :class:`SourceDecoder` actors, planned at startup
within the job's Ray cluster (``loaders.ray_cluster.plan_pools``: at least one actor per
source, more by measured decode cost times mixture share, fractional CPUs when the cluster is
small, one line instead of a silent wait when the actors cannot be placed). Each actor
decodes one source by reference (its reader opens only that source's shards) under the same
per-sample watchdog as a DataLoader worker (:mod:`loaders.worker`).

:class:`RayRankLoader` is :class:`loaders.pipeline.RankLoader` with its decode stage replaced:
the refs of up to ``prefetch_steps`` plans are in flight on the pools at once; an actor that
dies is replaced and its samples decoded again, so the batches are those of a run without
the death.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from omniscale.dataplane.errors import UserError
from omniscale.dataplane.refs import SampleRef
from omniscale.loaders.assemble import DecodedStep, sample_id
from omniscale.loaders.decode import DecodeNeed
from omniscale.loaders.index_schema import INDEX_SCHEMA, read_index
from omniscale.loaders.pipeline import StepLoader
from omniscale.loaders.prefetch import END
from omniscale.loaders.ray_cluster import (
    PLACEMENT_TIMEOUT_S,
    PoolPlan,
    node_cpus,
    plan_pools,
    replan,
    request_room,
    wait_placed,
)
from omniscale.loaders.remote_io import add_stats
from omniscale.loaders.worker import Decoded, DecoderSpec, TimedDecoder

PROBE_SAMPLES = 3  # decoded per source at startup to measure its cost
DIRECTORY_WAIT_S = 600.0  # how long a rank waits for data rank 0 to plan the pools


@ray.remote
class SourceDecoder:
    """One source's decoding worker: stateless apart from its reader's open shards."""

    def __init__(self, spec: DecoderSpec, timeout: float | None) -> None:
        self.decoder = TimedDecoder(spec, timeout)

    def ready(self) -> str:
        """The node it runs on, once it has started (``ray_cluster.wait_placed``)."""
        return ray.get_runtime_context().get_node_id()

    def decode(self, ref: SampleRef, need: DecodeNeed | None = None) -> Decoded:
        return self.decoder.decode(ref, need)

    def decode_all(self, work: list[tuple[SampleRef, DecodeNeed | None]]) -> list[Decoded]:
        """Several samples in one call, each under its own deadline."""
        return self.decoder.decode_all(work)


def probe_refs(source: str, path, n: int = PROBE_SAMPLES) -> list[SampleRef]:
    """The first ``n`` good samples of a source's index, as refs (uncapped)."""
    table = read_index(path, columns=[f.name for f in INDEX_SCHEMA
                                         if f.name not in ("text_ids", "text_targets")])
    rows = [r for r in table.slice(0, 4 * n).to_pylist() if r["error"] is None][:n]
    return [SampleRef(0, source, r["shard"], r["key"], r["offset"], r["size"],
                      tuple((m["name"], m["offset"], m["size"]) for m in r["members"] or ()),
                      r["llm_tokens"], r["text_tokens"], tuple(r["image_patches"] or ()),
                      tuple(r["video_patches"] or ()), tuple(r["audio_frames"] or ()))
            for r in rows]


def measure_costs(spec: DecoderSpec, n: int = PROBE_SAMPLES,
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Mean seconds per decoded sample of each source, from its first few samples (timed by
    `clock`, which tests replace)."""
    decoder = TimedDecoder(spec, timeout=None)
    costs = {}
    for name in spec.sources:
        refs = probe_refs(name, (spec.indexes or spec.sources)[name], n)
        start = clock()
        for ref in refs:
            decoder.decode(ref)
        costs[name] = (clock() - start) / max(len(refs), 1)
    decoder.close()
    return costs


@ray.remote(num_cpus=0)
class PoolDirectory:
    """The job's pool plan under a name in the job's namespace: the loader that plans writes
    it, every other loader of the job reads it and uses the same actors."""

    def __init__(self, plan: PoolPlan) -> None:
        self._plan = plan
        self._generations: dict[tuple[str, int], int] = {}

    def plan(self) -> PoolPlan:
        return self._plan

    def set_plan(self, plan: PoolPlan) -> None:
        self._plan = plan

    def next_generation(self, source: str, slot: int, seen: int) -> int:
        """The generation of the actor in ``slot`` of ``source``'s pool after the one of
        generation ``seen`` died: the first loader to report the death gets a new one (and
        starts it), the others the same (and find it by name). Calls run one at a time."""
        now = self._generations.get((source, slot), 0)
        if now == seen:
            now = self._generations[(source, slot)] = seen + 1
        return now


class RayRankLoader(StepLoader):
    """A rank's loader whose decoding runs on the job's per-source Ray actor pools (connect
    to the job's cluster first: ``loaders.ray_cluster.connect``).

    The pools are the job's, shared by all its ranks: data rank 0's loader measures the
    sources' decode costs and plans them within the cluster's CPUs
    (:func:`loaders.ray_cluster.plan_pools`: every source at least one actor, more by decode
    cost x mixture share -- ``shares``, default the weights the plane reports now -- each
    reserving ``actor_cpus``, None: what fits), names the plan (:class:`PoolDirectory`) and
    the actors after ``pools_name`` (default: after the plane's URL), and every loader then
    takes the actors by name. Actors spread over the cluster's nodes; actors that cannot be
    placed end the loader with one line (``placement_timeout``). An actor that dies is
    replaced and its in-flight samples are decoded again (counted in :attr:`actor_restarts`;
    ``max_actor_restarts`` deaths on one sample end the loader). Every ``resize_every``
    steps (0: never) the pools follow the schedule: the planner shares the same actors out
    anew for the mixture the plane draws now, ahead of training, and every loader applies the
    new plan (``_follow_schedule``). On a cluster with an autoscaler, ``autoscale_cpus`` is
    what the pools may ask it for: they are planned for that many CPUs (or the cluster's, if
    more) and asked for through Ray's resource requests, a standing request the autoscaler
    keeps the cluster at (``ray_cluster.request_room``). The loader that planned kills the
    pools on close (they die with its process anyway) and withdraws its request.
    """

    def __init__(self, *args, max_replicas: int = 4, actor_cpus: float | None = None,
                 shares: dict[str, float] | None = None, pools_name: str | None = None,
                 placement_timeout: float = PLACEMENT_TIMEOUT_S, max_actor_restarts: int = 3,
                 resize_every: int = 0, autoscale_cpus: float | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self._turn = {name: 0 for name in self.spec.sources}
        self._in_flight = {name: 0 for name in self.spec.sources}
        self.depth = max(1, self._out.maxsize)
        self.placement_timeout = placement_timeout
        self.max_actor_restarts = max_actor_restarts
        self.max_replicas, self.resize_every = max_replicas, resize_every
        self.autoscale_cpus = autoscale_cpus
        self.actor_restarts = self.resizes = 0
        self.costs: dict[str, float] = {}
        self.pools_name = pools_name or "omniscale-pools-" + hashlib.sha256(
            self.url.encode()).hexdigest()[:12]
        self.pools: dict[str, list] = {}
        self._directory = None  # set when this loader planned the pools (it owns them)
        self._plans = None  # the job's PoolDirectory (its plan, read by every loader)
        self._generation: dict[tuple[str, int], int] = {}  # pool slots replaced so far
        try:
            self.plan = self._job_plan(max_replicas, actor_cpus, shares)
            self.pools = {name: [self._actor(name, i) for i in range(n)]
                          for name, n in self.plan.replicas.items()}
            wait_placed([a for pool in self.pools.values() for a in pool], self.plan,
                        placement_timeout, self.autoscaling)
        except BaseException:
            self.close()  # the plan prefetcher and any actor started
            raise

    @property
    def autoscaling(self) -> bool:
        return self.autoscale_cpus is not None

    def _nodes(self) -> list[float]:
        """The CPUs per node the pools are planned within: the cluster's, or, with an
        autoscaler, as many as the job may ask it for when that is more -- counted as nodes
        of one CPU, so that actors sized for them fit whatever nodes the autoscaler adds."""
        nodes = node_cpus()
        cap = self.autoscale_cpus
        if self.autoscaling and cap > sum(nodes):
            return [1.0] * int(cap) + ([cap % 1] if cap % 1 else [])
        return nodes

    @property
    def replicas(self) -> dict[str, int]:
        return {name: len(pool) for name, pool in self.pools.items()}

    def _job_plan(self, max_replicas: int, actor_cpus: float | None,
                  shares: dict[str, float] | None) -> PoolPlan:
        """The job's pool plan: planned here on data rank 0 (named for the others), read
        from its directory on every other rank (waiting, boundedly, for rank 0)."""
        name = f"{self.pools_name}/plan"
        if self.rank == 0:
            self.costs = measure_costs(self.spec)
            if shares is None:
                shares = self._shares_now()
            plan = plan_pools(self.costs, shares, self._nodes(), max_replicas, actor_cpus)
            if self.autoscaling:
                request_room(plan)
            try:
                # on this node: it lives as long as the planner does, not a decoding node
                here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                      soft=False)
                self._directory = PoolDirectory.options(name=name,
                                                        scheduling_strategy=here).remote(plan)
                self._plans = self._directory
                return plan
            except ValueError:  # another process of data rank 0 (a TP peer) planned first
                pass
        deadline = time.monotonic() + DIRECTORY_WAIT_S
        while True:
            try:
                self._plans = ray.get_actor(name)
                return ray.get(self._plans.plan.remote())
            except ValueError:
                if time.monotonic() > deadline:
                    raise UserError(f"rank {self.rank}: no Ray decoding pools planned by data "
                                    f"rank 0 after {DIRECTORY_WAIT_S:g} s (actor {name!r} "
                                    "not found)") from None
                time.sleep(0.2)  # rank 0 measures and plans first: seconds

    def _actor(self, source: str, index: int):
        """The pool's ``index``-th actor of ``source``: the one running under its name, or a
        new one (after a death, the first rank to notice starts it, the others find it)."""
        generation = self._generation.get((source, index), 0)
        return SourceDecoder.options(
            name=f"{self.pools_name}/{source}/{index}" + (f".{generation}" if generation else ""),
            get_if_exists=True,
            num_cpus=self.plan.actor_cpus, scheduling_strategy="SPREAD").remote(
            dataclasses.replace(self.spec, sources={source: self.spec.sources[source]},
                                indexes={source: (self.spec.indexes or
                                                  self.spec.sources)[source]}),
            self.decode_timeout)

    def _shares_now(self) -> dict[str, float]:
        """The mixture weights the plane is drawing with now (ahead of training by up to a
        window of steps)."""
        return {m["source"]: m["weight"] for m in self.client.status()["mixture"]}

    def pool_stats(self) -> dict:
        """Actors and samples in flight per source, pool resizes and actor restarts so far
        (the trainer's metrics)."""
        return {"actors": self.replicas, "in_flight": dict(self._in_flight),
                "resizes": self.resizes, "actor_restarts": self.actor_restarts}

    def _follow_schedule(self, step: int) -> None:
        """Every ``resize_every`` steps: the planner shares the pools out anew for the
        mixture the plane is drawing now (``ray_cluster.replan``) and names the new plan;
        the other ranks read it; each applies it before submitting the step."""
        if not self.resize_every or step % self.resize_every:
            return
        if self._directory is not None:
            plan = replan(self.plan, self.costs, self._shares_now(), self._nodes(),
                          self.max_replicas)
            if plan != self.plan:
                if self.autoscaling:
                    request_room(plan)
                ray.get(self._directory.set_plan.remote(plan))
        else:
            plan = ray.get(self._plans.plan.remote())
        self._apply(plan)

    def _apply(self, plan: PoolPlan) -> None:
        """Make the pools ``plan``'s: actors beyond a pool's new size retired (killed by the
        planner, dropped by the others; their samples in flight go to the pool's other
        actors), new ones started (by name, so every rank gets the same ones)."""
        if plan == self.plan:
            return
        for source, pool in self.pools.items():
            for actor in pool[plan.replicas[source]:] if self._directory is not None else ():
                ray.kill(actor)
            del pool[plan.replicas[source]:]
        self.plan = plan
        grown = []
        for source, pool in self.pools.items():
            while len(pool) < plan.replicas[source]:
                pool.append(self._actor(source, len(pool)))
                grown.append(pool[-1])
        self.resizes += 1
        if grown:
            wait_placed(grown, PoolPlan({"grown": len(grown)}, plan.actor_cpus),
                        self.placement_timeout, self.autoscaling)

    def _submit(self, work: list[tuple[SampleRef, DecodeNeed | None]]) -> list["_Flight"]:
        """A step's samples sent to their sources' pools, dealt round-robin over each pool's
        actors: one call per actor with all its samples (a call per sample costs Ray's
        per-call overhead a sample)."""
        groups: dict[tuple[str, int], list] = {}
        for ref, need in work:
            pool = self.pools[ref.source]
            self._turn[ref.source] += 1
            self._in_flight[ref.source] += 1
            groups.setdefault((ref.source, self._turn[ref.source] % len(pool)), []).append(
                (ref, need))
        flights = []
        for (source, slot), items in groups.items():
            actor = self.pools[source][slot]
            flights.append(_Flight(source, items, slot, actor, actor.decode_all.remote(items)))
        return flights

    def _result(self, flight: "_Flight") -> list[Decoded]:
        """A flight's decodes; if its actor died, the actor replaced (once, by whichever
        flight notices first) and the samples decoded again on the new one."""
        for _ in range(self.max_actor_restarts + 1):
            try:
                out = ray.get(flight.future)  # each actor bounds each decode by its timeout
                self._in_flight[flight.source] -= len(flight.work)
                return out
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
                # the actor died, or its results were lost with their node's object store
                self._apply(ray.get(self._plans.plan.remote()))  # retired by a resize?
                pool = self.pools[flight.source]
                if flight.slot >= len(pool):  # yes: its pool's other actors take the samples
                    flight.slot %= len(pool)
                elif pool[flight.slot] is flight.actor and not _alive(flight.actor):
                    self.actor_restarts += 1
                    warnings.warn(f"rank {self.rank}: a decoding actor of source "
                                  f"{flight.source!r} died ({type(e).__name__}); replaced "
                                  f"(restart {self.actor_restarts})", RuntimeWarning,
                                  stacklevel=2)
                    pool[flight.slot] = self._replacement(flight.source, flight.slot)
                flight.actor = pool[flight.slot]
                flight.future = flight.actor.decode_all.remote(flight.work)
        keys = ", ".join(f"{ref.source}/{ref.key}" for ref, _ in flight.work[:3])
        raise RuntimeError(f"rank {self.rank}: decoding actors of source {flight.source!r} "
                           f"died {self.max_actor_restarts + 1} times on a call with {keys}"
                           f"{' …' if len(flight.work) > 3 else ''}; giving up (a sample may "
                           "kill its decoder every time)")

    def _replacement(self, source: str, slot: int):
        """A started actor in a dead one's place, under a name of the next generation (a dead
        actor's name is not free again for long after its node is lost); the directory
        hands every loader the same generation."""
        for _ in range(self.max_actor_restarts + 1):
            seen = self._generation.get((source, slot), 0)
            self._generation[(source, slot)] = ray.get(
                self._plans.next_generation.remote(source, slot, seen))
            actor = self._actor(source, slot)
            try:
                wait_placed([actor], PoolPlan({source: 1}, self.plan.actor_cpus),
                            self.placement_timeout, self.autoscaling)
                return actor
            except ray.exceptions.RayActorError:
                continue  # that generation died too (its node lost as well): the next
        raise UserError(f"rank {self.rank}: no decoding actor of source {source!r} could be "
                        f"started again in {self.max_actor_restarts + 1} tries")

    def _decoded_steps(self):
        pending: deque = deque()  # (step, table, flights), oldest first
        done = False
        while pending or not done:
            # Fill up to ``depth`` steps in flight, but never wait for a plan while one is
            # already decoding: that plan may need this step's commit first.
            while not done and len(pending) < self.depth:
                got = self.plans.get() if not pending else self.plans.poll()
                if got is None:
                    break
                if got is END:
                    done = True
                    break
                step, table = got
                self._follow_schedule(step)
                pending.append((step, table, self._submit(self._work(table))))
            if not pending:
                return
            step, table, flights = pending.popleft()
            decoded, io = {}, {}
            for f in flights:
                outs = self._result(f)
                decoded.update((sample_id(ref), out) for (ref, _), out in zip(f.work, outs))
                add_stats(io, getattr(outs, "io", {}))  # a DecodedList's reader counters
            yield step, table, DecodedStep(decoded, io=io)

    def close(self) -> None:
        super().close()
        if self._directory is not None:  # the planner owns the pools
            for actor in [a for pool in self.pools.values() for a in pool] + [self._directory]:
                ray.kill(actor)
            self._directory = None
            if self.autoscaling:
                request_room(None)


def _alive(actor) -> bool:
    try:
        ray.get(actor.ready.remote(), timeout=PLACEMENT_TIMEOUT_S)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


@dataclass
class _Flight:
    """Samples of one source sent to one of its actors: where they went and the future of
    their decodes."""

    source: str
    work: list[tuple[SampleRef, DecodeNeed | None]]
    slot: int  # the actor's index in its source's pool
    actor: object
    future: object
