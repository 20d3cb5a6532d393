"""A rank's plan + decoded samples -> one StepBatch (micro-batches and encoder items).

The plan (``omniscale.plan.RankPlan``, decoded from the served table) says which samples the
rank trains (its LLM rows: micro-batch, SP slice) and which media items it encodes for other
ranks (its encode rows). A sample is decoded once per
step however many rows name it, and only as far as this rank uses it (:func:`decode_work`).
A sample that failed to decode is handled by the policy: ``fail`` raises its CorruptSample;
``skip`` reports it to the plane, which quarantines it and hands back a replacement from the
same source, decoded here in its place, whole (every rank of an SP group reporting the same
sample gets the same replacement, so their slices still fit).

An encoder item of a replaced sample is dropped: the item it names no longer exists, and the
replacement's media travel whole in the consuming rank's PackedBatch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from omniscale.geometry import MediaGeometry
from omniscale.loaders.collate import PackedBatch, collate, media_tensor
from omniscale.loaders.decode import DecodeNeed
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.remote_io import add_stats
from omniscale.loaders.sequence import DecodedSample
from omniscale.loaders.worker import Decoded
from omniscale.media import MEDIA_KINDS
from omniscale.plan import RankPlan, item_kinds
from omniscale.refs import SampleRef

POLICIES = ("skip", "fail")
MAX_REPLACEMENTS = 8  # per bad sample: replacements can be bad too, but not forever


@dataclass
class EncodeItem:
    """A media item this rank encodes for ``consume_rank`` (the reshard map's producer side)."""

    ref: SampleRef
    kind: str  # "image" | "video" | "audio"
    index: int  # within its kind, in the sample's item order
    consume_rank: int
    tensor: torch.Tensor  # vision patches [t*h*w, D] or log-mel frames [frames, n_mels]
    grid_thw: tuple[int, int, int] | None
    frames: int | None


@dataclass
class StepBatch:
    """Everything one rank needs for one step."""

    step: int
    micro_batches: list[PackedBatch]
    encode_items: list[EncodeItem]
    metadata: dict  # the plan's: dp, num_micro_batches, predicted cost, imbalance, …
    plan_fp: str  # omniscale.plan.fingerprint of the plan: what commit sends back
    skipped: list[CorruptSample] = field(default_factory=list)
    replaced: list[tuple[SampleRef, SampleRef | None]] = field(default_factory=list)
    data_wait_s: float = 0.0  # time the trainer was blocked in next() for this step
    plan: RankPlan | None = None  # the rank's plan (the reshard map is derived from it)
    transfer_bytes: int = 0  # bytes worker processes handed over for this step
    # the readers' counters for this step (``loaders.remote_io.READ_STATS``: requests and
    # bytes from an object store, cache block hits and misses, retries); empty when local
    io: dict = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(int(b.cu_seqlens_S1.numel()) - 1 for b in self.micro_batches)

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.micro_batches)


@dataclass
class DecodedStep:
    """What the decode stage hands the assembler for a step (or a worker for a chunk of one,
    ``loaders.chunks``): samples decoded one by one, by :func:`sample_id`, and what a worker
    already built of the others -- micro-batches by index, encoder items by plan row."""

    samples: dict[tuple, Decoded]
    micro_batches: dict[int, PackedBatch] = field(default_factory=dict)
    encode_items: dict[int, EncodeItem] = field(default_factory=dict)
    transfer_bytes: int = 0  # what worker processes handed over for it
    io: dict = field(default_factory=dict)  # its readers' counters (``StepBatch.io``)

    def update(self, other: "DecodedStep") -> None:
        self.samples.update(other.samples)
        self.micro_batches.update(other.micro_batches)
        self.encode_items.update(other.encode_items)
        self.transfer_bytes += other.transfer_bytes
        add_stats(self.io, other.io)


def sample_id(ref: SampleRef) -> tuple:
    """A planned sample: (source, shard, key, epoch). A small source can put one key into
    a step twice, from two epochs; each is its own sample (and its own replacement)."""
    return (*ref.uid, ref.epoch)


def decode_work(plan: RankPlan, rank: int | None = None
                ) -> list[tuple[SampleRef, DecodeNeed | None]]:
    """The distinct samples a plan names, in first-mention order (one decode each), each
    with what data rank ``rank`` uses of it: the text if it trains the sample, the media items
    it encodes (its encode rows, and the encode_ranks of its LLM rows that name it). Media
    another rank encodes reach this rank as embeddings, so their pixels are not decoded here.
    ``rank`` None, or a sample this rank uses whole: None (decode it all). A table is decoded
    here (``omniscale.plan.decode_plan``)."""
    first: dict[tuple, SampleRef] = {}
    for ref in plan.refs:
        first.setdefault(sample_id(ref), ref)
    refs = list(first.values())
    if rank is None:
        return [(ref, None) for ref in refs]
    kinds, indices = plan.kind_X.tolist(), plan.item_index_X.tolist()
    text, items, whole = set(), {}, set()
    for ref, llm, kind, index, encoders in zip(plan.refs, plan.is_llm_X.tolist(), kinds,
                                               indices, plan.encode_ranks()):
        sid = sample_id(ref)
        used = items.setdefault(sid, set())
        if not llm:
            used.add((MEDIA_KINDS[kind], index))
            continue
        text.add(sid)
        order = _item_order(ref)
        if len(encoders) != len(order):  # a plan without an encoder plan: encoded here
            whole.add(sid)
        used.update(item for item, r in zip(order, encoders) if r == rank)
    work = []
    for ref in refs:
        sid = sample_id(ref)
        if sid in whole or (sid in text and len(items[sid]) == len(_item_order(ref))):
            work.append((ref, None))
        else:
            work.append((ref, DecodeNeed(sid in text, frozenset(items[sid]))))
    return work


