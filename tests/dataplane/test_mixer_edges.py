"""The mixer at its edges: batches larger than its buffers, mixes naming more sources than
its peek table is wide, schedules that jump inside a batch, the bookkeeping a status report
and a restore read (counters, weights, deficits handed on by an exhausted source, sources new
to a state), and the garbage collector left as it was found.

Oracles: a source's own order read with ``SourceState.take`` (a one-source mix draws exactly
that), hand-computed batches and counts, and units recounted from the refs drawn.
"""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest

from omniscale.dataplane.catalog import Catalog, SourceState
from omniscale.dataplane.mixer import Mixer, MixtureExhausted
from omniscale.dataplane.schedule import Schedule, Segment
from tests.dataplane.plane_index import random_source, rows, write_index


def catalog_of(paths: dict, policies: dict | None = None, seed: int = 3) -> Catalog:
    return Catalog(seed, [SourceState(n, i, p, seed, (policies or {}).get(n, "next_epoch"))
                          for i, (n, p) in enumerate(paths.items())])


def keys(batch) -> list[tuple[str, str]]:
    return [(r.source, r.key) for r in batch]


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """Two sources of 10-token samples, 400 each in one shard."""
    root = tmp_path_factory.mktemp("flat")
    return {n: write_index(root / n, {f"{n}-0.tar": rows(f"{n}-0.tar", [10] * 400)})
            for n in ("a", "b")}


def test_a_batch_larger_than_the_draw_buffer_holds_every_sample(tmp_path):
    # 4,200 samples a batch (the draw loop's scratch buffer holds 4,096 picks at a time)
    path = write_index(tmp_path / "big", {"big-0.tar": rows("big-0.tar", [7] * 4500)})
    mixer = Mixer(catalog_of({"big": path}), Schedule.constant({"big": 1}), "samples",
                  global_batch_samples=4200)
    batch = mixer.next_batch(0)
    # one source: the batch is its next 4,200 samples in its seeded order
    alone = SourceState("big", 0, path, 3)
    assert keys(batch) == keys(alone.take(4200))
    assert keys(mixer.next_batch(1)) == keys(alone.take(4200))  # 300 left, then epoch 1


def test_a_mix_naming_over_a_thousand_sources_draws_a_long_shard_in_order(tmp_path):
    """1,100 sources named (the peek table then holds 953 samples a source) and a shard of
    1,100 samples: what the table cannot hold is read on the next peek."""
    path = write_index(tmp_path / "s0", {"s0-0.tar": rows("s0-0.tar",
                                                          list(range(1, 1101)))})
    names = tuple(f"s{i}" for i in range(1100))
    schedule = Schedule(names, (Segment("const", 0, None, {"s0": 1}, {"s0": 1}),))
    mixer = Mixer(catalog_of({"s0": path}), schedule, "tokens", global_batch_samples=1050)
    alone = SourceState("s0", 0, path, 3)
    assert keys(mixer.next_batch(0)) == keys(alone.take(1050))
    assert keys(mixer.next_batch(1)) == keys(alone.take(1050))


def test_a_token_schedule_that_switches_sources_switches_inside_the_batch(flat):
    # "a" alone for the first 100 tokens, "b" alone from then on; one batch of 1,000 tokens
    # of 10-token samples: 10 from "a" (drawn at 0, 10, .., 90 tokens), then 90 from "b"
    schedule = Schedule(("a", "b"), (Segment("const", 0, 100, {"a": 1}, {"a": 1}),
                                     Segment("const", 100, None, {"b": 1}, {"b": 1})),
                        "tokens")
    mixer = Mixer(catalog_of(flat), schedule, "tokens", global_batch_tokens=1000)
    batch = mixer.next_batch(0)
    assert [r.source for r in batch] == ["a"] * 10 + ["b"] * 90
    assert mixer.state_dict()["realized"] == {"a": 100.0, "b": 900.0}


