"""Re-indexing touches only changed shards, forgets deleted ones, and the index does not
depend on the worker count."""

from __future__ import annotations

import os
import shutil

import pyarrow.parquet as pq
import pytest

from omniscale.geometry import MediaGeometry
from omniscale.index_schema import index_path, read_index, read_index_metadata
from omniscale.loaders.index import index_source
from tests.loaders.index_fixtures import (
    audio_bytes,
    caption_members,
    image_bytes,
    video_bytes,
    write_tar,
    write_tokenizer,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("incremental")
    write_tokenizer(root / "tokenizer.json")
    source = root / "src"
    for i in range(4):
        write_tar(source / f"part-{i:03d}.tar",
                  caption_members(f"i{i}", f"a cat number {i}", jpg=image_bytes(40 + i, 50))
                  + caption_members(f"v{i}", "a clip", mp4=video_bytes(4 + i, 4, 64, 48))
                  + caption_members(f"a{i}", "speech", wav=audio_bytes(0.2 + i / 10, 16000))
                  + caption_members(f"bad{i}", "x", jpg=b"not an image"))
    return root


@pytest.fixture
def source(pristine, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(pristine, root)
    return root / "src", root / "tokenizer.json"


def run(source, tokenizer, geometry=MediaGeometry(), **kw):
    return index_source(source, "webdataset", tokenizer, geometry, progress=False,
                        **{"workers": 1, **kw})


def test_touch_one_shard_reindexes_only_it(source):
    src, tokenizer = source
    first = run(src, tokenizer)
    assert (first.shards_indexed, first.shards_unchanged, first.samples, first.corrupt) == \
        (4, 0, 16, 4)
    before = read_index(src)
    again = run(src, tokenizer)
    assert (again.shards_indexed, again.shards_unchanged) == (0, 4)
    assert again.errors == first.errors and again.corrupt == 4
    stat = (src / "part-002.tar").stat()
    os.utime(src / "part-002.tar", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    touched = run(src, tokenizer)
    assert (touched.shards_indexed, touched.shards_unchanged) == (1, 3)
    assert read_index(src).equals(before)
    forced = run(src, tokenizer, force=True)
    assert forced.shards_indexed == 4 and read_index(src).equals(before)
    changed_geometry = run(src, tokenizer, MediaGeometry(patch_size=7))
    assert changed_geometry.shards_indexed == 4
    assert read_index_metadata(src)["geometry"]["patch_size"] == 7
    assert not read_index(src).equals(before)


def test_deleted_and_added_shards(source):
    src, tokenizer = source
    run(src, tokenizer)
    (src / "part-001.tar").unlink()
    write_tar(src / "part-009.tar", caption_members("new", "a new sample"))
    report = run(src, tokenizer)
    assert (report.shards_total, report.shards_indexed, report.shards_unchanged) == (4, 1, 3)
    table = read_index(src)
    assert sorted(set(table.column("shard").to_pylist())) == [
        "part-000.tar", "part-002.tar", "part-003.tar", "part-009.tar"]
    assert table.num_rows == 13 and report.corrupt == 3
    assert set(read_index_metadata(src)["shards"]) == set(table.column("shard").to_pylist())
    assert not [p for p in src.iterdir() if p.name.endswith(".tmp")]


def test_same_index_with_one_or_two_workers(source):
    src, tokenizer = source
    run(src, tokenizer, workers=1)
    one = pq.read_table(index_path(src))
    run(src, tokenizer, workers=2, force=True)
    two = pq.read_table(index_path(src))
    assert one.equals(two)
    assert one.schema.metadata == two.schema.metadata
    keys = list(zip(one.column("shard").to_pylist(), one.column("offset").to_pylist()))
    assert keys == sorted(keys)
