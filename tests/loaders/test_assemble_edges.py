"""The assembler at its edges (``loaders.assemble``): how many replacements a bad sample gets,
how skips are counted, the ``fail`` policy given as a string read from a config, encode rows of
replaced samples and of samples with media of several kinds, plans with one or no micro-batch,
and what a rank decodes of samples with hundreds of media items or in a world of hundreds of
ranks. Each case was a survivor of the mutation run (issue #46)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
import yaml

from omniscale.loaders.assemble import DecodedStep, StepAssembler, decode_work, sample_id
from omniscale.loaders.decode import DecodeNeed
from omniscale.loaders.errors import CorruptSample
from tests.loaders.test_chunks import G, _fake_decode
from tests.loaders.test_decode_work import _row, _table


def _decoded_step(plan, decode) -> DecodedStep:
    """Every sample of the plan decoded whole, one by one (the trainer-side path)."""
    return DecodedStep({sample_id(ref): decode(ref) for ref, _ in decode_work(plan)})


class _Plane:
    """The plane's ``report_corrupt``: hands back the next replacement of a list (None when
    the list is used up) and records each report's key."""

    def __init__(self, replacements):
        self.replacements, self.reported = list(replacements), []

    def report(self, step, source, shard, key, reason, epoch):
        self.reported.append(key)
        return self.replacements.pop(0) if self.replacements else None


def _assembler(plane: _Plane, fail: set[str], policy: str = "skip") -> StepAssembler:
    return StepAssembler(0, G, policy, plane.report, _fake_decode(fail))


@pytest.mark.parametrize("bad_decodes, trained", [(7, "r7"), (8, None)])
def test_a_bad_sample_is_reported_at_most_eight_times(bad_decodes, trained):
    """Sample a and its replacements r1, r2, ... fail to decode until the ``bad_decodes``-th
    is reached. Counted by hand: with 7 bad decodes (a, r1..r6) the 7th report's replacement
    r7 decodes and trains; with 8 (a, r1..r7) the 8th report is the last, and r8 is not
    trained."""
    plan = _table([_row("a", "llm")])
    bad = {"a"} | {f"r{i}" for i in range(1, bad_decodes)}
    ref = plan.refs[0]
    plane = _Plane([replace(ref, key=f"r{i}") for i in range(1, 10)])
    assembler = _assembler(plane, bad)
    batch = assembler.assemble(0, plan, _decoded_step(plan, _fake_decode(bad)))
    assert plane.reported == ["a"] + [f"r{i}" for i in range(1, bad_decodes)]
    assert len(batch.skipped) == len(batch.replaced) == bad_decodes
    [micro_batch] = batch.micro_batches
    assert [r.key for r in micro_batch.seq_refs] == ([trained] if trained else [])
    assert micro_batch.num_tokens == (6 + sum(map(ord, "r7")) % 5 if trained else 0)


def test_each_skipped_sample_is_counted_once_by_its_reason():
    plan = _table([_row("a", "llm"), _row("b", "llm"), _row("c", "llm")])
    assembler = _assembler(_Plane([]), {"a", "c"})
    batch = assembler.assemble(0, plan, _decoded_step(plan, _fake_decode({"a", "c"})))
    # _fake_decode's reason is "member 'x': bad", counted without its member: "bad"
    assert assembler.corrupt_reasons == Counter({"bad": 2})
    assert [e.key for e in batch.skipped] == ["a", "c"]


def test_the_fail_policy_read_from_a_config_raises_the_bad_sample():
    """A policy from a YAML config is a string object of its own, not the literal "fail"."""
    policy = yaml.safe_load("corrupt_policy: fail")["corrupt_policy"]
    plan = _table([_row("a", "llm"), _row("b", "llm")])
    plane = _Plane([])
    assembler = _assembler(plane, {"b"}, policy)
    with pytest.raises(CorruptSample, match="b: member 'x': bad"):
        assembler.assemble(0, plan, _decoded_step(plan, _fake_decode({"b"})))
    assert plane.reported == []  # nothing quarantined


