"""The demo read from a real S3 server (moto in its own process) end to end: ``data copy``
puts it in a bucket, the plane plans from the indexes there, and a rank's loader -- reading
ranges through the node cache, which the plans of the next steps fill ahead -- hands over the
same StepBatches as the local copy."""

from __future__ import annotations

import re

import pytest

from omniscale.dataplane.embedded import start_embedded
from omniscale.dataplane.spec import load_spec
from omniscale.loaders.block_cache import CacheConfig
from omniscale.loaders.pipeline import RankLoader
from omniscale.plan import fingerprint
from omniscale.refs import table_to_refs
from omniscale.tools.data_copy import copy_specs
from omniscale.tools.train.plane_session import loader_for
from tests.loaders.pipeline_fixtures import CONFIG, assert_same_batch
from tests.s3_fixtures import client, new_bucket, s3_fixture, s3_server_fixture  # noqa: F401

# an index's temp file while it is written (`._index.parquet.PID.tmp`; an older release's names
# without the dot or with two underscores): not a file of the source
INDEX_BEING_WRITTEN = re.compile(r"\.?_{1,2}index\.parquet\.\d+\.tmp")

STEPS = 4
RANK = 0


def run(spec_path, state_dir, **loader_kw):
    """STEPS batches of RANK's loader (1 worker), every step committed by both ranks."""
    spec = load_spec(spec_path)
    batches = []
    with start_embedded(spec.path, state_dir, CONFIG) as plane:
        with loader_for(plane.url, RANK, RankLoader, spec.locations, spec.tokenizer, spec.media,
                        indexes=spec.indexes, num_workers=1, prefetch_steps=2,
                        **loader_kw) as loader:
            for step in range(STEPS):
                batch = next(loader)
                batches.append(batch)
                loader.commit(step)
                other = plane.plane.get_plan(step, 1 - RANK)
                plane.plane.commit(step, 1 - RANK, fingerprint(other))
            prefetched = (loader.shard_prefetcher.stats() if loader.shard_prefetcher
                          else None)
    return batches, prefetched


@pytest.mark.timeout(180)
def test_the_demo_from_a_bucket_gives_the_local_batches(pipeline_demo, s3, tmp_path):
    bucket = new_bucket(s3, "demo")
    remote, = copy_specs([pipeline_demo / "all.yaml"], f"s3://{bucket}/demo",
                         s3.storage_options, progress=False, out_dir=tmp_path)
    spec = load_spec(remote)
    assert all(s.location.url == f"s3://{bucket}/demo/train/{s.name}" for s in spec.sources)
    # every file of every source is in the bucket, byte for byte the same size -- but an index
    # temp file, which the copy skips by design: a full CI run listed `._index.parquet.PID.tmp`
    # in this worker's copy of the demo (left by a process killed while writing an index, or
    # one writing it then; which, not found)
    listed = {o["Key"]: o["Size"] for o in client(s3).list_objects_v2(
        Bucket=bucket)["Contents"]}
    local = load_spec(pipeline_demo / "all.yaml")
    for source in local.sources:
        for path in source.path.rglob("*"):
            if path.is_file() and not INDEX_BEING_WRITTEN.fullmatch(path.name):
                rel = path.relative_to(source.path).as_posix()
                assert listed[f"demo/train/{source.name}/{rel}"] == path.stat().st_size, rel
    # copying again uploads nothing (sizes match): an interrupted copy resumes; and an index
    # being rewritten meanwhile (its temp file, today's name or an older release's) is no file
    # of the source (a full CI run once listed one, then failed to upload it once renamed)
    source_dir = local.sources[0].path
    writing = [source_dir / "._index.parquet.7.tmp", source_dir / "__index.parquet.7.tmp"]
    s3.control(reset_stats=True)
    try:
        for path in writing:
            path.write_bytes(b"half an index")
        copy_specs([pipeline_demo / "all.yaml"], f"s3://{bucket}/demo", s3.storage_options,
                   progress=False, out_dir=tmp_path)
    finally:
        for path in writing:
            path.unlink()
    assert s3.stats()["by_method"].get("PUT", 0) == 0

    want, _ = run(pipeline_demo / "all.yaml", tmp_path / "local")
    s3.control(reset_stats=True)
    got, prefetched = run(remote, tmp_path / "remote",
                          cache=CacheConfig(str(tmp_path / "cache"), 1 << 30),
                          cache_prefetch_steps=4)
    assert s3.stats()["by_method"].get("GET", 0) > 0  # it did read from the store
    assert prefetched is not None and prefetched["prefetch_blocks"] > 0, prefetched
    assert len(got) == len(want) == STEPS
    # the readers' counters reach each step: requests to the store or blocks from the cache
    assert all(not b.io.get("store_requests") for b in want)  # local: no store at all
    io = [b.io for b in got]
    assert all(x.get("cache_hits", 0) + x.get("cache_misses", 0) > 0 for x in io), io
    for a, b in zip(got, want):
        assert a.step == b.step and len(a.micro_batches) == len(b.micro_batches)
        assert sum(mb.num_tokens for mb in a.micro_batches) > 0
        for x, y in zip(a.micro_batches, b.micro_batches):
            assert_same_batch(x, y)
        assert len(a.encode_items) == len(b.encode_items)


@pytest.mark.timeout(180)
def test_a_shard_missing_from_the_bucket_is_skipped_and_replaced(pipeline_demo, s3, tmp_path):
    """A shard deleted from the store after indexing: its samples fail as corrupt (not
    retried), the policy skips and replaces them, and the plane stays exactly-once."""
    bucket = new_bucket(s3, "missing")
    remote, = copy_specs([pipeline_demo / "all.yaml"], f"s3://{bucket}/demo",
                         s3.storage_options, progress=False, out_dir=tmp_path)
    spec = load_spec(remote)
    with start_embedded(spec.path, tmp_path / "state", CONFIG) as plane:
        # the plane plans from the index alone: delete an image shard step 0 reads
        shard = next(ref.shard for ref in table_to_refs(plane.plane.get_plan(0, 0))
                     if ref.source == "image_caption")
        client(s3).delete_object(Bucket=bucket, Key=f"demo/train/image_caption/{shard}")
        loaders = [loader_for(plane.url, r, RankLoader, spec.locations, spec.tokenizer, spec.media,
                              indexes=spec.indexes, num_workers=1, prefetch_steps=2)
                   for r in range(2)]
        try:
            batches = []
            for step in range(STEPS):
                for loader in loaders:
                    batches.append(next(loader))
                for loader in loaders:
                    loader.commit(step)
        finally:
            for loader in loaders:
                loader.close()
        report = plane.plane.audit()
        status = plane.plane.status()
    skipped = [e for b in batches for e in b.skipped]
    assert skipped and all(e.source == "image_caption" and shard in e.reason
                           and "missing from the store" in e.reason for e in skipped), skipped
    assert all(len(e.reason.splitlines()) == 1 for e in skipped)
    row = next(s for s in status["sources"] if s["source"] == "image_caption")
    assert row["corrupt_reported"] >= len({e.key for e in skipped})
    assert (report["duplicated"], report["missing"], report["fingerprint_mismatches"]) == \
        (0, 0, [])
