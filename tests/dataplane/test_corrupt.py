"""Corrupt-sample reports: a replacement fits the token budget of the micro-batch(es) the bad
sample held, or there is none (and the too-long sample stays in its source's order); the room is
journaled so a restarted plane replays the same draws."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from omniscale.dataplane.corrupt import CorruptLedger, ref_from_json, ref_to_json, replacement_room
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.plan import rescale_lengths
from omniscale.refs import SampleRef, table_to_refs
from omniscale.tools.bench.plane_data import write_spec
from tests.dataplane.plane_index import rows, write_index
from tests.dataplane.plane_steps import commit_step

T = 100  # tokens of a short sample; long ones have 2T
BUDGET = 2 * T  # a micro-batch holds two short samples or one long one


@pytest.fixture()
def spec(tmp_path):
    rng = np.random.default_rng(3)
    write_index(tmp_path / "text", {
        f"text-{s}.tar": rows(f"text-{s}.tar", rng.choice([T // 2, T, 2 * T], 40).tolist())
        for s in range(4)})
    (tmp_path / "tokenizer.json").touch()
    return write_spec(tmp_path / "mix.yaml", ["text"])


def config(**kw):
    return PlaneConfig(dp=2, micro_batch_tokens=BUDGET, window=2, global_batch_samples=8,
                       max_sample_tokens=2 * T, **kw)


def placements(plane, step):
    """The step's LLM placements: {sample id: (ref, [(rank, micro_batch, sp_size), ...])} and
    the tokens of every (rank, micro_batch) -- from the served tables, as a loader sees them."""
    where, used = {}, defaultdict(int)
    for rank in range(plane.dp_at(step)):
        table = plane.get_plan(step, rank)
        for ref, role, mb, k in zip(table_to_refs(table), table.column("role").to_pylist(),
                                    table.column("micro_batch").to_pylist(),
                                    table.column("sp_size").to_pylist()):
            if role == "llm":
                where.setdefault((*ref.uid, ref.epoch), (ref, []))[1].append((rank, mb, k))
                used[rank, mb] += -(-ref.llm_tokens // k)
    return where, used


def test_a_replacement_fits_the_micro_batch_or_there_is_none(spec, tmp_path):
    plane = DataPlane(spec, tmp_path / "state", config())
    source = plane.mixer.catalog["text"]
    too_long = fitted = 0
    for step in range(4):
        where, used = placements(plane, step)
        assert max(used.values()) <= BUDGET
        for bad, held in where.values():
            k = held[0][2]
            room = min(BUDGET - used[r, mb] + -(-bad.llm_tokens // k) for r, mb, _ in held)
            upcoming = source.peek()
            reply = plane.report_corrupt(step, held[0][0], bad.source, bad.shard, bad.key,
                                         "bad header", bad.epoch)
            new = ref_from_json(reply["replacement"])
            if new is None:  # too long for the slot: left where it was in the source
                assert -(-upcoming.llm_tokens // k) > room and source.peek() == upcoming
                too_long += 1
            else:
                assert new == upcoming and -(-new.llm_tokens // k) <= room
                fitted += 1
            for r, mb, _ in held:  # the micro-batch now holds the replacement (or nothing)
                used[r, mb] += -(-(new.llm_tokens if new else 0) // k) - -(-bad.llm_tokens // k)
            assert max(used.values()) <= BUDGET
    assert too_long and fitted  # both cases happened

    # The room is journaled: a restarted plane replays the same draws at the same points, so
    # the windows it draws after the reports are the ones this plane draws.
    again = DataPlane(spec, tmp_path / "state", config())
    for step in range(4):
        commit_step(plane, step)
        commit_step(again, step)
    for step in range(4, 10):
        for rank in range(2):
            assert again.get_plan(step, rank).equals(plane.get_plan(step, rank))


def test_a_bad_replacement_gets_the_room_of_the_sample_the_step_planned(spec, tmp_path):
    plane = DataPlane(spec, tmp_path / "state", config())
    where, _ = placements(plane, 0)
    for bad, held in where.values():
        first = ref_from_json(plane.report_corrupt(0, held[0][0], bad.source, bad.shard,
                                                   bad.key, "x", bad.epoch)["replacement"])
        if first is not None:
            break
    room = plane.corrupt.events[-1]["max_tokens"]
    assert first is not None and room is not None
    # The replacement is bad too: the step never planned it, but it sits in the planned
    # sample's slot, so its replacement gets that slot's room (not "no limit").
    plane.report_corrupt(0, held[0][0], first.source, first.shard, first.key, "x",
                         first.epoch)
    assert plane.corrupt.events[-1]["max_tokens"] == room
    assert plane.corrupt.planned_sample(0, (*first.uid, first.epoch)) == (*bad.uid, bad.epoch)


def ref(key: str, tokens: int) -> SampleRef:
    return SampleRef(0, "s", "s-0.tar", key, 0, 1, llm_tokens=tokens, text_tokens=tokens)


def test_replacement_room_of_whole_and_sp_split_samples():
    refs = [ref("a", 30), ref("b", 50), ref("c", 250), ref("d", 10)]
    tokens_N = np.array([r.llm_tokens for r in refs])
    # rank 0 mb 0: a + b (80); c split over ranks 0-1 in mb 1 (125 each); d on rank 1 mb 0
    plan = SimpleNamespace(
        sample_P=np.array([0, 1, 2, 2, 3]), rank_P=np.array([0, 0, 0, 1, 1]),
        micro_batch_P=np.array([0, 0, 1, 1, 0]), sp_size_P=np.array([1, 1, 2, 2, 1]),
        sp_index_P=np.array([0, 0, 0, 1, 0]), sp_tokens_P=None,
        mb_tokens_RB=np.array([[80, 125], [10, 175]]))  # rank 1 mb 1 also holds 50 more
    assert replacement_room(plan, refs, tokens_N, ("s", "s-0.tar", "a", 0), 200) == 150
    assert replacement_room(plan, refs, tokens_N, ("s", "s-0.tar", "d", 0), 200) == 200
    # c: 125 per rank; rank 1's micro-batch has 50 more, so a slice may be 150: 2 x 150 tokens
    assert replacement_room(plan, refs, tokens_N, ("s", "s-0.tar", "c", 0), 200) == 300
    assert replacement_room(plan, refs, tokens_N, ("s", "s-0.tar", "c", 1), 200) is None
    # Earlier replacements in the same micro-batch count instead of what they replaced: a
    # replaced by 150 tokens leaves b 200 - 150 = 50; a left out leaves b the whole budget.
    a = ("s", "s-0.tar", "a", 0)
    b = ("s", "s-0.tar", "b", 0)
    assert replacement_room(plan, refs, tokens_N, b, 200, {a: ref("a2", 150)}) == 50
    assert replacement_room(plan, refs, tokens_N, b, 200, {a: None}) == 200
    assert replacement_room(plan, refs, tokens_N, a, 200, {a: ref("a2", 150)}) == 150


def test_replacement_room_of_a_sample_split_by_speed():
    """c (250 tokens) cut (200, 50) for ranks of different speeds; rank 1's micro-batch also
    holds d (10) and 40 more. A replacement is cut in proportion (4/5 on rank 0), so rank 0's
    room of 250 - 1 (a token spare for rounding) allows 249 × 250/200 = 311 tokens; rank 1's
    (250 - 50 - 1) × 250/50 would allow 995."""
    refs = [ref("a", 30), ref("b", 50), ref("c", 250), ref("d", 10)]
    tokens_N = np.array([r.llm_tokens for r in refs])
    plan = SimpleNamespace(
        sample_P=np.array([0, 1, 2, 2, 3]), rank_P=np.array([0, 0, 0, 1, 1]),
        micro_batch_P=np.array([0, 0, 1, 1, 1]), sp_size_P=np.array([1, 1, 2, 2, 1]),
        sp_index_P=np.array([0, 0, 0, 1, 0]), sp_tokens_P=np.array([0, 0, 200, 50, 0]),
        mb_tokens_RB=np.array([[80, 200], [0, 100]]))
    c, d = ("s", "s-0.tar", "c", 0), ("s", "s-0.tar", "d", 0)
    assert replacement_room(plan, refs, tokens_N, c, 250) == 311
    assert rescale_lengths([200, 50], 311)[0] <= 250  # rank 0's cut of it fits
    # d's room: 250 - (100 - 10); with c replaced by 100 tokens, cut (80, 20), rank 1 holds
    # 30 fewer of c's
    assert replacement_room(plan, refs, tokens_N, d, 250) == 160
    assert replacement_room(plan, refs, tokens_N, d, 250, {c: ref("c2", 100)}) == 190


def test_occupants_follow_chains_of_bad_replacements():
    ledger = CorruptLedger()
    for bad, new in (("a", "a2"), ("a2", "a3"), ("b", None)):
        ledger.record({"t": "corrupt", "step": 5, "rank": 0, "source": "s", "shard": "s-0.tar",
                       "key": bad, "epoch": 0, "reason": "r", "before_window": 2,
                       "replacement": ref_to_json(new and ref(new, 7))}, applied=True)
    assert ledger.occupants(5) == {("s", "s-0.tar", "a", 0): ref("a3", 7),
                                   ("s", "s-0.tar", "b", 0): None}
    assert ledger.planned_sample(5, ("s", "s-0.tar", "a3", 0)) == ("s", "s-0.tar", "a", 0)
    assert ledger.occupants(6) == {}


def test_older_journal_records_without_room_replay_unlimited(tmp_path):
    state = {"events": [{"t": "corrupt", "step": 3, "rank": 0, "source": "s", "shard": "x",
                         "key": "k", "epoch": 0, "reason": "r", "before_window": 2,
                         "replacement": ref_to_json(ref("long", 10_000))}]}
    ledger = CorruptLedger.from_state(state)

    class Source:
        def quarantine(self, shard, key):
            pass

        def peek(self):
            return ref("long", 10_000)

        def next(self):
            return ref("long", 10_000)

    ledger.apply({"s": Source()}, 2)
    assert ledger.events[0]["applied"] and ledger.events[0]["replacement"] == ref_to_json(
        ref("long", 10_000))
