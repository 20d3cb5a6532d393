"""The reshard's plan and checks, one rank at a time in this process (``parallel.reshard``):
each rank's side of the exchange in a world of 300 ranks (ranks past 256), what the error
says when a rank's encode rows disagree with the LLM rows, and the checks ``reshard`` makes
before any collective: the plan's rank count against the group's, each block's shape. Each
case was a survivor of the mutation run (issue #46).

The plans are hand-written tables (one per rank); the expected sides are worked out by hand
from the rows: an item goes from the rank its LLM row names as encoder to the rank training
the sample, sent in (consumer, item) order and received in (encoder, item) order."""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow as pa
import pytest
import torch
import torch.distributed as dist

from omniscale.parallel.reshard import local_reshard_plan, reshard, reshard_plan
from omniscale.plan import PLAN_SCHEMA, ReshardPlan, decode_plan

D = 4
KINDS = {"image": 0, "video": 1, "audio": 2}


def _row(rank, key, role, images=0, audio=0, encode_ranks=(), item=(None, None),
         consume_rank=None):
    return {"source_id": 0, "source": "s", "shard": "x.tar", "key": key, "offset": 0,
            "size": 1, "members": [], "image_patches": [4] * images, "video_patches": [],
            "audio_frames": [50] * audio, "epoch": 0, "role": role, "step": 0, "rank": rank,
            "micro_batch": 0 if role == "llm" else None, "sp_size": 1, "sp_index": 0,
            "sp_first_rank": rank, "encode_ranks": list(encode_ranks), "item_kind": item[0],
            "item_index": item[1], "consume_rank": consume_rank, "consume_span": 1}


def _plans(world, rows_by_rank):
    """Each rank's decoded plan: its rows (none for a rank not named), its rank in the
    table's metadata as the plane writes it."""
    def plan(rank):
        schema = PLAN_SCHEMA.with_metadata(
            {b"omniscale": json.dumps({"step": 0, "rank": rank}).encode()})
        rows = [_row(rank, *r[:2], **r[2]) for r in rows_by_rank.get(rank, [])]
        return decode_plan(pa.Table.from_pylist(rows, schema=schema))

    idle = plan(-1)  # a rank with no rows: one decoded table, its rank set per rank
    return [plan(r) if r in rows_by_rank else replace(idle, rank=r) for r in range(world)]


def _item(key, kind, index=0):
    return ("s", "x.tar", key, KINDS[kind], index)


def _counts(world, **by_rank):
    counts = [0] * world
    for rank, n in by_rank.items():
        counts[int(rank[1:])] = n
    return counts


WORLD = 300
# a (2 images) trains on rank 299: image 0 encoded on rank 280, image 1 on 299 itself;
# b (an image and an audio clip) trains on rank 3, both encoded on rank 290.
BIG = {
    299: [("a", "llm", dict(images=2, encode_ranks=(280, 299))),
          ("a", "encode", dict(images=2, item=("image", 1), consume_rank=299))],
    280: [("a", "encode", dict(images=2, item=("image", 0), consume_rank=299))],
    3: [("b", "llm", dict(images=1, audio=1, encode_ranks=(290, 290)))],
    290: [("b", "encode", dict(images=1, audio=1, item=("image", 0), consume_rank=3)),
          ("b", "encode", dict(images=1, audio=1, item=("audio", 0), consume_rank=3))],
}
A0, A1, B_IMAGE, B_AUDIO = _item("a", "image", 0), _item("a", "image", 1), \
    _item("b", "image"), _item("b", "audio")
BIG_SIDES = {
    299: ReshardPlan([A1], _counts(WORLD, r299=1), [A0, A1], _counts(WORLD, r280=1, r299=1)),
    280: ReshardPlan([A0], _counts(WORLD, r299=1), [], _counts(WORLD)),
    290: ReshardPlan([B_IMAGE, B_AUDIO], _counts(WORLD, r3=2), [], _counts(WORLD)),
    3: ReshardPlan([], _counts(WORLD), [B_IMAGE, B_AUDIO], _counts(WORLD, r290=2)),
    0: ReshardPlan([], _counts(WORLD), [], _counts(WORLD)),
}


@pytest.fixture(scope="module")
def big_plans():
    return _plans(WORLD, BIG)


@pytest.mark.parametrize("rank", sorted(BIG_SIDES))
def test_each_rank_of_a_300_rank_world_gets_its_side_of_the_exchange(big_plans, rank):
    assert reshard_plan(big_plans, rank) == BIG_SIDES[rank]
    assert local_reshard_plan(big_plans[rank], rank, WORLD) == BIG_SIDES[rank]