def test_the_state_counts_the_samples_and_tokens_drawn(tmp_path):
    path = random_source(tmp_path / "r", seed=4, shards=3, per_shard=20, max_tokens=90)
    mixer = Mixer(catalog_of({"r": path}), Schedule.constant({"r": 1}), "tokens",
                  global_batch_samples=7)
    drawn = [r for step in range(5) for r in mixer.next_batch(step)]
    state = mixer.state_dict()
    assert (state["step"], state["samples"]) == (5, 35)
    assert state["tokens"] == sum(r.llm_tokens for r in drawn)
    resumed = Mixer(catalog_of({"r": path}), Schedule.constant({"r": 1}), "tokens",
                    global_batch_samples=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    resumed.next_batch(5)
    assert resumed.state_dict()["samples"] == 42


def test_weights_are_the_schedules_renormalised_over_the_sources_left(tmp_path, flat):
    small = write_index(tmp_path / "small", {"small-0.tar": rows("small-0.tar", [10] * 3)})
    paths = {"a": flat["a"], "small": small, "b": flat["b"]}
    mixer = Mixer(catalog_of(paths, {"small": "stop"}),
                  Schedule.constant({"a": 1, "small": 1, "b": 2}), "samples",
                  global_batch_samples=4)
    np.testing.assert_allclose(mixer.weights(), [0.25, 0.25, 0.5])
    for step in range(6):  # "small" runs out after its 3 samples
        mixer.next_batch(step)
    assert [e["source"] for e in mixer.exhausted] == ["small"]
    np.testing.assert_allclose(mixer.weights(), [1 / 3, 0.0, 2 / 3])
    mixer.weights()[:] = 0  # a copy: the mixer's own weights are not touched
    np.testing.assert_allclose(mixer.weights(), [1 / 3, 0.0, 2 / 3])


@pytest.mark.parametrize("accounting", ["samples", "tokens"])
def test_an_exhausted_sources_deficit_is_handed_on_not_lost(tmp_path, accounting):
    """A source in the middle of the mix runs out: its deficit goes to the others, so the
    targets still add up to exactly the units drawn, each source's target is what it was
    owed, and the exhausted source owes nothing."""
    paths = {"a": random_source(tmp_path / "a", 1, 4, 30, 40),
             "mid": random_source(tmp_path / "mid", 2, 1, 9, 40),
             "c": random_source(tmp_path / "c", 3, 4, 30, 40)}
    mixer = Mixer(catalog_of(paths, {"mid": "stop"}),
                  Schedule.constant({"a": 1, "mid": 3, "c": 5}), accounting,
                  global_batch_samples=5)
    drawn = []
    for step in range(12):
        drawn += mixer.next_batch(step)
        realized = {n: sum(1 if accounting == "samples" else r.llm_tokens
                           for r in drawn if r.source == n) for n in paths}
        state = mixer.state_dict()
        assert state["realized"] == pytest.approx(realized, abs=0)
        assert sum(state["target"].values()) == pytest.approx(sum(realized.values()),
                                                              rel=1e-12)
    assert [e["source"] for e in mixer.exhausted] == ["mid"]
    assert state["target"]["mid"] == state["realized"]["mid"]
    bound = 1 if accounting == "samples" else 40
    for n in ("a", "c"):
        assert abs(state["target"][n] - state["realized"][n]) <= bound


def test_a_source_new_since_the_state_starts_with_no_debt(flat):
    old = Mixer(catalog_of({"a": flat["a"]}), Schedule.constant({"a": 1}), "samples",
                global_batch_samples=6)
    for step in range(3):
        old.next_batch(step)
    schedule = Schedule.constant({"a": 1, "b": 1})
    new = Mixer(catalog_of({"a": flat["a"], "b": flat["b"]}), schedule, "samples",
                global_batch_samples=6)
    new.load_state_dict(json.loads(json.dumps(old.state_dict())))
    state = new.state_dict()
    assert (state["target"]["b"], state["realized"]["b"]) == (0.0, 0.0)
    # the reload puts "b" back in the catalog; from here the two share the batches
    new.catalog.add("b", flat["b"])
    drawn = [r for step in range(3, 8) for r in new.next_batch(step)]
    from_b = sum(r.source == "b" for r in drawn)
    assert new.state_dict()["realized"]["b"] == from_b == 15
    assert new.state_dict()["target"]["b"] == pytest.approx(15.0)


def test_a_source_running_out_as_a_token_batch_fills_is_found_on_the_next_step(tmp_path):
    """Six 10-token samples, batches of 30 tokens (or of 3 samples): each batch ends exactly
    full, and the source is found exhausted only when batch 2 asks it for a sample."""
    path = write_index(tmp_path / "one", {"one-0.tar": rows("one-0.tar", [10] * 6)})
    for batch in ({"global_batch_tokens": 30}, {"global_batch_samples": 3}):
        mixer = Mixer(catalog_of({"one": path}, {"one": "stop"}),
                      Schedule.constant({"one": 1}), "tokens", **batch)
        assert [len(mixer.next_batch(s)) for s in range(2)] == [3, 3]
        assert mixer.exhausted == []
        with pytest.raises(MixtureExhausted):
            mixer.next_batch(2)
        assert mixer.exhausted == [{"source": "one", "step": 2, "policy": "stop"}]


def test_drawing_leaves_the_garbage_collector_as_it_found_it(flat):
    mixer = Mixer(catalog_of(flat), Schedule.constant({"a": 1, "b": 1}), "samples",
                  global_batch_samples=8)
    was = gc.isenabled()
    try:
        gc.enable()
        mixer.next_batch(0)
        assert gc.isenabled()
        gc.disable()
        mixer.next_batch(1)
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
