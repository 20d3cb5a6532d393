"""Sources in an object store (a real S3 server process): a work item's samples are fetched
in few coalesced requests and come out byte for byte as the local copy's; transient faults
are retried; a missing shard, a range past the end and a stalled store become one-line
CorruptSamples naming the shard; decoding over S3 equals decoding the local copy."""

from __future__ import annotations

import dataclasses
import tarfile
import threading
import time

import numpy as np
import pytest

from omniscale.dataplane.spec import load_spec
from omniscale.loaders.chunk_worker import RefDataset
from omniscale.loaders.chunks import ChunkWork
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.readers import RawSample, SampleReader
from omniscale.loaders.remote_io import RemoteSettings, classify, coalesce, scrub
from omniscale.loaders.transfer import pack, unpack
from omniscale.loaders.worker import DecodedList, TimedDecoder, decoder_spec
from omniscale.location import Location
from omniscale.refs import SampleRef
from tests.loaders.decode_fixtures import refs_of
from tests.s3_fixtures import (  # noqa: F401 -- fixtures
    new_bucket,
    s3_fixture,
    s3_server_fixture,
    upload_tree,
)

TARS = ("text", "image_caption", "interleaved", "video_caption")
FAST = RemoteSettings(backoff_s=0.01, max_backoff_s=0.05)
# botocore and s3fs retry some errors themselves; one try each leaves it to the reader
ONE_TRY = {"config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 5,
                             "read_timeout": 10}}


@pytest.fixture(scope="module")
def remote(s3_server, demo_root):
    """The demo's spec, and where a copy of some of its sources is in the bucket."""
    spec = load_spec(demo_root / "mix.yaml")
    bucket = new_bucket(s3_server, "reads")
    locs = {s.name: upload_tree(s3_server, s.path, bucket, f"train/{s.name}")
            for s in spec.sources if s.name in TARS + ("docs",)}
    return spec, locs


def _local(spec, names=TARS + ("docs",)):
    return {s.name: s.path for s in spec.sources if s.name in names}


def _tar_truth(path):
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _gets(server) -> int:
    return server.stats()["by_method"].get("GET", 0)


def _one_line(e, ref) -> str:
    assert isinstance(e, CorruptSample), e
    text = str(e)
    assert "\n" not in text and text.startswith(f"{ref.source}/{ref.key}: {ref.shard}: "), text
    assert "testing" not in text  # the fake key id and secret
    return text


def test_remote_reads_are_the_local_bytes_in_few_requests(s3, remote):
    spec, locs = remote
    refs = [r for name in TARS for r in refs_of(spec, name)]
    shards = {(r.source, r.shard) for r in refs}
    with SampleReader(locs) as reader, SampleReader(_local(spec)) as local:
        got = reader.read_many(refs)
        assert got == local.read_many(refs)
        # Adjacent samples of a shard share a request: one GET per shard, not per sample.
        assert _gets(s3) == len(shards) < len(refs) // 10
        stats = reader.stats()
        assert stats["store_requests"] == len(shards) and stats["store_retries"] == 0
        assert stats["store_bytes"] == s3.stats()["bytes_out"]
        assert local.stats()["store_requests"] == 0
        # ... and the bytes are the tar's own (an oracle apart from both readers)
        truth = {}
        for ref, raw in zip(refs, got):
            path = next(s.path for s in spec.sources if s.name == ref.source) / ref.shard
            if path not in truth:
                truth[path] = _tar_truth(path)
            assert [n for n, _ in raw.members] == [m[0] for m in ref.members]
            assert all(data == truth[path][name] for name, data in raw.members)
        # one ref alone, and a Parquet shard through its file handle
        assert reader.read(refs[7]) == got[7]
        docs = refs_of(spec, "docs")[:5]
        assert [reader.read(r) for r in docs] == [local.read(r) for r in docs]


def test_coalesce_merges_close_ranges_up_to_the_cap():
    ranges = [(0, 10), (12, 20), (100, 110), (5, 8), (30, 30), (115, 400)]
    merged = coalesce(ranges, gap=5, cap=100)
    assert merged == [(0, 20, [0, 3, 1]), (100, 110, [2]), (115, 400, [5])]
    for start, end, members in merged:  # every range inside the request that has it
        assert all(start <= ranges[i][0] and ranges[i][1] <= end for i in members)
    assert sorted(i for *_, m in merged for i in m) == [0, 1, 2, 3, 5]  # empty one left out
    assert coalesce(ranges, gap=0, cap=1000)[0] == (0, 10, [0, 3])


@pytest.mark.parametrize("kind", ["error", "slowdown"])
def test_transient_faults_are_retried_and_the_bytes_are_right(s3, remote, kind):
    spec, locs = remote
    refs = refs_of(spec, "image_caption")
    shard = refs[0].shard
    loc = Location.of(locs["image_caption"].url, {**locs["image_caption"].storage_options,
                                                  **ONE_TRY})
    s3.control(fault={"kind": kind, "n": 2, "match": shard, "method": "GET"})
    with SampleReader({"image_caption": loc}, remote=FAST) as reader, \
            SampleReader(_local(spec)) as local:
        assert reader.read_many(refs) == local.read_many(refs)
        assert s3.stats()["faults"] == 2
        if kind == "error":  # a 500 is this reader's to retry (s3fs retries SlowDown itself)
            assert reader.stats()["store_retries"] == 2
        assert reader.stats()["store_errors"] == 0