@pytest.mark.parametrize("plan_rank, rank", [(290, 299), (290, 3)])  # below it and above
def test_a_plan_handed_to_another_rank_is_refused(big_plans, plan_rank, rank):
    with pytest.raises(ValueError, match=f"the plan of rank {plan_rank} handed to rank {rank}"):
        local_reshard_plan(big_plans[plan_rank], rank, WORLD)


def test_items_the_llm_rows_expect_but_no_encode_row_makes_are_named_three_at_most():
    """Rank 1 trains a, whose 4 images it expects from rank 0; rank 0 encodes nothing."""
    plans = _plans(2, {1: [("a", "llm", dict(images=4, encode_ranks=(0, 0, 0, 0)))]})
    first_three = [_item("a", "image", i) for i in range(3)]
    with pytest.raises(ValueError) as error:
        reshard_plan(plans, 0)
    assert str(error.value) == (
        "plan of rank 0: its encode rows disagree with the llm rows' encode_ranks (expected "
        f"but not encoded: {first_three}; encoded but unexpected or sent elsewhere: [])")


def test_items_encoded_that_no_llm_row_expects_are_named_three_at_most():
    """Rank 0 encodes z's 4 images for rank 1, which does not train z."""
    plans = _plans(2, {0: [("z", "encode", dict(images=4, item=("image", i), consume_rank=1))
                           for i in range(4)],
                       1: [("a", "llm", dict())]})
    first_three = [_item("z", "image", i) for i in range(3)]
    with pytest.raises(ValueError) as error:
        reshard_plan(plans, 0)
    assert str(error.value).endswith(
        f"(expected but not encoded: []; encoded but unexpected or sent elsewhere: "
        f"{first_three})")


def test_an_item_encoded_for_the_wrong_rank_is_named():
    """Rank 1 trains a and expects its image from rank 0, which encodes it for rank 0."""
    plans = _plans(2, {0: [("a", "encode", dict(images=1, item=("image", 0), consume_rank=0))],
                       1: [("a", "llm", dict(images=1, encode_ranks=(0,)))]})
    with pytest.raises(ValueError) as error:
        reshard_plan(plans, 0)
    assert str(error.value).endswith(
        f"(expected but not encoded: []; encoded but unexpected or sent elsewhere: "
        f"{[_item('a', 'image')]})")


def _group(size):
    """A process group of ``size`` ranks that runs no collective: the checks tested here
    come before the exchange."""
    return dist.ProcessGroup(0, size)


def _plan_for(world):
    """Rank 0 sends item a to rank 0 and receives it back."""
    return ReshardPlan([A0], _counts(world, r0=1), [A0], _counts(world, r0=1))


@pytest.mark.parametrize("plan_ranks, group_ranks", [(3, 2), (1, 2)])
def test_a_plan_for_another_number_of_ranks_than_the_group_is_refused(plan_ranks,
                                                                       group_ranks):
    with pytest.raises(ValueError, match=f"the plan is for {plan_ranks} ranks, the group has "
                                         f"{group_ranks}"):
        reshard({A0: torch.zeros(2, D)}, _plan_for(plan_ranks), _group(group_ranks), dim=D)


@pytest.mark.parametrize("shape", [(3,), (2, D, 1), (2, D - 1), (2, D + 1), (2, 1, D),
                                   (D, D + 1)])  # as many tokens as dim: still the wrong width
@pytest.mark.parametrize("world", [1, 300])
def test_a_block_not_of_num_tokens_by_dim_is_refused(shape, world):
    """The plan fits the group (300 ranks too), so the block's shape is what is refused."""
    with pytest.raises(ValueError, match=rf"item .* has shape \({', '.join(map(str, shape))},?\)"
                                         rf", expected \[num_tokens, {D}\]"):
        reshard({A0: torch.zeros(shape)}, _plan_for(world), _group(world), dim=D)


def test_a_block_wider_than_256_goes_through_a_one_rank_exchange_unchanged(tmp_path):
    """A real one-rank gloo group: the rank sends its one item to itself. A width past
    CPython's small-int cache is compared by value."""
    from tests.tools.test_checkpoint_manifest import _group as one_rank_group

    dim = int("300")  # as a model config gives it: not the literal's object
    block = torch.arange(2 * 300, dtype=torch.float32).reshape(2, 300)
    with one_rank_group(tmp_path):
        out = reshard({A0: block}, ReshardPlan([A0], [1], [A0], [1]), dim=dim)
    assert list(out.items) == [A0] and torch.equal(out.items[A0], block)
    assert float(out.zero.detach()) == 0.0
