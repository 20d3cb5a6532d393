"""A rank's share of a StepPlan as the Arrow table the plane serves (``get_plan``).

One row per thing the rank must do, with the SampleRef columns (dataplane.refs.REF_SCHEMA)
saying which sample:

- ``role = "llm"``: a sample (or its SP slice) in this rank's LLM micro-batch ``micro_batch``;
  ``sp_size``/``sp_index``/``sp_first_rank`` say which slice of which aligned SP group, and
  ``encode_ranks`` lists, per encoder item of the sample, the rank that encodes it (the
  reshard map seen from the consumer);
- ``role = "encode"``: an encoder item this rank encodes — item ``item_index`` of kind
  ``item_kind`` of that sample — whose embeddings go to ``consume_rank`` (the reshard map seen
  from the producer).

Table metadata (key ``omniscale``, JSON): step, rank, dp, num_micro_batches, predicted cost of
this rank and of the step's slowest rank, lower bound, imbalance, whether the step reshards.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa

from balancer.types import ENCODER_KINDS, StepPlan
from dataplane.refs import REF_SCHEMA, SampleRef, refs_to_table

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
                step: int, dp: int) -> list[pa.Table]:
    """The plan of absolute step ``step`` split into one table per rank.

    ``refs`` are the window's samples (window-local index = position); ``first_item_N`` is
    each sample's first window item id (WindowSamples.item_offsets_N1[:-1]).
    """
    encode_rank_of = dict(zip(plan.item_M.tolist(), plan.encode_rank_M.tolist()))
    rows: list[list[tuple[SampleRef, dict]]] = [[] for _ in range(dp)]
    first_rank: dict[int, int] = {}
    for sample, rank, index in zip(plan.sample_P.tolist(), plan.rank_P.tolist(),
                                   plan.sp_index_P.tolist()):
        if index == 0:
            first_rank[sample] = rank
    for sample, rank, mb, size, index in zip(plan.sample_P.tolist(), plan.rank_P.tolist(),
                                             plan.micro_batch_P.tolist(),
                                             plan.sp_size_P.tolist(), plan.sp_index_P.tolist()):
        ref = refs[sample]
        n_items = len(item_kinds(ref))
        first = int(first_item_N[sample])
        rows[rank].append((ref, {
            "role": "llm", "micro_batch": mb, "sp_size": size, "sp_index": index,
            "sp_first_rank": first_rank[sample],
            "encode_ranks": [encode_rank_of[first + j] for j in range(n_items)]}))
    for item, sample, encode, consume in zip(plan.item_M.tolist(), plan.item_sample_M.tolist(),
                                             plan.encode_rank_M.tolist(),
                                             plan.consume_rank_M.tolist()):
        ref = refs[sample]
        kind, index = item_kinds(ref)[item - int(first_item_N[sample])]
        rows[encode].append((ref, {"role": "encode", "item_kind": ENCODER_KINDS[kind],
                                   "item_index": index, "consume_rank": consume}))
    cost_R = plan.rank_cost_R
    return [_table(rows[r], step, r, {
        "step": step, "rank": r, "dp": dp, "num_micro_batches": plan.num_micro_batches,
        "predicted_cost": float(cost_R[r]) if len(cost_R) else 0.0,
        "step_max_cost": float(cost_R.max()) if len(cost_R) else 0.0,
        "lower_bound": plan.lower_bound, "imbalance": plan.imbalance,
        "reshard": plan.reshard}) for r in range(dp)]


def _table(rows: list[tuple[SampleRef, dict]], step: int, rank: int, meta: dict) -> pa.Table:
    refs = refs_to_table([ref for ref, _ in rows])
    columns = {name: [extra.get(name) for _, extra in rows] for name, _ in PLAN_FIELDS}
    columns["step"] = [step] * len(rows)
    columns["rank"] = [rank] * len(rows)
    columns["encode_ranks"] = [extra.get("encode_ranks") for _, extra in rows]
    extra = pa.Table.from_pydict(columns, schema=pa.schema([pa.field(n, t) for n, t in PLAN_FIELDS]))
    table = pa.Table.from_arrays(refs.columns + extra.columns, schema=PLAN_SCHEMA)
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(meta)})


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
