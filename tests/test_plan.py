"""The typed plan (``omniscale.plan``): a hand-built table decodes to the objects worked out by
hand below; a real plane's plans decode and encode back to the very tables it served (metadata
included), from the table or its IPC bytes; a table that lacks a column, has one of the wrong
type or a role the plan cannot have is refused in one line naming the column."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from omniscale.plan import (
    PLAN_SCHEMA,
    RankPlan,
    ReshardPlan,
    decode_plan,
    fingerprint,
    rows_to_table,
    with_metadata,
)
from omniscale.refs import refs_to_table


def _row(key, role, images=(), videos=(), audio=(), encode_ranks=None, kind=None, index=None,
         consume_rank=None, consume_span=None, micro_batch=None, sp=(None, None, None)):
    sp_size, sp_index, sp_first = sp
    return {"source_id": 0, "source": "s", "shard": "a.tar", "key": key, "offset": 0,
            "size": 1, "members": [], "llm_tokens": 10, "text_tokens": 4,
            "image_patches": list(images), "video_patches": list(videos),
            "audio_frames": list(audio), "epoch": 0, "target_tokens": 2, "role": role,
            "step": 7, "rank": 0, "micro_batch": micro_batch, "sp_size": sp_size,
            "sp_index": sp_index, "sp_first_rank": sp_first, "encode_ranks": encode_ranks,
            "item_kind": kind, "item_index": index, "consume_rank": consume_rank,
            "consume_span": consume_span}


ROWS = [
    # trained in micro-batch 1; its two images encoded on ranks 0 and 1
    _row("a", "llm", images=(4, 4), encode_ranks=[0, 1], micro_batch=1, sp=(1, 0, 0)),
    # encoded here: b's clip, for the SP group of ranks 0 and 1
    _row("b", "encode", videos=(8,), kind="video", index=0, consume_rank=0, consume_span=2),
    # slice 1 of 2 of c, in micro-batch 0 (its group starts at rank 1)
    _row("c", "llm", encode_ranks=[], micro_batch=0, sp=(2, 1, 1)),
    # encoded here: d's second audio clip, for rank 0 (a null span is one rank)
    _row("d", "encode", audio=(5, 6), kind="audio", index=1, consume_rank=0),
]
META = {"step": 7, "rank": 0, "dp": 2, "num_micro_batches": 3, "imbalance": 1.5}


def _table(rows=ROWS, meta=META):
    return with_metadata(pa.Table.from_pylist(rows, schema=PLAN_SCHEMA), meta)


def test_a_hand_built_table_decodes_to_the_plan_worked_out_by_hand():
    plan = decode_plan(_table())
    assert (plan.step, plan.rank, dict(plan.metadata)) == (7, 0, META)
    assert plan.fingerprint == fingerprint(_table())
    assert [r.key for r in plan.refs] == ["a", "b", "c", "d"]
    assert plan.is_llm_X.tolist() == [True, False, True, False]
    assert plan.micro_batch_X.tolist() == [1, -1, 0, -1]
    assert plan.kind_X.tolist() == [-1, 1, -1, 2]  # MEDIA_KINDS: image, video, audio
    assert plan.item_index_X.tolist() == [-1, 0, -1, 1]
    assert plan.consume_span_X.tolist() == [-1, 2, -1, 1]
    assert plan.encode_ranks() == [[0, 1], [], [], []]
    # three micro-batches (the metadata's count), the last one empty
    assert [([r.key for r in mb.refs], mb.sp_size_S.tolist(), mb.sp_index_S.tolist())
            for mb in plan.micro_batches] == [(["c"], [2], [1]), (["a"], [1], [0]), ([], [], [])]
    assert list(plan.encodes.items()) == [(1, plan.refs[1], "video", 0, 0),
                                          (3, plan.refs[3], "audio", 1, 0)]
    a0, a1 = ("s", "a.tar", "a", 0, 0), ("s", "a.tar", "a", 0, 1)
    b, d = ("s", "a.tar", "b", 1, 0), ("s", "a.tar", "d", 2, 1)
    assert plan.consumed_items() == [(a0, 0), (a1, 1)]
    # sent in (rank, item) order: b to both ranks of its group, d to rank 0
    assert plan.reshard_plan(2) == ReshardPlan([b, d, b], [2, 1], [a0, a1], [1, 1])
    with pytest.raises(ValueError, match=r"plan of rank 0: sends to rank\(s\) \[1\], outside"):
        plan.reshard_plan(1)
    with pytest.raises(ValueError):  # read-only: the plan is decoded once and shared
        plan.micro_batch_X[0] = 3


def test_without_metadata_step_and_rank_come_from_the_rows():
    plan = decode_plan(pa.Table.from_pylist(ROWS, schema=PLAN_SCHEMA))
    assert (plan.step, plan.rank, plan.num_micro_batches) == (7, 0, 2)


def _encoded(plan: RankPlan) -> pa.Table:
    """The table of a typed plan, by the plane's own writer (``rows_to_table``)."""
    n = plan.num_rows
    rows = np.arange(n)
    table = rows_to_table(
        refs_to_table(list(plan.refs)), rows, pos_X=rows, is_llm_X=plan.is_llm_X,
        step_X=np.full(n, plan.step), rank_X=np.full(n, plan.rank),
        micro_batch_X=plan.micro_batch_X, sp_size_X=plan.sp_size_X,
        sp_index_X=plan.sp_index_X, sp_first_rank_X=plan.sp_first_rank_X,
        encode_count_X=np.diff(plan.encode_ranks_X1), encode_rank_V=plan.encode_rank_V,
        kind_X=plan.kind_X, item_index_X=plan.item_index_X,
        consume_rank_X=plan.consume_rank_X, consume_span_X=plan.consume_span_X)
    return with_metadata(table, dict(plan.metadata))


