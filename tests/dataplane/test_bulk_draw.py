"""The plane's bulk paths give exactly what the one-sample-at-a-time code gave.

The mixer decides a batch's draws in a compiled loop and the catalog consumes and builds refs a
run of rows at a time (``Mixer.next_batch``, ``SourceState.take``); the window's arrays, the
baselines' subsets, the ref tables and the fingerprints are built column at a time. Each is
checked here against a plain reference -- the per-sample code they replaced -- on the same
inputs: same refs, same state dicts (floats bit for bit), same arrays and tables.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from omniscale.balancer.cost import Costs
from omniscale.balancer.types import PlannerConfig
from omniscale.dataplane import windows
from omniscale.dataplane.catalog import Catalog, SourceState
from omniscale.dataplane.mixer import Mixer, MixtureExhausted
from omniscale.dataplane.schedule import Schedule, Segment
from omniscale.dataplane.spec import load_spec
from omniscale.dataplane.windows import subset, window_samples
from omniscale.geometry import audio_tokens
from omniscale.plan import _fingerprint, _row_texts, fingerprint, slice_fingerprints
from omniscale.refs import REF_SCHEMA, SampleRef, make_ref, refs_to_table, table_to_refs
from tests.dataplane.plane_index import rows, write_index


# --- the reference: one sample at a time, as the mixer drew before ----------------------------
def reference_batch(m: Mixer, step: int) -> list[SampleRef]:
    """Batch ``step`` by the per-sample loop (peek every live source, pick, take one)."""
    m._invalidate()
    batch, batch_tokens, peeked = [], 0, {}
    while m.batch_samples is None or len(batch) < m.batch_samples:
        choice = _choose(m, peeked)
        if choice is None:
            if not batch:
                raise MixtureExhausted(step)
            break
        i, ref, w_N = choice
        if m.batch_tokens is not None and batch and \
                batch_tokens + ref.llm_tokens > m.batch_tokens:
            break
        m._sources[i].next()
        peeked.pop(i)
        u = 1.0 if m.accounting == "samples" else float(_units(m, ref))
        m.target_N += w_N * u
        m.realized_N[i] += u
        m.tokens += ref.llm_tokens
        m.samples += 1
        batch_tokens += ref.llm_tokens
        batch.append(ref)
        if m.batch_tokens is not None and batch_tokens >= m.batch_tokens:
            break
    m.step += 1
    return batch


def _units(m, ref):
    return ref.target_tokens if m.accounting == "target_tokens" else ref.llm_tokens


def _choose(m, peeked):
    while True:
        w_N, live = m._weights_live()
        if not live:
            return None
        for i in live:
            if i not in peeked:
                ref = m._sources[i].peek()
                if ref is None:
                    m._retire(i, w_N)
                    break
                peeked[i] = ref
        else:
            bound = 1.0 if m.accounting == "samples" else \
                float(max(max(_units(m, peeked[i]) for i in live), 1))
            d_N = m.target_N - m.realized_N + (w_N if m.accounting == "samples" else 0.0)
            d_L, w_L = d_N[list(live)], w_N[list(live)]
            ok_L = d_L >= -1e-9 * bound
            if not ok_L.any():
                return live[int(np.argmax(d_L))], peeked[live[int(np.argmax(d_L))]], w_N
            k = int(np.argmin(np.where(ok_L, (bound - d_L) / w_L, np.inf)))
            return live[k], peeked[live[k]], w_N


def same_run(make, steps: int, between=None) -> int:
    """Draw with next_batch and with the reference from two identical mixers; every batch and
    every state (cursors, counters, floats) must match. Returns the batches drawn."""
    fast, slow = make(), make()
    for step in range(steps):
        try:
            want = reference_batch(slow, step)
        except MixtureExhausted:
            with pytest.raises(MixtureExhausted):
                fast.next_batch(step)
            assert fast.state_dict() == slow.state_dict()
            return step
        assert fast.next_batch(step) == want, step
        assert json.dumps(fast.state_dict()) == json.dumps(slow.state_dict()), step
        if between:
            between(fast, step)
            between(slow, step)
    return steps


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """24 sources (more than the scalar pick's 16), small shards, corrupt rows and an empty
    shard here and there, so runs cross shards and epochs inside a batch."""
    root = tmp_path_factory.mktemp("many")
    paths = []
    for s in range(24):
        rng = np.random.default_rng(s)
        shards = {f"m{s}-{k}.tar": rows(f"m{s}-{k}.tar", rng.integers(1, 300, 7).tolist(),
                                        frozenset(rng.choice(7, s % 3, replace=False).tolist()))
                  for k in range(3)}
        if s % 5 == 0:
            shards[f"m{s}-9.tar"] = []
        paths.append(write_index(root / f"m{s}", shards))
    return paths


def _many_mixer(paths, accounting, batch, unit, policies=False, max_tokens=None):
    names = tuple(f"m{s}" for s in range(len(paths)))
    w0 = {n: 1 + s % 4 for s, n in enumerate(names)}
    w1 = {n: (s % 3) * 2 for s, n in enumerate(names)}
    scale = 1 if unit == "steps" else 3000
    schedule = Schedule(names, (Segment("const", 0, 3 * scale, w0, w0),
                                Segment("linear", 3 * scale, 9 * scale, w0, w1),
                                Segment("step", 9 * scale, None, w1, w0, at=12 * scale)), unit)
    on = ("stop", "drop_source") if policies else ("next_epoch",)
    catalog = Catalog(3, [SourceState(n, s, p, 3, on[s % len(on)], max_tokens=max_tokens)
                          for s, (n, p) in enumerate(zip(names, paths))], max_tokens=max_tokens)
    return Mixer(catalog, schedule, accounting, **batch)


@pytest.mark.parametrize("accounting", ["samples", "tokens", "target_tokens"])
@pytest.mark.parametrize("batch", [{"global_batch_samples": 37}, {"global_batch_tokens": 4000}])
@pytest.mark.parametrize("unit", ["steps", "tokens"])
def test_many_sources_draw_as_one_at_a_time(many, accounting, batch, unit):
    assert same_run(lambda: _many_mixer(many, accounting, batch, unit), 16) == 16


@pytest.mark.parametrize("accounting", ["samples", "tokens"])
def test_sources_running_out_mid_batch(many, accounting):
    # stop and drop_source sources leave the mix inside batches, until none is left
    n = same_run(lambda: _many_mixer(many, accounting, {"global_batch_samples": 40}, "steps",
                                     policies=True, max_tokens=150), 60)
    assert n < 60


def test_quarantine_between_batches(many):
    def quarantine(m, step):
        for s in list(m.catalog)[step % 4::4]:
            if s.open_shard is not None:  # a key likely still ahead in the open shard
                keys = sorted(s._open.keys.to_pylist())
                s.quarantine(s.open_shard, keys[len(keys) // 2])
    same_run(lambda: _many_mixer(many, "tokens", {"global_batch_samples": 29}, "steps"), 14,
             between=quarantine)


@pytest.mark.parametrize("accounting", ["samples", "tokens", "target_tokens"])
@pytest.mark.parametrize("batch", [{"global_batch_samples": 19}, {"global_batch_tokens": 9000}])
def test_demo_curriculum_draws_as_one_at_a_time(demo_root, accounting, batch):
    """The demo's mixture (every modality, its curriculum squeezed into a few steps, sources
    stopping and dropped), in a tokens schedule too, with long samples truncated."""
    spec = load_spec(demo_root / "mix.yaml")
    for unit, scale in (("steps", 1 / 25), ("tokens", 400)):
        segments = tuple(Segment(s.kind, s.start * scale, None if s.end is None else
                                 s.end * scale, s.weights_from, s.weights_to,
                                 None if s.at is None else s.at * scale)
                         for s in spec.schedule.segments)
        schedule = Schedule(spec.schedule.sources, segments, unit)
        policies = {"video_caption": "stop", "audio_caption": "drop_source"}

        def make():
            catalog = Catalog(spec.seed, [
                SourceState(s.name, i, s.index, spec.seed, policies.get(s.name, "next_epoch"),
                            max_tokens=600) for i, s in enumerate(spec.sources)],
                max_tokens=600)
            return Mixer(catalog, schedule, accounting, **batch)
        same_run(make, 30)


# --- the catalog's runs --------------------------------------------------------------------
def test_take_is_next_n_times(tmp_path):
    path = write_index(tmp_path / "c", {
        "c-0.tar": rows("c-0.tar", [5, 6, 7, 8, 9], frozenset({1, 3})), "c-1.tar": [],
        "c-2.tar": rows("c-2.tar", [1, 2, 3, 4, 700], frozenset({0, 2}))})
    for policy in ("next_epoch", "stop"):
        bulk = SourceState("c", 0, path, 1, policy, max_tokens=500)
        one = SourceState("c", 0, path, 1, policy, max_tokens=500)
        for k, n in enumerate([1, 3, 2, 5, 4, 7, 1]):
            if k == 3:
                for s in (bulk, one):
                    s.quarantine("c-0.tar", "c-0-4")
            got = bulk.take(n)
            assert got == [r for r in (one.next() for _ in range(n)) if r is not None]
            assert bulk.state_dict() == one.state_dict()
            assert bulk.settle() == (one.peek() is not None)
            assert bulk.state_dict() == one.state_dict()


# --- the window's arrays, the baselines' subsets, tables, fingerprints ----------------------
def reference_window_samples(batches, geometry):
    refs = [r for b in batches for r in b]
    sizes, kinds, tokens, counts = [], [], [], []
    merge = geometry.merge_size ** 2
    for ref in refs:
        counts.append(len(ref.image_patches) + len(ref.video_patches) + len(ref.audio_frames))
        for kind, values in ((0, ref.image_patches), (1, ref.video_patches)):
            sizes += values
            kinds += [kind] * len(values)
            tokens += [v // merge for v in values]
        sizes += ref.audio_frames
        kinds += [2] * len(ref.audio_frames)
        tokens += [audio_tokens(f) for f in ref.audio_frames]
    return (np.array([r.llm_tokens for r in refs], np.int64),
            np.array([r.source_id for r in refs], np.int32),
            np.repeat(np.arange(len(batches), dtype=np.int32), [len(b) for b in batches]),
            np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64),
            np.array(sizes, np.int64), np.array(kinds, np.int8), np.array(tokens, np.int64))


@pytest.fixture(scope="module")
def media_batches(demo_root):
    """Batches of the demo with every modality (its last segment's weights from step 0)."""
    spec = load_spec(demo_root / "mix.yaml")
    last = spec.schedule.segments[-1].weights_to
    mixer = Mixer(Catalog.from_spec(spec), Schedule.constant(last), "tokens",
                  global_batch_samples=40)
    return spec, [mixer.next_batch(s) for s in range(4)]


def test_window_samples_and_subsets(media_batches):
    spec, batches = media_batches
    got = window_samples(batches, spec.media)
    want = reference_window_samples(batches, spec.media)
    fields = ("tokens_N", "source_N", "batch_N", "item_offsets_N1", "item_size_M",
              "item_kind_M", "item_tokens_M")
    assert got.num_items > 0 and set(got.item_kind_M.tolist()) == {0, 1, 2}
    for name, value in zip(fields, want):
        assert getattr(got, name).dtype == value.dtype and np.array_equal(getattr(got, name),
                                                                          value), name
    assert window_samples([[], []], spec.media).item_offsets_N1.tolist() == [0]
    off = got.item_offsets_N1
    for idx in (np.array([3, 0, 17, 5]), np.flatnonzero(got.batch_N == 2), np.zeros(0, int)):
        sub, item_m = subset(got, idx, np.zeros(len(idx), np.int64))
        want_m = np.concatenate([np.arange(off[i], off[i + 1]) for i in idx]).astype(np.int64) \
            if len(idx) else np.zeros(0, np.int64)
        assert item_m.dtype == np.int64 and np.array_equal(item_m, want_m)
        assert np.array_equal(sub.item_size_M, got.item_size_M[want_m])


def test_ref_tables_and_fingerprints(media_batches):
    refs = [r for b in media_batches[1] for r in b]
    refs += [SampleRef(7, "s", "sh", "k\u00e9'\"", 1, 2, (("a", 1, 2), ("b", 3, 4)), 5, 6,
                       (1, 2), (), (3,), 1, 7), SampleRef(7, "s", "sh", "k2", 1, 2)]
    made = make_ref(*(getattr(refs[-2], n) for n in REF_SCHEMA.names))
    assert made == refs[-2] and hash(made) == hash(refs[-2]) and repr(made) == repr(refs[-2])
    for chosen in (refs, refs[:1], []):
        columns = {n: [getattr(r, n) for r in chosen] for n in REF_SCHEMA.names}
        columns["members"] = [[{"name": n, "offset": o, "size": s} for n, o, s in r.members]
                              for r in chosen]
        want = pa.Table.from_pydict(columns, schema=REF_SCHEMA)
        got = refs_to_table(chosen)
        assert got.schema == want.schema and got.equals(want)
        assert table_to_refs(got) == chosen
    # fingerprints: the one-chunk fast path and a table of several chunks or none agree
    # with the rows as Python lists
    names = ["source", "shard", "key", "role", "sp_index"]
    table = pa.table({"source": [r.source for r in refs], "shard": [r.shard for r in refs],
                      "key": [r.key for r in refs], "role": ["llm", "encode"] * (len(refs) // 2),
                      "sp_index": [i % 3 or None for i in range(len(refs))],
                      "other": list(range(len(refs)))})
    some = [table, pa.concat_tables([table.slice(0, 5), table.slice(5)]), table.slice(3, 9),
            table.slice(0, 0), pa.concat_tables([table.slice(0, 0)] * 2),
            table.slice(2, 4).replace_schema_metadata({"omniscale": "{}"}),
            table.select(names).slice(1, 3)]  # another schema: read table by table
    for t in some:
        assert fingerprint(t) == _fingerprint(*(t.column(n).to_pylist() for n in names))
    # slices of one table, each read from the table's columns at once
    starts, counts = np.array([0, 3, 5, 5, len(refs) - 1]), np.array([4, 6, 0, 2, 1])
    assert slice_fingerprints(table, starts, counts) == [
        fingerprint(table.slice(a, n)) for a, n in zip(starts, counts)]


def test_slice_fingerprints_built_by_arrow_hash_what_each_slice_s_rows_do():
    """The rows' texts built by Arrow for every slice at once (plain strings) hash what
    ``_fingerprint`` hashes from each slice's rows as Python lists: sorted by each row's str
    (keys whose digits sort differently as numbers, null sp_index, repeated rows), slices
    out of order, overlapping and empty; a string needing escapes falls back."""
    rng = np.random.default_rng(3)
    n = 300
    table = pa.table({
        "source": [f"src-{i}" for i in rng.integers(0, 12, n)],
        "shard": [f"shard {i}.tar" for i in rng.integers(0, 3, n)],
        "key": [f"k{i}" for i in rng.integers(0, 40, n)],  # k10 sorts before k9
        "role": rng.choice(["llm", "encode"], n).tolist(),
        "sp_index": pa.array([None if i < 0 else int(i) for i in rng.integers(-1, 12, n)],
                             pa.int32()),
        "other": np.arange(n)})
    starts = np.array([5, 0, 100, 100, 7, n - 1, 42, 200])
    counts = np.array([30, 4, 0, 60, 1, 1, 90, 100])
    want = [_fingerprint(*(table.column(c).slice(a, k).to_pylist()
                           for c in ("source", "shard", "key", "role", "sp_index")))
            for a, k in zip(starts, counts)]
    assert _row_texts(table, starts, counts) is not None  # the Arrow path is the one taken
    assert slice_fingerprints(table, starts, counts, arrow_from_rows=0) == want
    assert slice_fingerprints(table, starts, counts) == want  # by size: either path
    assert slice_fingerprints(table, starts[:0], counts[:0], arrow_from_rows=0) == []
    for odd in ("k'1", 'k"1', "k\\1", "k\u00e91", "k\n1"):
        keys = table.column("key").to_pylist()
        keys[6] = odd
        escaped = table.set_column(2, "key", pa.array(keys))
        assert _row_texts(escaped, starts, counts) is None
        assert slice_fingerprints(escaped, starts, counts, arrow_from_rows=0) == [
            fingerprint(escaped.slice(a, k)) for a, k in zip(starts, counts)]


def test_the_window_split_is_computed_once_per_window(media_batches, monkeypatch):
    spec, batches = media_batches
    samples = window_samples(batches, spec.media)
    costs = Costs.from_llm(4096, 1)
    config = PlannerConfig(dp=4, micro_batch_tokens=2048, window=4, sp_max=4)
    calls = []
    real = windows.split_sizes
    monkeypatch.setattr(windows, "split_sizes", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(windows, "_last_split", None)
    first = [windows.best_baseline(samples, j, costs, config) for j in range(4)]
    assert len(calls) == 1
    other = PlannerConfig(dp=4, micro_batch_tokens=2048, window=4, sp_max=4,
                          rank_speed=(1.0, 0.5, 1.0, 1.0))
    windows.best_baseline(samples, 0, costs, other)
    assert len(calls) == 2  # another configuration: computed again
    monkeypatch.setattr(windows, "_last_split", None)
    assert [windows.best_baseline(samples, j, costs, config) for j in range(4)] == first
    assert not math.isnan(first[0]["baseline_step_cost"])
