"""Ray-backed source loaders (``data.loader: ray``): per-source pools of decoding actors.

Sources differ wildly in decode cost (a caption costs microseconds, a video clip tens of
milliseconds), so one shared worker pool sized for the average starves the expensive sources.
Here every source gets its own pool of :class:`SourceDecoder` actors, planned at startup
within the job's Ray cluster (``loaders.ray_cluster.plan_pools``: at least one actor per
source, more by measured decode cost times mixture share, fractional CPUs when the cluster is
small, one line instead of a silent wait when the actors cannot be placed). Each actor
decodes one source by reference (its reader opens only that source's shards) under the same
per-sample watchdog as a DataLoader worker (:mod:`loaders.worker`), and returns its samples
one by one, as numpy: they become tensors here, on the trainer side, where the step is
assembled (``loaders.assemble`` packs them with ``loaders.collate``). Ray ships the actor
class by value, so an actor imports what its methods use (``loaders.worker`` and the
decoders), not this module and the trainer-side loader it builds on.

:class:`RayRankLoader` is :class:`loaders.pipeline.RankLoader` with its decode stage replaced:
the refs of up to ``prefetch_steps`` plans are in flight on the pools at once; an actor that
dies is replaced and its samples decoded again, so the batches are those of a run without
the death.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from omniscale.errors import UserError
from omniscale.index_schema import INDEX_SCHEMA, read_index
from omniscale.loaders.assemble import DecodedStep, sample_id
from omniscale.loaders.decode import DecodeNeed
from omniscale.loaders.prefetch import END
from omniscale.loaders.ray_cluster import (
    PLACEMENT_TIMEOUT_S,
    PoolPlan,
    check_fits,
    cluster_cpus,
    node_cpus,
    plan_pools,
    replan,
    request_room,
    wait_placed,
)
from omniscale.loaders.ray_pools import PoolDirectory, room_on
from omniscale.loaders.remote_io import add_stats
from omniscale.loaders.step_loader import StepLoader
from omniscale.loaders.worker import Decoded, DecoderSpec, TimedDecoder
from omniscale.refs import SampleRef

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


class RayRankLoader(StepLoader):
    """A rank's loader whose decoding runs on the job's per-source Ray actor pools (connect
    to the job's cluster first: ``loaders.ray_cluster.connect``).

    The pools are the job's, shared by all its ranks: data rank 0's loader measures the
    sources' decode costs and plans them within the cluster's CPUs
    (:func:`loaders.ray_cluster.plan_pools`: every source at least one actor, more by decode
    cost x mixture share -- ``shares``, default the weights the plane draws with now, asked of
    ``mixture()`` (the rank's plane session's ``mixture_weights``) -- each reserving
    ``actor_cpus``, None: what fits), names the plan (:class:`PoolDirectory`) and the actors
    after ``pools_name`` (the job's: :func:`pools_name_for` its plane's URL), and every loader
    then takes the actors by name. Actors spread over the cluster's nodes; actors that cannot be
    placed end the loader with one line (``placement_timeout``). An actor that dies is
    replaced and its in-flight samples are decoded again (counted in :attr:`actor_restarts`;
    ``max_actor_restarts`` deaths on one sample end the loader) -- or, when the nodes left
    have no room for it and no autoscaler can add one, its pool goes on without it (counted
    in :attr:`actors_retired`; :class:`loaders.ray_pools.PoolLayout`). Every ``resize_every``
    steps (0: never) the pools follow the schedule: the planner shares the same actors out
    anew for the mixture the plane draws now, ahead of training, and every loader applies the
    new plan (``_follow_schedule``). On a cluster with an autoscaler, ``autoscale_cpus`` is
    what the pools may ask it for: they are planned for that many CPUs (or the cluster's, if
    more) and asked for through Ray's resource requests, a standing request the autoscaler
    keeps the cluster at (``ray_cluster.request_room``). The loader that planned kills the
    pools on close (they die with its process anyway) and withdraws its request.
    """

    def __init__(self, *args, pools_name: str, mixture: Callable[[], dict[str, float]],
                 max_replicas: int = 4, actor_cpus: float | None = None,
                 shares: dict[str, float] | None = None,
                 placement_timeout: float = PLACEMENT_TIMEOUT_S, max_actor_restarts: int = 3,
                 resize_every: int = 0, autoscale_cpus: float | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.mixture = mixture
        self._turn = {name: 0 for name in self.spec.sources}
        self._in_flight = {name: 0 for name in self.spec.sources}
        self.depth = max(1, self._out.maxsize)
        self.placement_timeout = placement_timeout
        self.max_actor_restarts = max_actor_restarts
        self.max_replicas, self.resize_every = max_replicas, resize_every
        self.autoscale_cpus = autoscale_cpus
        self.actor_restarts = self.actors_retired = self.resizes = 0
        self.costs: dict[str, float] = {}
        self.pools_name = pools_name
        self.pools: dict[str, list] = {}  # each source's actors, in slot order
        self._names: dict[str, list[str]] = {}  # ... and their names
        self._handles: dict[str, object] = {}  # every actor of the layout, by name
        self._directory = None  # set when this loader planned the pools (it owns them)
        self._plans = None  # the job's PoolDirectory (its layout, read by every loader)
        self._reserved = 0.0  # CPUs others held when the pools were planned
        self._deaths = {"replaced": 0, "retired": 0}  # the job's, as last read
        try:
            self._job_plan(max_replicas, actor_cpus, shares)
            new = self._sync(*ray.get(self._plans.layout.remote()))
            wait_placed(new, self.plan, placement_timeout, self.autoscaling)
        except BaseException:
            self.close()  # the plan prefetcher and any actor started
            raise

    @property
    def autoscaling(self) -> bool:
        return self.autoscale_cpus is not None

    def _nodes(self) -> list[float]:
        """The CPUs per node the pools are planned within: the cluster's, less what others
        held when the pools were planned (taken from the largest nodes: Ray tells free CPUs
        per cluster, not per node), or, with an autoscaler, as many as the job may ask it for
        when that is more -- counted as nodes of one CPU, so that actors sized for them fit
        whatever nodes the autoscaler adds."""
        nodes, reserved = sorted(node_cpus(), reverse=True), self._reserved
        for i, cpus in enumerate(nodes):
            nodes[i], reserved = max(0.0, cpus - reserved), max(0.0, reserved - cpus)
        cap = self.autoscale_cpus
        if self.autoscaling and cap > sum(nodes):
            return [1.0] * int(cap) + ([cap % 1] if cap % 1 else [])
        return nodes

    @property
    def replicas(self) -> dict[str, int]:
        return {name: len(pool) for name, pool in self.pools.items()}

    @property
    def actor_names(self) -> dict[str, list[str]]:
        """The names of each source's actors, as of the last layout this loader took."""
        return {source: list(names) for source, names in self._names.items()}

    def _job_plan(self, max_replicas: int, actor_cpus: float | None,
                  shares: dict[str, float] | None) -> None:
        """The job's pool layout: planned here on data rank 0 (named for the others), found
        by name on every other rank (waiting, boundedly, for rank 0): ``self._plans``."""
        name = f"{self.pools_name}/plan"
        if self.rank == 0:
            # before any actor of ours starts: what the cluster's CPUs hold already
            self._reserved = max(0.0, cluster_cpus() - ray.available_resources().get("CPU", 0))
            self.costs = measure_costs(self.spec)
            if shares is None:
                shares = self._shares_now()
            plan = plan_pools(self.costs, shares, self._nodes(), max_replicas, actor_cpus)
            check_fits(plan, self.autoscaling)  # before the others find a plan to follow
            if self.autoscaling:
                request_room(plan)
            try:
                # on this node: it lives as long as the planner does, not a decoding node
                here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                      soft=False)
                self._directory = PoolDirectory.options(
                    name=name, scheduling_strategy=here).remote(
                        plan, self.pools_name, self._reserved)
                self._plans = self._directory
                return
            except ValueError:  # another process of data rank 0 (a TP peer) planned first
                pass
        deadline = time.monotonic() + DIRECTORY_WAIT_S
        while True:
            try:
                self._plans = ray.get_actor(name)
                self._reserved = ray.get(self._plans.reserved.remote())
                return
            except ValueError:
                if time.monotonic() > deadline:
                    raise UserError(f"rank {self.rank}: no Ray decoding pools planned by data "
                                    f"rank 0 after {DIRECTORY_WAIT_S:g} s (actor {name!r} "
                                    "not found)") from None
                time.sleep(0.2)  # rank 0 measures and plans first: seconds

    def _handle(self, source: str, name: str):
        """The actor named ``name`` of ``source``'s pool: the one running under that name,
        or a new one (the first loader to need it starts it, the others find it)."""
        spec = dataclasses.replace(self.spec, sources={source: self.spec.sources[source]},
                                   indexes={source: (self.spec.indexes or
                                                     self.spec.sources)[source]})
        for attempt in range(3):
            try:
                return SourceDecoder.options(
                    name=name, get_if_exists=True, num_cpus=self.plan.actor_cpus,
                    scheduling_strategy="SPREAD").remote(spec, self.decode_timeout)
            except ValueError:
                # Ray found the name taken, then the actor gone when it looked it up (killed
                # or dead in between): the name is free again, so start it anew
                if attempt == 2:
                    raise

    def _sync(self, plan: PoolPlan, names: dict[str, list[str]]) -> list:
        """Take the directory's layout: the pools become its actors (handles to actors it
        no longer names dropped); returns the actors new to this loader."""
        self.plan, new = plan, []
        for name in set(self._handles) - {n for pool in names.values() for n in pool}:
            del self._handles[name]
        for source, pool in names.items():
            for name in pool:
                if name not in self._handles:
                    self._handles[name] = self._handle(source, name)
                    new.append(self._handles[name])
        self._names = {source: list(pool) for source, pool in names.items()}
        self.pools = {source: [self._handles[n] for n in pool] for source, pool in names.items()}
        return new

    def _shares_now(self) -> dict[str, float]:
        """The mixture weights the plane is drawing with now (ahead of training by up to a
        window of steps)."""
        return self.mixture()

    def pool_stats(self) -> dict:
        """Actors and samples in flight per source, pool resizes, and the job's dead actors
        replaced and not replaced so far, whichever rank met them (the trainer's metrics)."""
        # once the pools are closed: the counts as they were last read
        with contextlib.suppress(ray.exceptions.RayActorError):
            self._deaths = ray.get(self._plans.deaths.remote())
        deaths = self._deaths
        return {"actors": self.replicas, "in_flight": dict(self._in_flight),
                "resizes": self.resizes, "actor_restarts": deaths["replaced"],
                "actors_retired": deaths["retired"]}

    def _follow_schedule(self, step: int) -> None:
        """Every ``resize_every`` steps: the planner shares the pools out anew for the
        mixture the plane is drawing now (``ray_cluster.replan``), names the new layout and
        kills the actors it retires (their samples in flight go to their pools' other
        actors); every loader takes the layout before submitting the step."""
        if not self.resize_every or step % self.resize_every:
            return
        if self._directory is not None:
            plan = replan(self.plan, self.costs, self._shares_now(), self._nodes(),
                          self.max_replicas)
            if plan != self.plan:
                if self.autoscaling:
                    request_room(plan)
                self._kill(ray.get(self._directory.set_plan.remote(plan)))
            self._take_layout()
            self._check_health()  # takes the layout again only if it reports a death
        else:
            self._take_layout()

    def _check_health(self) -> None:
        """The planner pings every actor once a window: one that died (its node lost) is
        reported now, so it is replaced before a sample goes to it -- also in a pool whose
        source the mixture draws rarely, where no sample might meet the death for long. An
        actor that does not answer within a second is starting or busy: alive."""
        pings = {self._handles[n].ready.remote(): (source, n)
                 for source, names in self._names.items() for n in names}
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=1.0)
        for ping in answered:
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError as e:
                self._report_death(*pings[ping], e)

    def _take_layout(self) -> None:
        """The directory's layout taken (:meth:`_sync`), and its new actors waited for."""
        plan, names = ray.get(self._plans.layout.remote())
        if (plan, names) == (self.plan, self._names):
            return
        if plan != self.plan:
            self.resizes += 1
        new = self._sync(plan, names)
        # one that died starting (its node lost too) is met, and handled, as a death
        with contextlib.suppress(ray.exceptions.RayActorError):
            wait_placed(new, PoolPlan({"new": len(new)}, plan.actor_cpus),
                        self.placement_timeout, self.autoscaling)

    def _kill(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(ValueError):  # never started: nothing to kill
                ray.kill(self._handles.get(name) or ray.get_actor(name))

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
            flights.append(_Flight(source, items, slot, self._names[source][slot], actor,
                                   actor.decode_all.remote(items)))
        return flights

    def _result(self, flight: "_Flight") -> list[Decoded]:
        """A flight's decodes; if its actor died, the death reported to the directory (which
        decides once, for the loader that reports first: a new actor in its slot, or the pool
        goes on without it) and the samples decoded again in the pool as it is now."""
        for _ in range(self.max_actor_restarts + 1):
            try:
                out = ray.get(flight.future)  # each actor bounds each decode by its timeout
                self._in_flight[flight.source] -= len(flight.work)
                return out
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
                # the actor died, or its results were lost with their node's object store
                self._take_layout()  # a resize may have retired it, a peer reported it
                if flight.name in self._names[flight.source] and not _alive(flight.actor):
                    self._report_death(flight.source, flight.name, e)
                names = self._names[flight.source]
                if flight.name not in names:  # the pool's other actors take the samples
                    flight.slot %= len(names)
                    flight.name = names[flight.slot]
                flight.actor = self._handles[flight.name]
                flight.future = flight.actor.decode_all.remote(flight.work)
        keys = ", ".join(f"{ref.source}/{ref.key}" for ref, _ in flight.work[:3])
        raise RuntimeError(f"rank {self.rank}: decoding actors of source {flight.source!r} "
                           f"died {self.max_actor_restarts + 1} times on a call with {keys}"
                           f"{' …' if len(flight.work) > 3 else ''}; giving up (a sample may "
                           "kill its decoder every time)")

    def _report_death(self, source: str, name: str, error: Exception) -> None:
        """Tell the directory the actor ``name`` of ``source``'s pool died, with the room the
        nodes have now, and take the layout it decides."""
        room = room_on(self._nodes(), self.plan.actor_cpus)
        loss = ray.get(self._plans.lost.remote(source, name, room, self.autoscaling))
        if loss.handled:
            self._kill(loss.retired)
            if loss.started:
                self.actor_restarts += 1
                what = f"replaced (restart {self.actor_restarts})"
            else:
                self.actors_retired += 1
                what = "not replaced: the nodes left have no room for it"
            if loss.retired:
                what += f"; to make room, {', '.join(loss.retired)} retired"
            warnings.warn(f"rank {self.rank}: a decoding actor of source {source!r} "
                          f"died ({type(error).__name__}); {what}", RuntimeWarning,
                          stacklevel=3)
        self._take_layout()

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
        try:
            super().close()
        finally:
            if self._directory is not None:  # the planner owns the pools
                with contextlib.suppress(Exception):  # the cluster may be gone already
                    self.pool_stats()  # the job's death counts, read while they can be
                for actor in [a for pool in self.pools.values() for a in pool] + \
                        [self._directory]:
                    ray.kill(actor)
                self._directory = None
                if self.autoscaling:
                    request_room(None)


def pools_name_for(plane_url: str) -> str:
    """The name of a job's decoding pools, after its plane's URL (every rank knows it)."""
    return "omniscale-pools-" + hashlib.sha256(plane_url.encode()).hexdigest()[:12]


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
    name: str  # ... and its name
    actor: object
    future: object