def test_a_real_planes_plans_round_trip(demo_root, tmp_path):
    from omniscale.dataplane.plane import DataPlane, PlaneConfig
    from omniscale.parallel.reshard import reshard_plan
    from tests.demo_data import copy_demo
    from tests.loaders.pipeline_fixtures import all_modalities_spec

    demo = copy_demo(demo_root, tmp_path / "demo")
    config = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                         sp_max=2, snapshot_every=4)
    plane = DataPlane(all_modalities_spec(demo), tmp_path / "state", config)
    kinds, split = set(), False
    for step in range(12):  # until an SP-split sample came by (test_plan_table's windows)
        if split and step >= 2:
            break
        tables = [plane.get_plan(step, r) for r in range(2)]
        plans = [decode_plan(t) for t in tables]
        for r, (table, plan) in enumerate(zip(tables, plans)):
            assert (plan.step, plan.rank) == (step, r)
            assert plan.fingerprint == fingerprint(table)
            assert _encoded(plan).equals(table, check_metadata=True)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
            again = decode_plan(sink.getvalue())
            assert _encoded(again).equals(table, check_metadata=True)
            assert plan.reshard_plan(2) == reshard_plan(plans, r)  # the sides agree
            kinds |= set(plan.encodes.kind_E.tolist())
            split |= bool((plan.sp_size_X > 1).any())
    assert kinds == {0, 1, 2} and split  # encoder rows of every kind, an SP-split sample


@pytest.mark.parametrize("change, message", [
    (lambda t: t.drop_columns(["consume_span"]), "plan table: no column 'consume_span'"),
    (lambda t: t.set_column(t.schema.get_field_index("micro_batch"), "micro_batch",
                            t.column("micro_batch").cast(pa.int64())),
     "plan table: column 'micro_batch' is int64, expected int32"),
    (lambda t: t.set_column(0, "source_id", t.column("source_id").cast(pa.string())),
     "plan table: column 'source_id' is string, expected int32"),
    (lambda t: t.set_column(t.schema.get_field_index("role"), "role",
                            pa.array(["llm", "encode", "llm", "train"])),
     "plan table: column 'role' holds 'train', not 'llm' or 'encode'"),
    (lambda t: t.set_column(t.schema.get_field_index("item_kind"), "item_kind",
                            pa.array([None, "video", None, "smell"])),
     "plan table: column 'item_kind' holds 'smell' on an encode row"),
])
def test_a_table_the_plan_cannot_read_is_refused_in_one_line(change, message):
    with pytest.raises(ValueError) as refused:
        decode_plan(change(_table()))
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