def test_a_missing_shard_and_a_range_past_the_end_are_corrupt_not_retried(s3, remote):
    spec, locs = remote
    refs = refs_of(spec, "text")[:3]
    size = (_local(spec)["text"] / refs[0].shard).stat().st_size
    gone = dataclasses.replace(refs[0], shard="text-999999.tar")
    past = dataclasses.replace(refs[1], offset=size + 4096)
    loc = Location.of(locs["text"].url, {**locs["text"].storage_options, **ONE_TRY})
    with SampleReader({"text": loc}, remote=FAST) as reader:
        got = reader.read_many([gone, past, refs[2]])
        assert "missing from the store (s3://" in _one_line(got[0], gone)
        assert "text-999999.tar" in str(got[0])
        assert "is past the end of the shard" in _one_line(got[1], past)
        assert isinstance(got[2], RawSample)  # a good ref of the same item is unharmed
        assert reader.stats()["store_retries"] == 0
        with pytest.raises(CorruptSample) as e:
            reader.read(gone)
        _one_line(e.value, gone)


def test_a_stalled_store_is_retried_then_a_corrupt_sample_quickly(s3, remote):
    spec, locs = remote
    refs = refs_of(spec, "interleaved")[:4]
    shard = refs[0].shard
    settings = dataclasses.replace(FAST, attempt_timeout_s=0.3, total_timeout_s=1.0)
    with SampleReader(locs, remote=settings) as reader, SampleReader(_local(spec)) as local:
        s3.control(fault={"kind": "hang", "n": 1, "match": shard, "hang_s": 2})
        assert reader.read_many(refs) == local.read_many(refs)  # one stall: retried
        assert reader.stats()["store_retries"] == 1
        s3.control(fault={"kind": "hang", "n": 20, "match": shard, "hang_s": 2})
        began = time.monotonic()
        got = reader.read_many(refs)
        assert time.monotonic() - began < 2.0
    for ref, out in zip(refs, got):
        text = _one_line(out, ref)
        assert "unreadable after" in text and "timed out after" in text, text


def test_errors_are_classified_and_urls_scrubbed():
    assert classify(FileNotFoundError("x")) == "missing"
    busy = OSError(16, "Please reduce your request rate.")
    assert classify(busy) == "transient" and classify(TimeoutError()) == "transient"
    assert classify(PermissionError(13, "Access Denied")) == "permanent"
    assert scrub("at s3://AKIAXYZ:sekrit@bucket/x.tar and https://h/x?X-Amz-Signature=abc "
                 "end") == "at s3://bucket/x.tar and https://h/x end"


def test_decode_all_over_s3_equals_the_local_decode(s3, remote):
    spec, locs = remote
    work = [(r, None) for name in TARS + ("docs",) for r in refs_of(spec, name)[:2]]
    here = TimedDecoder(decoder_spec(_local(spec), spec.tokenizer, spec.media,
                                     special=spec.special_tokens), timeout=30)
    there = TimedDecoder(decoder_spec(locs, spec.tokenizer, spec.media,
                                      special=spec.special_tokens), timeout=30)
    want, got = here.decode_all(work), there.decode_all(work)
    here.close()
    there.close()
    assert [o.error for o in got] == [None] * len(work)
    for a, b in zip(got, want):
        for name in ("input_ids_L", "labels_L", "position_ids_L", "mrope_3L"):
            assert np.array_equal(getattr(a.sample, name), getattr(b.sample, name)), a.ref.key
        assert len(a.sample.media) == len(b.sample.media)
        for x, y in zip(a.sample.media, b.sample.media):
            assert np.array_equal(x.array, y.array) and x.grid_thw == y.grid_thw
    # the tars of one item: one request per shard; the reads' counts travel with the result
    assert isinstance(got, DecodedList) and got.io["store_requests"] == len(TARS)
    assert got.io["store_bytes"] > 0 and not any(want.io.values())
    assert there.io == got.io
    back = unpack(pack(got))
    assert back.io == got.io and [o.ref for o in back] == [o.ref for o in got]
    # a DataLoader worker's chunk carries its reads' counts to the trainer
    spec_s3 = decoder_spec(locs, spec.tokenizer, spec.media, special=spec.special_tokens)
    step = RefDataset(spec_s3, 30, spec.media)[("tag", ChunkWork(work[:2]))][1]  # one shard
    assert step.io["store_requests"] == 1 and step.io["store_bytes"] > 0


class _Stalling:
    """A decoder stand-in whose first build's read of a work item never returns."""

    def __init__(self, spec) -> None:
        self.spec, self.reader = spec, _NoReader()

    def read_ahead(self, refs) -> None:
        if refs and self.spec.built == 1:
            threading.Event().wait()

    def decode(self, ref, need=None):
        return ref.key


class _NoReader:
    def close(self) -> None:
        pass


class _StallingSpec:
    built = 0

    def build(self):
        self.built += 1
        return _Stalling(self)


@pytest.mark.timeout(30)
def test_a_stalled_read_times_out_as_a_read_and_the_item_goes_on():
    """The read of a work item is watched too (a sample's timeout per sample): when it
    stalls, its first sample is lost as a read time-out and a fresh decoder does the rest."""
    work = [(SampleRef(0, "src", "s.tar", k, 0, 0), None) for k in "abc"]
    decoder = TimedDecoder(_StallingSpec(), timeout=0.2)
    outs = decoder.decode_all(work)
    assert [o.sample for o in outs] == [None, "b", "c"]
    assert str(outs[0].error) == "src/a: read timed out after 0.6 s (3 samples read together)"
    decoder.close()
