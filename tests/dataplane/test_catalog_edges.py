"""Catalog edge cases on hand-made indexes: counts that take nothing, the ids of sources added
to an empty catalog, and restoring a state that gives a present source another identity."""

from __future__ import annotations

import json

import pytest

from omniscale.dataplane.catalog import Catalog, SourceState
from tests.dataplane.plane_index import random_source


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Two shards of five samples."""
    return random_source(tmp_path_factory.mktemp("edges") / "s", seed=2, shards=2, per_shard=5,
                         max_tokens=50)


@pytest.mark.parametrize("n", [0, -1, -3])
def test_taking_no_samples_or_a_negative_count_takes_nothing(source, n):
    state = SourceState("s", 0, source, seed=3, on_exhausted="stop")
    first = SourceState("s", 0, source, seed=3, on_exhausted="stop").next()
    assert state.take(n) == []
    assert state.stats()["served_samples"] == 0
    assert state.next() == first  # the cursor did not move


def test_the_first_source_added_to_an_empty_catalog_gets_id_zero(source):
    catalog = Catalog(seed=3)
    assert catalog.add("a", source).source_id == 0
    assert catalog.add("b", source).source_id == 1
    assert catalog["a"].next().source_id == 0
    # the same order as a source built with id 0 by hand
    by_hand = SourceState("a", 0, source, seed=3)
    assert [catalog["a"].next() for _ in range(12)] == [by_hand.next() for _ in range(13)][1:]


@pytest.mark.parametrize("new_id, policy", [(1, "next_epoch"), (7, "stop"), (0, "stop")])
def test_a_state_giving_a_source_another_id_or_policy_rebuilds_it(source, new_id, policy):
    catalog = Catalog(3, [SourceState("s", 0, source, 3)])
    other = Catalog(3, [SourceState("s", new_id, source, 3, policy)])
    for _ in range(4):
        other["s"].next()
    catalog.load_state_dict(json.loads(json.dumps(other.state_dict())))
    assert (catalog["s"].source_id, catalog["s"].on_exhausted) == (new_id, policy)
    assert catalog.state_dict() == other.state_dict()
    # it serves what the other catalog serves, refs carrying the new id
    assert [catalog["s"].next() for _ in range(10)] == [other["s"].next() for _ in range(10)]
