"""A rank's share of a StepPlan as the Arrow table the plane serves (``get_plan``): the
dataplane side of the plan's wire form. The table's columns, their meaning and its metadata
are :mod:`omniscale.plan`'s (the one module naming them, which also decodes a table into the
typed plan a loader works from); this module builds the tables from the balancer's StepPlan.

A rank's rows are its LLM placements in placement order, then the encoder items it encodes in
item order. Each side of the reshard can be derived from the rank's own table
(``omniscale.plan.RankPlan.reshard_plan``).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omniscale.balancer.types import StepPlan, split_heads, split_lengths
from omniscale.media import AUDIO, IMAGE, VIDEO
from omniscale.plan import METADATA_KEY, rows_to_table, slice_fingerprints
from omniscale.refs import RefTable, SampleRef


def rank_tables(plan: StepPlan, refs: RefTable | list[SampleRef], first_item_N: np.ndarray,
                step: int, dp: int, side: dict | None = None) -> list[pa.Table]:
    """The plan of absolute step ``step`` split into one table per rank.

    ``refs`` are the window's samples (window-local index = position); ``first_item_N`` is
    each sample's first window item id (WindowSamples.item_offsets_N1[:-1]).

    A rank's rows are its LLM placements in placement order, then the encoder items it
    encodes in item order. ``side``: more metadata for every rank (what the best baseline
    would predict). :func:`window_rank_tables` for one step.
    """
    tables = window_rank_tables([plan], refs, first_item_N, [step], [dp], [side])
    return [tables[(step, r)] for r in range(dp)]


def window_rank_tables(plans: list[StepPlan], refs: RefTable | list[SampleRef],
                       first_item_N: np.ndarray,
                       steps: list[int], dps: list[int], sides: list[dict | None],
                       prints: dict[tuple[int, int], str] | None = None
                       ) -> dict[tuple[int, int], pa.Table]:
    """:func:`rank_tables` of several steps of one window, by (step, rank), built at once:
    every row of every step, in (step, rank) order (a stable sort), in one table whose slices
    are the ranks' tables. The tens of Arrow calls a table costs whatever its size were most
    of a step's plan on small steps; here they are paid once per window.
    ``prints``: filled with each table's ``plan.fingerprint``, read from the one table (what a
    commit checks; slice by slice it cost as much as building the tables)."""
    first_item_N = np.asarray(first_item_N, np.int64)
    # The steps' samples, once each, as a ref table the rows take from.
    used_U = np.unique(np.concatenate([np.asarray(p.sample_P, np.int64) for p in plans]
                                      + [np.asarray(p.item_sample_M, np.int64) for p in plans]))
    ref_table = RefTable.of(refs).table.take(pa.array(used_U))
    counts_U = tuple(np.asarray(pc.list_value_length(ref_table.column(name)), np.int64)
                     for name in ("image_patches", "video_patches", "audio_frames"))
    parts = [_step_rows(plan, used_U, counts_U, first_item_N) for plan in plans]
    rows = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    # j_X: each row's step within the window
    j_X = np.repeat(np.arange(len(plans)), [len(part["llm"]) for part in parts])
    order = np.lexsort((rows["rank"], j_X))  # stable: each rank's rows in step order
    table = rows_to_table(
        ref_table, order, pos_X=rows["pos"], is_llm_X=rows["llm"],
        step_X=np.asarray(steps, np.int64)[j_X], rank_X=rows["rank"],
        micro_batch_X=rows["micro_batch"], sp_size_X=rows["sp_size"],
        sp_index_X=rows["sp_index"], sp_first_rank_X=rows["sp_first_rank"],
        encode_count_X=rows["count"], encode_rank_V=rows["encode_ranks"], kind_X=rows["kind"],
        sp_slice_count_X=rows["slice_count"], sp_slice_V=rows["slices"],
        sp_head_count_X=rows["head_count"], sp_head_V=rows["heads"],
        item_index_X=rows["item_index"], consume_rank_X=rows["consume_rank"],
        consume_span_X=rows["consume_span"])
    width = max(dps)
    counts = np.bincount(j_X * width + rows["rank"], minlength=len(plans) * width)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    if prints is not None:
        keys = [(step, r) for step, dp in zip(steps, dps) for r in range(dp)]
        at_K = np.array([j * width + r for j, dp in enumerate(dps) for r in range(dp)],
                        np.int64)
        prints.update(zip(keys, slice_fingerprints(table, starts[at_K], counts[at_K])))
    out = {}
    for j, (plan, step, dp, side) in enumerate(zip(plans, steps, dps, sides)):
        # The step's figures once, not once per rank: each sums the whole [R, B] grid, which
        # per rank made a step's tables O(R²) (seconds at 4,096 ranks).
        # a finite float's JSON is its repr (json.dumps per rank was 16,384 calls a window)
        cost_R = [json.dumps(c) if not math.isfinite(c) else c.__repr__()
                  for c in map(float, np.asarray(plan.rank_cost_R).tolist())]
        step_max = plan.ddp_time  # time: the ranks' speeds count (equal: the costliest rank)
        head, tail = _metadata_text(step, dp, plan.num_micro_batches, {
            "step_max_cost": step_max, "lower_bound": plan.lower_bound,
            "imbalance": plan.imbalance, "reshard": plan.reshard, **(side or {})})
        for r in range(dp):
            at = j * width + r
            text = f"{head}{r}{tail[0]}{cost_R[r]}{tail[1]}"
            out[(step, r)] = table.slice(int(starts[at]), int(counts[at])) \
                .replace_schema_metadata({METADATA_KEY: text})
    return out


def _metadata_text(step: int, dp: int, num_micro_batches: int, rest: dict
                   ) -> tuple[str, tuple[str, str]]:
    """A step's plan metadata (``omniscale.plan.with_metadata``'s JSON) as the text around the
    two values that differ per rank, the rank and its predicted cost: (text before the rank,
    (text between it and the cost, text after the cost)). Serialising the whole dict per rank
    was most of a step's table time at thousands of ranks; the text is the same, key order
    included: step, rank, dp, num_micro_batches, predicted_cost, then ``rest``."""
    assert not {"step", "rank", "dp", "num_micro_batches", "predicted_cost"} & set(rest)
    head = json.dumps({"step": step, "rank": 0})
    head = head[:head.rindex("0")]
    middle = json.dumps({"dp": dp, "num_micro_batches": num_micro_batches,
                         "predicted_cost": 0.0})
    after = json.dumps(rest)
    return head, (", " + middle[1:middle.rindex("0.0")], (", " + after[1:]) if rest else "}")


def _step_rows(plan: StepPlan, used_U: np.ndarray, counts_U: tuple, first_item_N: np.ndarray
               ) -> dict[str, np.ndarray]:
    """One step's rows as arrays, in its natural order (LLM placements, then encoder items):
    ``pos`` (the sample's position in ``used_U``), ``llm``, the plan columns, ``kind`` (-1 on
    LLM rows), and ``count``/``encode_ranks`` (each LLM row's list of encoding ranks, flat)."""
    sample_P = np.asarray(plan.sample_P, np.int64)
    rank_P = np.asarray(plan.rank_P, np.int64)
    item_M = np.asarray(plan.item_M, np.int64)
    item_sample_M = np.asarray(plan.item_sample_M, np.int64)
    encode_M = np.asarray(plan.encode_rank_M, np.int64)
    P, M = len(sample_P), len(item_M)
    img_U, vid_U, aud_U = counts_U
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
    kind_M = np.where(j_M < img_M, IMAGE, np.where(j_M < img_M + vid_M, VIDEO, AUDIO))
    # the item's index among the sample's items of its kind
    index_M = j_M - np.where(kind_M == IMAGE, 0, np.where(kind_M == VIDEO, img_M,
                                                          img_M + vid_M))
    zeros_M, zeros_P = np.zeros(M, np.int64), np.zeros(P, np.int64)
    # Sized by speed: every row of such a split sample lists its group's slice lengths, and
    # its group's heads.
    slice_count_P, slices = _group_lists(sample_P, plan.sp_size_P, split_lengths(plan))
    head_count_P, heads = _group_lists(sample_P, plan.sp_size_P, split_heads(plan))
    return {
        "pos": np.concatenate([pos_P, pos_M]),
        "llm": np.concatenate([np.ones(P, bool), np.zeros(M, bool)]),
        "rank": np.concatenate([rank_P, encode_M]),
        "micro_batch": np.concatenate([np.asarray(plan.micro_batch_P, np.int64), zeros_M]),
        "sp_size": np.concatenate([np.asarray(plan.sp_size_P, np.int64), zeros_M]),
        "sp_index": np.concatenate([np.asarray(plan.sp_index_P, np.int64), zeros_M]),
        "sp_first_rank": np.concatenate([sp_first_P, zeros_M]),
        "count": np.concatenate([count_P, zeros_M]),
        "slice_count": np.concatenate([slice_count_P, zeros_M]),
        "slices": slices,
        "head_count": np.concatenate([head_count_P, zeros_M]),
        "heads": heads,
        "encode_ranks": encode_ranks,
        "kind": np.concatenate([np.full(P, -1, np.int64), kind_M]),
        "item_index": np.concatenate([zeros_P, index_M]),
        "consume_rank": np.concatenate([zeros_P, np.asarray(plan.consume_rank_M, np.int64)]),
        "consume_span": np.concatenate([zeros_P, span_M]),
    }


def _group_lists(sample_P: np.ndarray, sp_size_P, by_sample: dict[int, list[int]]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The LLM rows' lists of a per-sample value list (``by_sample``: a split sample's slice
    lengths or heads, in slice order) as (count per row, 0 for none; values flat in row
    order)."""
    listed_P = np.array([s in by_sample for s in sample_P.tolist()], bool)
    count_P = np.where(listed_P, np.asarray(sp_size_P, np.int64), 0)
    values = np.array([v for s in sample_P[listed_P].tolist() for v in by_sample[s]], np.int64)
    return count_P, values
