"""Ray-backed source loaders (``--loaders ray``): per-source pools of decoding actors.

Sources differ wildly in decode cost (a caption costs microseconds, a video clip tens of
milliseconds), so one shared worker pool sized for the average starves the expensive sources.
Here every source gets its own pool of :class:`SourceDecoder` actors, sized at startup by its
measured decode cost times its share of the mixture: ``replicas_i ∝ cost_i · share_i``,
clamped to ``[min_replicas, max_replicas]``. Each actor decodes one source by reference (its
reader opens only that source's shards) under the same per-sample watchdog as a DataLoader
worker (:mod:`loaders.worker`).

:class:`RayRankLoader` is :class:`loaders.pipeline.RankLoader` with its decode stage replaced:
the refs of up to ``prefetch_steps`` plans are in flight on the pools at once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import ray

from omniscale.dataplane.refs import SampleRef
from omniscale.loaders.assemble import DecodedStep, sample_id
from omniscale.loaders.decode import DecodeNeed
from omniscale.loaders.index_schema import INDEX_SCHEMA, read_index
from omniscale.loaders.pipeline import StepLoader
from omniscale.loaders.prefetch import END
from omniscale.loaders.worker import Decoded, DecoderSpec, TimedDecoder

PROBE_SAMPLES = 3  # decoded per source at startup to measure its cost


@ray.remote
class SourceDecoder:
    """One source's decoding worker: stateless apart from its reader's open shards."""

    def __init__(self, spec: DecoderSpec, timeout: float | None) -> None:
        self.decoder = TimedDecoder(spec, timeout)

    def decode(self, ref: SampleRef, need: DecodeNeed | None = None) -> Decoded:
        return self.decoder.decode(ref, need)


def probe_refs(source: str, path: str, n: int = PROBE_SAMPLES) -> list[SampleRef]:
    """The first ``n`` good samples of a source's index, as refs (uncapped)."""
    table = read_index(path, columns=[f.name for f in INDEX_SCHEMA if f.name != "text_ids"])
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
    for name, path in spec.sources.items():
        refs = probe_refs(name, path, n)
        start = clock()
        for ref in refs:
            decoder.decode(ref)
        costs[name] = (clock() - start) / max(len(refs), 1)
    decoder.close()
    return costs


def size_pools(costs: dict[str, float], shares: dict[str, float], total: int,
               min_replicas: int = 1, max_replicas: int = 8) -> dict[str, int]:
    """Replicas per source: ``total`` split by cost × share, each clamped to
    ``[min_replicas, max_replicas]`` (a source out of the mix still gets ``min_replicas``,
    ready for when the schedule brings it in)."""
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"replicas: need 1 <= min ({min_replicas}) <= max ({max_replicas})")
    load = {n: costs[n] * max(shares.get(n, 0.0), 0.0) for n in costs}
    whole = sum(load.values())
    if whole <= 0:
        load, whole = {n: 1.0 for n in costs}, float(len(costs))
    return {n: max(min_replicas, min(max_replicas, round(total * load[n] / whole)))
            for n in costs}


class RayRankLoader(StepLoader):
    """A rank's loader whose decoding runs on per-source Ray actor pools (``ray.init`` first).

    ``total_replicas`` (default: ``num_workers`` per source) is split over sources by
    :func:`size_pools`; ``shares`` default to the mixture weights the plane reports now.
    ``pools`` (another loader's :attr:`pools`) shares that loader's actors: the ranks of one
    node can feed from one set of pools (its owner kills them on close).
    """

    def __init__(self, *args, total_replicas: int | None = None, min_replicas: int = 1,
                 max_replicas: int = 4, actor_cpus: float = 1.0,
                 shares: dict[str, float] | None = None, pools: dict | None = None,
                 **kw) -> None:
        super().__init__(*args, **kw)
        self._owned = pools is None
        self._turn = {name: 0 for name in self.spec.sources}
        self.depth = max(1, self._out.maxsize)
        if pools is not None:
            self.pools = pools
            return
        self.costs = measure_costs(self.spec)
        if shares is None:
            shares = {m["source"]: m["weight"] for m in self.client.status()["mixture"]}
        total = total_replicas or self.num_workers * len(self.spec.sources)
        self.replicas = size_pools(self.costs, shares, total, min_replicas, max_replicas)
        self.pools = {
            name: [SourceDecoder.options(num_cpus=actor_cpus).remote(
                DecoderSpec({name: self.spec.sources[name]}, self.spec.tokenizer,
                            self.spec.geometry, self.spec.max_open), self.decode_timeout)
                   for _ in range(n)]
            for name, n in self.replicas.items()}

    def _submit(self, ref: SampleRef, need: DecodeNeed | None):
        pool = self.pools[ref.source]
        self._turn[ref.source] += 1
        return pool[self._turn[ref.source] % len(pool)].decode.remote(ref, need)

    def _decoded_steps(self):
        pending: deque = deque()  # (step, table, refs, futures), oldest first
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
                work = self._work(table)
                pending.append((step, table, [r for r, _ in work],
                                [self._submit(r, need) for r, need in work]))
            if not pending:
                return
            step, table, refs, futures = pending.popleft()
            outs = ray.get(futures)  # each actor bounds each decode by decode_timeout
            yield step, table, DecodedStep({sample_id(r): o for r, o in zip(refs, outs)})

    def close(self) -> None:
        super().close()
        for pool in self.pools.values() if self._owned else ():
            for actor in pool:
                ray.kill(actor)
