"""The source index on the real demo dataset: every byte range and every cost feature of the
samples of each source's first shard, in every source and split, checked against a full decode
(every shard is read alone and matched against its slice of the whole index below; the
demo's later shards are written by the same code as its first)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniscale.dataplane.spec import load_spec
from omniscale.index_schema import read_index, read_index_metadata, read_shard
from omniscale.loaders.index import index_paths
from tests.demo_data import copy_demo
from tests.loaders.decode_oracle import assert_row_matches_full_decode, text_tokens_of


@pytest.fixture(scope="module")
def demo(demo_root, tmp_path_factory):
    out = copy_demo(demo_root, tmp_path_factory.mktemp("demo") / "demo", indexed=False)
    specs = [load_spec(out / "mix.yaml"), load_spec(out / "eval.yaml")]
    reports = index_paths([s.path for s in specs], progress=False)
    return specs, reports


def test_demo_indexes_cleanly(demo):
    specs, reports = demo
    assert len(reports) == sum(len(s.sources) for s in specs)
    for report in reports:
        assert (report.corrupt, report.errors) == (0, []), report
        assert report.samples > 0 and report.shards_total >= 2


def test_every_demo_feature_equals_a_full_decode(demo):
    specs, _ = demo
    for spec in specs:
        for source in spec.sources:
            rows = read_index(source.path).to_pylist()
            first = min(row["shard"] for row in rows)
            rows = [row for row in rows if row["shard"] == first]
            if source.format == "parquet":
                for row in rows:
                    group = pq.ParquetFile(source.path / row["shard"]).read_row_group(row["offset"])
                    text = group.column("text")[row["size"]].as_py()
                    assert row["llm_tokens"] == text_tokens_of(spec.tokenizer, text)
                continue
            kinds = set()
            for row in rows:
                kinds |= assert_row_matches_full_decode(source.path, row, spec.tokenizer,
                                                        spec.media)
            media = {"image_caption": "image", "video_caption": "video",
                     "audio_caption": "audio", "interleaved": "image"}.get(source.template)
            assert media is None or media in kinds, source.name


def test_each_shard_reads_alone_as_its_slice_of_the_index(demo):
    specs, _ = demo
    for source in specs[0].sources:
        whole = read_index(source.path)
        meta = read_index_metadata(source.path)
        parts = [read_shard(source.path, shard, meta) for shard in sorted(meta["shards"])]
        assert all(len(set(p.column("shard").to_pylist())) == 1 for p in parts)
        assert pa.concat_tables(parts).equals(whole.replace_schema_metadata(None).cast(
            parts[0].schema)), source.name