def test_the_encode_row_of_a_replaced_sample_is_dropped():
    """b is encoded here for rank 1; it fails and is replaced by b2 (which has an image too):
    the item the row names no longer exists, so no encoder item is produced for it."""
    plan = _table([_row("a", "llm"),
                   _row("b", "encode", images=(4,), item=("image", 0), consume_rank=1)])
    b2 = replace(plan.refs[1], key="b2")
    plane = _Plane([b2])
    batch = _assembler(plane, {"b"}).assemble(0, plan, _decoded_step(plan, _fake_decode({"b"})))
    assert plane.reported == ["b"]
    assert batch.replaced == [(plan.refs[1], b2)]
    assert batch.encode_items == []
    assert [r.key for r in batch.micro_batches[0].seq_refs] == ["a"]


def test_an_encode_row_takes_the_item_of_its_own_kind():
    """Sample m has an image, a video and an audio clip (decoded in that order); rows encode
    its video and its clip for rank 1."""
    plan = _table([
        _row("m", "encode", images=(4,), videos=(8,), audio=(20,), item=("video", 0),
             consume_rank=1),
        _row("m", "encode", images=(4,), videos=(8,), audio=(20,), item=("audio", 0),
             consume_rank=1)])
    decode = _fake_decode(set())
    batch = _assembler(_Plane([]), set()).assemble(0, plan, _decoded_step(plan, decode))
    image, video, audio = decode(plan.refs[0]).sample.media
    assert [(i.kind, i.index, i.consume_rank) for i in batch.encode_items] == [
        ("video", 0, 1), ("audio", 0, 1)]
    got_video, got_audio = batch.encode_items
    assert torch.equal(got_video.tensor, torch.from_numpy(video.array))
    assert got_video.grid_thw == video.grid_thw == (2, 2, 2)
    assert torch.equal(got_audio.tensor, torch.from_numpy(audio.array))
    assert got_audio.frames == 20


def test_a_plan_with_one_micro_batch_assembles_one():
    plan = _table([_row("a", "llm"), _row("b", "llm")])
    batch = _assembler(_Plane([]), set()).assemble(0, plan,
                                                    _decoded_step(plan, _fake_decode(set())))
    assert len(batch.micro_batches) == 1
    assert [r.key for r in batch.micro_batches[0].seq_refs] == ["a", "b"]


def test_a_rank_that_only_encodes_trains_no_micro_batch():
    plan = _table([_row("g", "encode", images=(4,), item=("image", 0), consume_rank=1)])
    assert plan.num_micro_batches == 0
    batch = _assembler(_Plane([]), set()).assemble(0, plan,
                                                    _decoded_step(plan, _fake_decode(set())))
    assert batch.micro_batches == []
    assert [(i.ref.key, i.kind) for i in batch.encode_items] == [("g", "image")]


def test_a_rank_numbered_past_256_decodes_the_items_it_encodes():
    plan = _table([_row("a", "llm", images=(16, 16, 16), encode_ranks=(300, 7, 300))])
    assert decode_work(plan, rank=300) == [
        (plan.refs[0], DecodeNeed(True, frozenset({("image", 0), ("image", 2)})))]
    assert decode_work(plan, rank=7) == [
        (plan.refs[0], DecodeNeed(True, frozenset({("image", 1)})))]


def test_samples_with_hundreds_of_images_are_decoded_as_far_as_used():
    """a: 300 images, the even ones encoded here (rank 0) -> its text and those 150;
    b: 300 images all encoded here -> used whole, decoded whole (None)."""
    n = 300
    plan = _table([_row("a", "llm", images=(4,) * n, encode_ranks=[i % 2 for i in range(n)]),
                   _row("b", "llm", images=(4,) * n, encode_ranks=[0] * n)])
    assert decode_work(plan, rank=0) == [
        (plan.refs[0], DecodeNeed(True, frozenset(("image", i) for i in range(0, n, 2)))),
        (plan.refs[1], None)]


def test_encode_ranks_that_do_not_fit_the_sample_mean_it_is_decoded_whole():
    """More encode ranks than the sample has items (as with none at all): no encoder plan
    this rank can follow, so it decodes the sample whole."""
    plan = _table([_row("a", "llm", images=(16,), encode_ranks=(1, 1)),
                   _row("b", "llm", images=(16,), encode_ranks=())])
    assert decode_work(plan, rank=0) == [(plan.refs[0], None), (plan.refs[1], None)]
