"""A rank's share of a StepPlan as the Arrow table the plane serves (``get_plan``).

One row per thing the rank must do, with the SampleRef columns (dataplane.refs.REF_SCHEMA)
saying which sample:

- ``role = "llm"``: a sample (or its SP slice) in this rank's LLM micro-batch ``micro_batch``;
  ``sp_size``/``sp_index``/``sp_first_rank`` say which slice of which aligned SP group, and
  ``encode_ranks`` lists, per encoder item of the sample, the rank that encodes it (the
  reshard map seen from the consumer);
- ``role = "encode"``: an encoder item this rank encodes — item ``item_index`` of kind
  ``item_kind`` of that sample — whose embeddings go to ranks ``consume_rank`` ..
  ``consume_rank + consume_span - 1`` (the sample's SP group; one rank when it is not split):
  the reshard map seen from the producer. Each side of the exchange can be derived from the
  rank's own table (parallel.reshard.local_reshard_plan).

Table metadata (key ``omniscale``, JSON): step, rank, dp, num_micro_batches, predicted cost of
this rank and of the step's slowest rank, lower bound, imbalance, whether the step reshards.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa

from omniscale.balancer.types import ENCODER_KINDS, StepPlan
from omniscale.dataplane.refs import REF_SCHEMA, SampleRef, refs_to_table

PLAN_FIELDS = [
    ("role", pa.string()),
    ("step", pa.int64()),
    ("rank", pa.int32()),
    ("micro_batch", pa.int32()),
    ("sp_size", pa.int32()),
    ("sp_index", pa.int32()),
    ("sp_first_rank", pa.int32()),
    ("encode_ranks", pa.list_(pa.int32())),
    ("item_kind", pa.string()),
    ("item_index", pa.int32()),
    ("consume_rank", pa.int32()),
    ("consume_span", pa.int32()),
]
PLAN_SCHEMA = pa.schema(list(REF_SCHEMA) + [pa.field(n, t) for n, t in PLAN_FIELDS])
METADATA_KEY = b"omniscale"


def item_kinds(ref: SampleRef) -> list[tuple[int, int]]:
    """(kind id, index within kind) of a sample's encoder items, in the plane's item order:
    images, then videos, then audio clips, each in member order."""
    return ([(0, i) for i in range(len(ref.image_patches))]
            + [(1, i) for i in range(len(ref.video_patches))]
            + [(2, i) for i in range(len(ref.audio_frames))])


def rank_tables(plan: StepPlan, refs: list[SampleRef], first_item_N: np.ndarray,
                step: int, dp: int, side: dict | None = None) -> list[pa.Table]:
    """The plan of absolute step ``step`` split into one table per rank.

    ``refs`` are the window's samples (window-local index = position); ``first_item_N`` is
    each sample's first window item id (WindowSamples.item_offsets_N1[:-1]).

    A rank's rows are its LLM placements in placement order, then the encoder items it
    encodes in item order. Built once per step with array operations: every row of the step
    in that order (a stable sort by rank), then each rank's table is a zero-copy slice.
    ``side``: more metadata for every rank (what the best baseline would predict).
    """
    sample_P = np.asarray(plan.sample_P, np.int64)
    rank_P = np.asarray(plan.rank_P, np.int64)
    item_M = np.asarray(plan.item_M, np.int64)
    item_sample_M = np.asarray(plan.item_sample_M, np.int64)
    encode_M = np.asarray(plan.encode_rank_M, np.int64)
    P, M = len(sample_P), len(item_M)
    first_item_N = np.asarray(first_item_N, np.int64)

    # The step's samples, once each, as a ref table the rows take from.
    used_U = np.unique(np.concatenate([sample_P, item_sample_M]))
    step_refs = [refs[i] for i in used_U.tolist()]
    ref_table = refs_to_table(step_refs)
    img_U = np.array([len(r.image_patches) for r in step_refs], np.int64)
    vid_U = np.array([len(r.video_patches) for r in step_refs], np.int64)
    aud_U = np.array([len(r.audio_frames) for r in step_refs], np.int64)
    pos_P, pos_M = np.searchsorted(used_U, sample_P), np.searchsorted(used_U, item_sample_M)

    # LLM rows: the SP group's first rank, and the rank encoding each of the sample's items.
    first_rank = {}
    for sample, rank in zip(sample_P[plan.sp_index_P == 0].tolist(),
                            rank_P[plan.sp_index_P == 0].tolist()):
        first_rank[sample] = rank
    sp_first_P = np.array([first_rank[s] for s in sample_P.tolist()], np.int64)
    count_P = (img_U + vid_U + aud_U)[pos_P]
    ends_P = np.cumsum(count_P)
    ids = np.repeat(first_item_N[sample_P] - (ends_P - count_P), count_P) + \
        np.arange(int(ends_P[-1]) if P else 0)
    encode_ranks = np.zeros(0, np.int64)
    if len(ids):
        lookup = np.full(int(max(ids.max(), item_M.max(initial=-1))) + 1, -1, np.int64)
        lookup[item_M] = encode_M
        encode_ranks = lookup[ids]
        if (encode_ranks < 0).any():
            raise KeyError(int(ids[np.flatnonzero(encode_ranks < 0)[0]]))

    # Encoder rows: which item of which kind (images, then videos, then audio clips), and
    # how many ranks (the sample's SP group) consume it.
    span_of = dict(zip(sample_P.tolist(), np.asarray(plan.sp_size_P, np.int64).tolist()))
    span_M = np.array([span_of[s] for s in item_sample_M.tolist()], np.int64)
    j_M = item_M - first_item_N[item_sample_M]
    img_M, vid_M = img_U[pos_M], vid_U[pos_M]
    image, video, audio = (ENCODER_KINDS.index(k) for k in ("image", "video", "audio"))
    kind_M = np.where(j_M < img_M, image, np.where(j_M < img_M + vid_M, video, audio))
    # the item's index among the sample's items of its kind
    index_M = j_M - np.where(kind_M == image, 0, np.where(kind_M == video, img_M,
                                                          img_M + vid_M))

    llm_X = np.concatenate([np.ones(P, bool), np.zeros(M, bool)])
    enc_X = ~llm_X
    rank_X = np.concatenate([rank_P, encode_M])
    order = np.argsort(rank_X, kind="stable")
    counts_R = np.bincount(rank_X, minlength=dp)[:dp] if len(rank_X) else np.zeros(dp, np.int64)
    starts_R = np.concatenate([[0], np.cumsum(counts_R)[:-1]]).astype(np.int64)

    def ints(values, mask):
        return pa.array(np.asarray(values, np.int64), type=pa.int32(), mask=mask)

    zeros_M, zeros_P = np.zeros(M, np.int64), np.zeros(P, np.int64)
    offsets = np.concatenate([[0], ends_P, np.full(M, ends_P[-1] if P else 0)])
    extra = {
        "role": pa.array(np.where(llm_X, "llm", "encode").astype(object), type=pa.string()),
        "step": pa.array(np.full(P + M, step, np.int64), type=pa.int64()),
        "rank": ints(rank_X, None),
        "micro_batch": ints(np.concatenate([plan.micro_batch_P, zeros_M]), enc_X),
        "sp_size": ints(np.concatenate([plan.sp_size_P, zeros_M]), enc_X),
        "sp_index": ints(np.concatenate([plan.sp_index_P, zeros_M]), enc_X),
        "sp_first_rank": ints(np.concatenate([sp_first_P, zeros_M]), enc_X),
        "encode_ranks": pa.ListArray.from_arrays(
            pa.array(offsets.astype(np.int32)), pa.array(encode_ranks, type=pa.int32()),
            type=pa.list_(pa.int32()), mask=pa.array(enc_X)),
        "item_kind": pa.array(np.concatenate([np.full(P, None, object),
                                              np.array(ENCODER_KINDS, object)[kind_M]]),
                              type=pa.string()),
        "item_index": ints(np.concatenate([zeros_P, index_M]), llm_X),
        "consume_rank": ints(np.concatenate([zeros_P, plan.consume_rank_M]), llm_X),
        "consume_span": ints(np.concatenate([zeros_P, span_M]), llm_X),
    }
    take = pa.array(order)
    rows = ref_table.take(pa.array(np.concatenate([pos_P, pos_M])[order]))
    columns = rows.columns + [extra[name].take(take) for name, _ in PLAN_FIELDS]
    table = pa.Table.from_arrays(columns, schema=PLAN_SCHEMA).combine_chunks()
    cost_R = plan.rank_cost_R
    shared = {"num_micro_batches": plan.num_micro_batches}
    step_max = float(cost_R.max()) if len(cost_R) else 0.0
    lower_bound, imbalance = plan.lower_bound, plan.imbalance
    out = []
    for r in range(dp):
        meta = {"step": step, "rank": r, "dp": dp, **shared,
                "predicted_cost": float(cost_R[r]) if len(cost_R) else 0.0,
                "step_max_cost": step_max, "lower_bound": lower_bound,
                "imbalance": imbalance, "reshard": plan.reshard, **(side or {})}
        out.append(table.slice(int(starts_R[r]), int(counts_R[r]))
                   .replace_schema_metadata({METADATA_KEY: json.dumps(meta)}))
    return out


def plan_metadata(table: pa.Table) -> dict:
    """The ``omniscale`` metadata of a served plan table."""
    return json.loads((table.schema.metadata or {}).get(METADATA_KEY, b"{}"))


def fingerprint(table: pa.Table) -> str:
    """What a rank received in a step, as a short hash of its sorted (source, shard, key,
    role) rows: recorded at commit so an audit can check a replay reproduced it."""
    keys = sorted(zip(table.column("source").to_pylist(), table.column("shard").to_pylist(),
                      table.column("key").to_pylist(), table.column("role").to_pylist(),
                      table.column("sp_index").to_pylist()), key=str)
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:16]


def step_fingerprint(prints: list[str]) -> str:
    """A whole step's fingerprint: every rank's :func:`fingerprint`, in rank order. A commit
    of the whole step at once carries it, proving the committer holds every rank's plan."""
    return hashlib.sha256("\n".join(prints).encode()).hexdigest()[:16]
