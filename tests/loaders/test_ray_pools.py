"""The pool layout's decisions on a death, hand-computed (no Ray needed): a new actor where the
nodes have room, the pool without it where they have none, a source's only actor kept by
retiring one of the largest other pool's -- and one decision per death, however many loaders
report it."""

from __future__ import annotations

from omniscale.loaders.ray_cluster import PoolPlan
from omniscale.loaders.ray_pools import Loss, PoolLayout, room_on


def layout() -> PoolLayout:
    return PoolLayout(PoolPlan({"text": 1, "image": 2, "audio": 3}, 0.25), "job")


def test_names_are_never_reused():
    pools = layout()
    assert pools.names == {"text": ["job/text/1"], "image": ["job/image/2", "job/image/3"],
                           "audio": ["job/audio/4", "job/audio/5", "job/audio/6"]}
    assert pools.set_plan(PoolPlan({"text": 2, "image": 1, "audio": 3}, 0.25)) == \
        ["job/image/3"]
    assert pools.names["text"] == ["job/text/1", "job/text/7"]
    assert pools.names["image"] == ["job/image/2"]


def test_with_room_the_dead_actor_s_slot_gets_a_new_one():
    pools = layout()
    # six actors, five alive: room for six -> replaced in its slot
    assert pools.lost("image", "job/image/2", room=6) == Loss("job/image/7")
    assert pools.names["image"] == ["job/image/7", "job/image/3"]
    assert pools.plan == PoolPlan({"text": 1, "image": 2, "audio": 3}, 0.25)
    # a second loader reporting the same death changes nothing
    assert pools.lost("image", "job/image/2", room=6) == Loss(handled=False)
    assert pools.names["image"] == ["job/image/7", "job/image/3"]


def test_without_room_the_pool_goes_on_without_it():
    pools = layout()
    assert pools.lost("audio", "job/audio/5", room=5) == Loss()  # five alive, room for five
    assert pools.names["audio"] == ["job/audio/4", "job/audio/6"]
    assert pools.plan == PoolPlan({"text": 1, "image": 2, "audio": 2}, 0.25)
    assert pools.lost("image", "job/image/3", room=5) == Loss("job/image/7")  # four alive
    assert pools.deaths == {"replaced": 1, "retired": 1}


def test_a_source_s_only_actor_is_kept_by_retiring_one_of_the_largest_pool():
    pools = layout()
    assert pools.lost("text", "job/text/1", room=4) == Loss("job/text/7", ["job/audio/6"])
    assert pools.names == {"text": ["job/text/7"], "image": ["job/image/2", "job/image/3"],
                           "audio": ["job/audio/4", "job/audio/5"]}
    assert pools.plan.replicas == {"text": 1, "image": 2, "audio": 2}
    # every pool down to one actor: nothing to retire, the actor is started again anyway
    # (and waits for room, boundedly, as any actor does)
    single = PoolLayout(PoolPlan({"text": 1, "image": 1}, 1.0), "job")
    assert single.lost("text", "job/text/1", room=0) == Loss("job/text/3")


def test_with_an_autoscaler_a_dead_actor_is_always_replaced():
    pools = layout()
    assert pools.lost("audio", "job/audio/5", room=0, autoscaling=True) == \
        Loss("job/audio/7")
    assert pools.plan.replicas["audio"] == 3


def test_room_packs_each_node_on_its_own():
    assert room_on([1.0, 1.0], 0.4) == 4  # two a node; 0.2 of each is lost to packing
    assert room_on([2.0], 0.4) == 5
    assert room_on([0.0, 1.0], 0.25) == 4
