"""A rank's plan cut into worker chunks, and what a worker makes of one: whole micro-batches.

The plan names every sample a step needs before any is decoded, so a worker can do more than
decode: given all the samples of a micro-batch it packs the micro-batch itself
(``loaders.collate``) and builds the encoder items the plan's ``encode`` rows ask of those
samples. The trainer side then only views the finished tensors out of the worker's buffer
(``loaders.transfer.pack``): no per-sample hand-over, no copy into a batch.

A chunk is the samples of one micro-batch (or of several, when a sample's rows name more than
one), or a share of the samples this rank only encodes media of. Each distinct sample is in
exactly one chunk, so it is decoded once per step as before. A sample that fails to decode
leaves its micro-batch unpacked: the worker returns that micro-batch's samples one by one and
the trainer side applies the corrupt-sample policy (a replacement from the plane) and packs it
(``loaders.assemble``), exactly as when every sample comes back alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from omniscale.geometry import MediaGeometry
from omniscale.loaders.assemble import DecodedStep, EncodeItem, decode_work, sample_id
from omniscale.loaders.collate import collate, media_items, media_tensor
from omniscale.loaders.decode import DecodeNeed
from omniscale.loaders.worker import Decoded
from omniscale.media import MEDIA_KINDS as KINDS
from omniscale.plan import RankPlan
from omniscale.refs import SampleRef


@dataclass
class ChunkWork:
    """One worker item: distinct samples to decode, and what to build of them."""

    work: list[tuple[SampleRef, DecodeNeed | None]]
    # micro-batch index -> its sequences in plan order: (index in ``work``, sp_size, sp_index,
    # slice lengths or None: ``omniscale.plan.MicroBatchPlan.sequences``)
    micro: dict[int, list[tuple]] = field(default_factory=dict)
    # the plan's encode rows on these samples: (row, index in ``work``, kind, index, consumer)
    encode: list[tuple[int, int, str, int, int]] = field(default_factory=list)


def plan_chunks(plan: RankPlan, rank: int | None, encode_parts: int = 1
                ) -> list[ChunkWork]:
    """The plan's decode work (``assemble.decode_work``, what ``rank`` uses of each sample;
    None: whole samples) cut into chunks: one per micro-batch, in order, then the samples
    only encoded here in ``encode_parts`` chunks. Empty for a plan with no samples. A table
    is decoded here (``omniscale.plan.decode_plan``)."""
    work = decode_work(plan, rank)
    if not work:
        return []
    where = {sample_id(ref): i for i, (ref, _) in enumerate(work)}
    micro: dict[int, list[tuple]] = {}
    home: dict[int, int] = {}  # sample (index in work) -> a micro-batch training it
    joined = _Groups()  # micro-batches that share a sample go to one worker together
    for mb_plan in plan.micro_batches:
        for ref, *layout in mb_plan.sequences():  # size, index, slices, heads
            w = where[sample_id(ref)]
            micro.setdefault(mb_plan.index, []).append((w, *layout))
            joined.union(home.setdefault(w, mb_plan.index), mb_plan.index)
    encode: dict[int, list[tuple[int, str, int, int]]] = {}  # sample -> its encode rows
    for row, ref, kind, index, consumer in plan.encodes.items():
        encode.setdefault(where[sample_id(ref)], []).append((row, kind, index, consumer))
    groups: dict[int, list[int]] = {}
    for mb in sorted(micro):
        groups.setdefault(joined.find(mb), []).append(mb)
    chunks = []
    for mbs in groups.values():
        members = sorted({w for mb in mbs for w, *_ in micro[mb]})
        chunks.append(_chunk(work, members, {mb: micro[mb] for mb in mbs}, encode))
    only_encoded = [w for w in range(len(work)) if w not in home]
    parts = max(1, min(encode_parts, len(only_encoded)))
    for p in range(parts):
        members = only_encoded[p * len(only_encoded) // parts:
                               (p + 1) * len(only_encoded) // parts]
        if members:
            chunks.append(_chunk(work, members, {}, encode))
    return chunks


def _chunk(work: list, members: list[int], micro: dict, encode: dict) -> ChunkWork:
    """A ChunkWork over ``members`` (indices into the plan's work), renumbered locally."""
    local = {w: i for i, w in enumerate(members)}
    return ChunkWork(
        [work[w] for w in members],
        {mb: [(local[w], *rest) for w, *rest in seqs] for mb, seqs in micro.items()},
        [(row, local[w], kind, index, consumer)
         for w in members for row, kind, index, consumer in encode.get(w, ())])


class _Groups:
    """Union-find over micro-batch indices."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def decode_chunk(chunk: ChunkWork | None, decode_all: Callable[[list], list[Decoded]],
                 geometry: MediaGeometry) -> DecodedStep:
    """What a worker returns for a chunk (None: a plan with nothing to decode), its samples
    decoded by ``decode_all`` (``TimedDecoder.decode_all``): its
    micro-batches packed and its encode rows' items where every sample decoded, the samples
    one by one where one did not (the trainer side decides their policy)."""
    out = DecodedStep({})
    if chunk is None:
        return out
    outs = decode_all(chunk.work)
    loose: set[int] = {i for i, o in enumerate(outs) if o.error is not None}
    packed_rows = {}  # (sample, kind, index) -> its rows in a packed micro-batch
    for mb, seqs in chunk.micro.items():
        if any(w in loose for w, *_ in seqs):
            loose.update(w for w, *_ in seqs)  # packed by the trainer side, with replacements
            continue
        batch = collate([(outs[w].sample, *rest) for w, *rest in seqs], geometry)
        batch.seq_refs = [outs[w].ref for w, *_ in seqs]
        out.micro_batches[mb] = batch
        packed_rows.update(((seqs[seq][0], KINDS[kind], index), tensor)
                           for seq, kind, index, tensor, _, _ in media_items(batch)
                           if tensor is not None)
    for row, w, kind, index, consumer in chunk.encode:
        if w in loose:
            continue
        sample = outs[w].sample
        item = [m for m in sample.media if m.kind == kind][index]
        # The same rows of the packed micro-batch when it holds them: handed over once.
        tensor = packed_rows.get((w, kind, index))
        if tensor is None:
            tensor = media_tensor(item)
        out.encode_items[row] = EncodeItem(outs[w].ref, kind, index, consumer, tensor,
                                           item.grid_thw, item.frames)
    out.samples = {sample_id(outs[w].ref): outs[w] for w in sorted(loose)}
    return out