def _item_order(ref: SampleRef) -> list[tuple[str, int]]:
    """A sample's media items as (kind, index within the kind), in the plane's item order."""
    return [(MEDIA_KINDS[kind], i) for kind, i in item_kinds(ref)]


class StepAssembler:
    """Applies the corrupt-sample policy and packs one step. ``report`` is the plane's
    ``report_corrupt`` (bound to this rank); ``decode`` decodes a replacement."""

    def __init__(self, rank: int, geometry: MediaGeometry, policy: str,
                 report: Callable[..., SampleRef | None], decode: Callable[[SampleRef], Decoded],
                 pin_memory: bool = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.rank, self.geometry, self.policy = rank, geometry, policy
        self.report, self.decode, self.pin_memory = report, decode, pin_memory
        self.corrupt_reasons: Counter = Counter()  # coarse reason -> samples skipped

    def assemble(self, step: int, plan: RankPlan, decoded: DecodedStep
                 ) -> StepBatch:
        """The step's batch: what workers built as it is, the rest packed here (a sample
        decoded alone goes through the policy first). A table is decoded here."""
        batch = StepBatch(step, [], [], dict(plan.metadata), plan.fingerprint, plan=plan,
                          transfer_bytes=decoded.transfer_bytes, io=dict(decoded.io))
        resolved: dict[tuple, tuple[DecodedSample | None, SampleRef]] = {}
        micro = [[] for _ in range(plan.num_micro_batches)]
        trained = [[] for _ in micro]  # the ref each sequence trains (a replacement's, if any)
        built, encoded = decoded.micro_batches, decoded.encode_items
        # Rows in plan order: samples are resolved (and reported) in first-mention order.
        rows = zip(plan.refs, plan.is_llm_X.tolist(), plan.micro_batch_X.tolist(),
                   plan.sp_size_X.tolist(), plan.sp_index_X.tolist(), plan.sp_slices_X,
                   plan.sp_heads_X, plan.kind_X.tolist(), plan.item_index_X.tolist(),
                   plan.consume_rank_X.tolist())
        for i, (ref, llm, mb, sp_size, sp_index, slices, heads, kind, index, consumer) in \
                enumerate(rows):
            if i in encoded:
                batch.encode_items.append(encoded[i])
                continue
            if llm and mb in built:
                continue
            sid = sample_id(ref)
            if sid not in resolved:
                resolved[sid] = self._resolve(step, ref, decoded.samples[sid], batch)
            sample, used = resolved[sid]
            as_planned = sample_id(used) == sid
            if sample is None:
                continue
            if llm:
                micro[mb].append((sample, sp_size, sp_index, slices, heads))
                trained[mb].append(used)
            elif as_planned:
                name = MEDIA_KINDS[kind]
                item = [m for m in sample.media if m.kind == name][index]
                batch.encode_items.append(EncodeItem(
                    ref, name, index, consumer, media_tensor(item), item.grid_thw, item.frames))
        while len(micro) <= max(built, default=-1):
            micro.append([])
            trained.append([])
        batch.micro_batches = [built.get(i) or collate(mb, self.geometry)
                               for i, mb in enumerate(micro)]
        for i, (packed, refs_of_mb) in enumerate(zip(batch.micro_batches, trained)):
            if i not in built:
                packed.seq_refs = refs_of_mb
        if self.pin_memory:
            _pin(batch)
        return batch

    def _resolve(self, step: int, ref: SampleRef, out: Decoded, batch: StepBatch
                 ) -> tuple[DecodedSample | None, SampleRef]:
        """The sample to train in the ref's place and its ref (``ref`` itself when the
        planned sample decoded; a replacement's otherwise)."""
        bad = ref
        for _ in range(MAX_REPLACEMENTS):
            if out.error is None:
                return out.sample, bad
            if self.policy == "fail":
                raise out.error
            batch.skipped.append(out.error)
            self.corrupt_reasons[reason_kind(out.error.reason)] += 1
            replacement = self.report(step, bad.source, bad.shard, bad.key, out.error.reason,
                                      bad.epoch)
            batch.replaced.append((bad, replacement))
            if replacement is None:
                return None, bad
            bad, out = replacement, self.decode(replacement)
        return None, bad


def reason_kind(reason: str) -> str:
    """A reason without the member name it starts with: what skips are counted by."""
    return reason.rsplit(": ", 1)[-1] if reason.startswith("member ") else reason


def _pin(batch: StepBatch) -> None:
    for mb in batch.micro_batches:
        for name, value in vars(mb).items():
            if isinstance(value, torch.Tensor):
                setattr(mb, name, value.pin_memory())
    for item in batch.encode_items:
        item.tensor = item.tensor.pin_memory()
