"""Per-source file state: seeded orders, cursor, quarantine, exact resume, bounded memory; on
the real demo dataset and on hand-made indexes for the edge cases."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

import omniscale.dataplane.catalog as catalog_module
from omniscale.dataplane.catalog import Catalog, SourceState
from omniscale.dataplane.spec import load_spec
from omniscale.errors import UserError
from omniscale.index_schema import METADATA_KEY, index_path, read_index
from tests.dataplane.plane_index import random_source, rows, write_index


@pytest.fixture(scope="module")
def demo(demo_root):
    return load_spec(demo_root / "mix.yaml")


@pytest.fixture(scope="module")
def corrupt_source(tmp_path_factory):
    """Three shards, one empty, with corrupt rows: 2 + 0 + 3 of 5 + 0 + 4 rows are corrupt."""
    d = tmp_path_factory.mktemp("corrupt") / "c"
    return write_index(d, {"c-0.tar": rows("c-0.tar", [5, 6, 7, 8, 9], frozenset({1, 3})),
                           "c-1.tar": [],
                           "c-2.tar": rows("c-2.tar", [1, 2, 3, 4], frozenset({0, 2, 3}))})


def epoch_keys(state: SourceState, epoch: int) -> list[tuple[str, str]]:
    """Drain ``epoch`` (the state must be at its start) and return its (shard, key)s."""
    out = []
    while (ref := state.peek()) is not None and ref.epoch == epoch:
        out.append((state.next().shard, ref.key))
    return out


def test_one_epoch_visits_every_demo_sample_exactly_once(demo):
    for i, source in enumerate(demo.sources):
        state = SourceState(source.name, i, source.path, demo.seed, "stop")
        served = []
        while (ref := state.next()) is not None:
            assert (ref.source, ref.source_id, ref.epoch) == (source.name, i, 0)
            served.append((ref.shard, ref.key))
        index = read_index(source.path, columns=["shard", "key"])
        assert sorted(served) == sorted(zip(index.column("shard").to_pylist(),
                                            index.column("key").to_pylist()))
        assert len(set(served)) == len(served) == state.samples_total
        assert state.exhausted and state.next() is None and state.peek() is None


def test_refs_carry_the_index_row(demo):
    source = next(s for s in demo.sources if s.template == "video_caption")
    state = SourceState(source.name, 4, source.path, demo.seed)
    ref = state.next()
    row = next(r for r in read_index(source.path).to_pylist() if r["key"] == ref.key)
    assert (ref.shard, ref.offset, ref.size, ref.llm_tokens) == (
        row["shard"], row["offset"], row["size"], row["llm_tokens"])
    assert list(ref.video_patches) == row["video_patches"] and ref.video_patches
    assert [m[0] for m in ref.members] == [m["name"] for m in row["members"]]


def test_orders_are_seeded_and_change_per_epoch(demo):
    source = demo.sources[2]  # image_caption: several shards

    def two_epochs(seed, source_id=2, name=source.name):
        state = SourceState(name, source_id, source.path, seed)
        return epoch_keys(state, 0), epoch_keys(state, 1)

    first, second = two_epochs(7)
    assert sorted(first) == sorted(second) and first != second
    assert two_epochs(7) == (first, second)
    assert two_epochs(8)[0] != first and two_epochs(7, name="renamed")[0] != first
    # Seeded by name, not position: moving the source in the spec keeps its order.
    assert two_epochs(7, source_id=3) == (first, second)
    # Shards are visited one after the other: each shard's samples form one run.
    runs = [s for j, (s, _) in enumerate(first) if j == 0 or first[j - 1][0] != s]
    assert sorted(runs) == sorted(set(runs))


@pytest.mark.parametrize("cut", [0, 1, 17, 32, 33, 127, 128, 129, 300])
def test_state_dict_resumes_exactly(demo, cut):
    source = demo.sources[2]
    straight = SourceState(source.name, 2, source.path, demo.seed)
    expected = [straight.next() for _ in range(cut + 150)]
    first = SourceState(source.name, 2, source.path, demo.seed)
    for _ in range(cut):
        first.next()
    first.peek()  # a peek must not change what a restored state serves
    state = json.loads(json.dumps(first.state_dict()))
    resumed = SourceState(source.name, 2, source.path, demo.seed)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(150)] == expected[cut:]
    assert [first.next() for _ in range(150)] == expected[cut:]


def test_quarantined_keys_are_skipped_now_and_in_later_epochs(demo):
    source = demo.sources[2]
    state = SourceState(source.name, 2, source.path, demo.seed)
    order = epoch_keys(SourceState(source.name, 2, source.path, demo.seed), 0)
    served = [(r.shard, r.key) for r in (state.next() for _ in range(40))]
    assert len(order) > 60
    bad = [order[10], order[50], order[51], order[-1]]  # one already served, three ahead
    for shard, key in bad:
        state.quarantine(shard, key)
    restored = SourceState(source.name, 2, source.path, demo.seed)
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    for s in (state, restored):
        rest = epoch_keys(s, 0)
        assert rest == [k for k in order[40:] if k not in bad]
        assert set(bad).isdisjoint(epoch_keys(s, 1))
        assert s.stats()["skipped_quarantined"] == 3 + 4
    assert served == order[:40]


def test_corrupt_rows_and_empty_shards_are_skipped(corrupt_source):
    state = SourceState("c", 0, corrupt_source, seed=1, on_exhausted="stop")
    served = []
    while (ref := state.next()) is not None:
        served.append(ref.key)
    assert sorted(served) == ["c-0-0", "c-0-2", "c-0-4", "c-2-1"]
    assert state.stats()["skipped_corrupt"] == 5 and state.samples_total == 9


def test_only_the_open_shard_is_loaded(demo, monkeypatch):
    source = demo.sources[0]  # text: a few shards of a few dozen rows
    reads = []
    real = catalog_module.read_shard

    def counting(source_dir, shard, metadata=None, columns=None):
        reads.append(shard)
        return real(source_dir, shard, metadata, columns)

    monkeypatch.setattr(catalog_module, "read_shard", counting)
    state = SourceState(source.name, 0, source.path, demo.seed)
    largest = max(e["rows"] for e in state._metadata["shards"].values())
    for _ in range(3 * state.samples_total):
        ref = state.next()
        assert state.open_shard == ref.shard and 0 < state.loaded_rows <= largest
        # Nothing but the open shard grows with the index: every other container is bounded
        # by the shard count (quarantine is empty here).
        for name, value in vars(state).items():
            if name != "_open" and isinstance(value, (list, tuple, dict, set, np.ndarray)):
                assert len(value) <= len(state.shards), name
    # Each shard is read once per epoch, in that epoch's shard order.
    n = len(state.shards)
    assert n >= 2 and len(reads) == 3 * n
    for epoch in range(3):
        assert reads[n * epoch:n * (epoch + 1)] == [state.shards[k]
                                                    for k in state.shard_order(epoch)]


def test_on_exhausted_policies(tmp_path):
    path = random_source(tmp_path / "s", seed=0, shards=2, per_shard=3, max_tokens=9)
    stop = SourceState("s", 0, path, 0, "stop")
    assert len([stop.next() for _ in range(6)]) == 6
    assert (stop.next(), stop.peek(), stop.exhausted, stop.epoch) == (None, None, True, 0)

    again = SourceState("s", 0, path, 0, "next_epoch")
    refs = [again.next() for _ in range(12)]
    assert [r.epoch for r in refs] == [0] * 6 + [1] * 6 and not again.exhausted
    assert sorted(r.key for r in refs[:6]) == sorted(r.key for r in refs[6:])

    catalog = Catalog(0, [SourceState("s", 0, path, 0, "drop_source"),
                          SourceState("t", 1, path, 0)])
    catalog.drop("s")
    assert catalog.names == ("t",) and catalog.dropped == {"s": 0}
    assert catalog.add("u", path).source_id == 2  # never reuses a dropped source's id


def test_a_source_with_nothing_servable_ends_instead_of_spinning(tmp_path):
    path = write_index(tmp_path / "bad",
                       {"bad-0.tar": rows("bad-0.tar", [1, 2], frozenset({0, 1}))})
    state = SourceState("bad", 0, path, 0, "next_epoch")
    assert state.next() is None and state.exhausted


def test_missing_index_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no index"):
        SourceState("x", 0, tmp_path, 0)


def test_catalog_round_trips_and_rebuilds_its_sources(demo, tmp_path):
    catalog = Catalog.from_spec(demo)
    assert catalog.names == demo.source_names
    assert [s.source_id for s in catalog] == list(range(len(demo.sources)))
    for s in catalog:
        for _ in range(5 + s.source_id):
            s.next()
    extra = random_source(tmp_path / "extra", seed=1, shards=2, per_shard=4, max_tokens=9)
    catalog.add("extra", extra, "stop").next()
    catalog.remove("docs")
    catalog["text"].quarantine("text-000000.tar", "k")
    state = json.loads(json.dumps(catalog.state_dict()))
    assert len(json.dumps(state)) < 4000  # O(1) per source: cursors, not indexes

    fresh = Catalog.from_spec(demo)
    fresh.load_state_dict(state)
    assert fresh.names == tuple(n for n in demo.source_names if n != "docs") + ("extra",)
    assert fresh.state_dict() == state
    for name in fresh.names:
        assert [fresh[name].next() for _ in range(20)] == [catalog[name].next()
                                                           for _ in range(20)]
    assert fresh.stats()["text"]["served_samples"] == 25


def test_an_index_from_an_older_version_is_a_clear_error(tmp_path):
    # Version 1 indexes had no row group per shard: read as if empty, a source would silently
    # serve nothing. The plane must say what to do instead.
    source = write_index(tmp_path / "old", {"s0.tar": rows("s0.tar", [10, 20])})
    path = index_path(source)
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    pq.write_table(table.replace_schema_metadata(
        {METADATA_KEY: json.dumps({**meta, "version": 1})}), path)
    with pytest.raises(UserError, match="index version 1, the plane reads 2 to 4; re-run"):
        SourceState("old", 0, source, seed=0)


def test_a_fresh_source_is_at_the_start_with_nothing_served(demo):
    source = demo.sources[0]
    state = SourceState(source.name, 0, source.path, demo.seed)
    assert state.state_dict() == {
        "epoch": 0, "shard_pos": 0, "sample_pos": 0, "exhausted": False, "quarantine": [],
        "served_samples": 0, "served_tokens": 0, "skipped_corrupt": 0,
        "skipped_quarantined": 0, "skipped_too_long": 0}
    assert state.loaded_rows == 0  # no shard read yet


def test_a_state_without_counters_resumes_with_them_at_zero(demo):
    """A state saved before the counters existed: the cursor is resumed, the counters start
    from 0."""
    source = demo.sources[0]
    state = SourceState(source.name, 0, source.path, demo.seed)
    for _ in range(5):
        state.next()
    old = {k: v for k, v in state.state_dict().items()
           if k not in ("served_samples", "served_tokens", "skipped_corrupt",
                        "skipped_quarantined", "skipped_too_long")}
    resumed = SourceState(source.name, 0, source.path, demo.seed)
    resumed.load_state_dict(old)
    assert resumed.state_dict() == {**old, "served_samples": 0, "served_tokens": 0,
                                    "skipped_corrupt": 0, "skipped_quarantined": 0,
                                    "skipped_too_long": 0}
    assert resumed.next().key == state.next().key


def test_an_unknown_source_is_a_key_error_naming_the_sources(demo):
    catalog = Catalog(demo.seed, [SourceState(s.name, i, s.path, demo.seed)
                                  for i, s in enumerate(demo.sources[:2])])
    with pytest.raises(KeyError, match=rf"no source 'nope' in the catalog \(sources: "
                                       rf"{demo.sources[0].name}, {demo.sources[1].name}\)"):
        catalog["nope"]


def test_a_state_with_another_seed_replaces_the_seed_and_the_sources(demo):
    first = Catalog(demo.seed, [SourceState(s.name, i, s.path, demo.seed)
                                for i, s in enumerate(demo.sources[:2])])
    other = Catalog(demo.seed + 1, [SourceState(demo.sources[0].name, 0, demo.sources[0].path,
                                                demo.seed + 1)])
    kept = first[demo.sources[0].name]
    first.load_state_dict(json.loads(json.dumps(other.state_dict())))
    assert first.seed == demo.seed + 1 and first.names == (demo.sources[0].name,)
    assert first[demo.sources[0].name] is not kept  # rebuilt for the new seed's orders
    assert [first[demo.sources[0].name].next().key for _ in range(3)] == \
        [other[demo.sources[0].name].next().key for _ in range(3)]
