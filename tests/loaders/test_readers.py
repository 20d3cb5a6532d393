"""Readers fetch a sample's exact bytes by reference, for every source format, with a bounded
number of open files; a ref that does not match its shard is a one-line CorruptSample."""

from __future__ import annotations

import dataclasses
import tarfile

import pyarrow.parquet as pq
import pytest

from omniscale.dataplane.spec import load_spec
from omniscale.errors import UserError
from omniscale.index_schema import read_index
from omniscale.loaders.errors import CorruptSample
from omniscale.loaders.index import index_paths
from omniscale.loaders.readers import SampleReader
from tests.loaders.decode_fixtures import ref_of, refs_of
from tests.loaders.index_fixtures import write_jsonl, write_tokenizer


@pytest.fixture(scope="module")
def spec(demo_root):
    return load_spec(demo_root / "mix.yaml")


def _sources(spec):
    return {s.name: s.path for s in spec.sources}


def _tar_truth(path):
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_tar_members_are_exactly_the_member_bytes(spec):
    with SampleReader(_sources(spec)) as reader:
        for source in spec.sources:
            if source.format != "webdataset":
                continue
            truth = {}
            for ref in refs_of(spec, source.name):
                if ref.shard not in truth:
                    truth[ref.shard] = _tar_truth(source.path / ref.shard)
                raw = reader.read(ref)
                assert (raw.source, raw.key) == (source.name, ref.key)
                assert [n for n, _ in raw.members] == [m[0] for m in ref.members]
                for name, data in raw.members:
                    assert data == truth[ref.shard][name], (source.name, name)


def test_parquet_rows_are_the_rows_text(spec):
    source = next(s for s in spec.sources if s.format == "parquet")
    with SampleReader(_sources(spec)) as reader:
        for ref in refs_of(spec, source.name):
            group = pq.ParquetFile(source.path / ref.shard).read_row_group(ref.offset)
            [(name, data)] = reader.read(ref).members
            assert name == f"{ref.key}.txt"
            assert data.decode() == group.column("text")[ref.size].as_py()


def test_jsonl_lines_through_an_fsspec_url(tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tokenizer.json")
    records = [{"text": f"line {i} é", "key": f"k{i}"} for i in range(5)] + [{"text": "no key"}]
    write_jsonl(tmp_path / "src" / "part-0.jsonl", records)
    index_paths([tmp_path / "src"], tokenizer=tokenizer, progress=False)
    rows = read_index(tmp_path / "src").to_pylist()
    with SampleReader({"notes": f"file://{tmp_path / 'src'}"}) as reader:
        for row, record in zip(rows, records, strict=True):
            ref = ref_of("notes", row)
            [(_, data)] = reader.read(ref).members
            assert data.decode() == record["text"]


def test_open_files_stay_bounded_across_many_shards(spec):
    refs = [r for s in spec.sources for r in refs_of(spec, s.name)]
    shards = {(r.source, r.shard) for r in refs}
    assert len(shards) > 4
    with SampleReader(_sources(spec), max_open=2) as small, SampleReader(_sources(spec)) as big:
        for ref in refs[::3]:
            assert small.read(ref) == big.read(ref)
            assert small.open_files <= 2
    assert small.open_files == 0


def _one_line(e: CorruptSample, ref) -> str:
    text = str(e)
    assert "\n" not in text and text.startswith(f"{ref.source}/{ref.key}: "), text
    assert (e.source, e.key) == (ref.source, ref.key)
    return text


def test_missing_member_is_corrupt(spec):
    ref = refs_of(spec, "image_caption")[0]
    name, offset, size = ref.members[0]
    renamed = dataclasses.replace(ref, members=((name + ".png", offset, size),) + ref.members[1:])
    shifted = dataclasses.replace(ref, members=((name, offset + 512, size),) + ref.members[1:])
    with SampleReader(_sources(spec)) as reader:
        for bad in (renamed, shifted):
            with pytest.raises(CorruptSample) as e:
                reader.read(bad)
            assert "missing member" in _one_line(e.value, ref)
        with pytest.raises(CorruptSample) as e:
            reader.read(dataclasses.replace(ref, members=()))
        assert "no members" in _one_line(e.value, ref)


def test_byte_range_past_the_end_of_the_shard_is_corrupt(spec):
    ref = refs_of(spec, "text")[-1]
    source = next(s for s in spec.sources if s.name == "text")
    end = (source.path / ref.shard).stat().st_size
    bad = dataclasses.replace(ref, offset=end - 512, size=4096,
                              members=((f"{ref.key}.txt", end, 100),))
    with SampleReader(_sources(spec)) as reader:
        with pytest.raises(CorruptSample) as e:
            reader.read(bad)
        assert "past the end" in _one_line(e.value, ref)
        with pytest.raises(CorruptSample) as e:
            reader.read(dataclasses.replace(ref, shard="gone-000009.tar"))
        assert "unreadable" in _one_line(e.value, ref)


def test_parquet_row_out_of_range_is_corrupt(spec):
    ref = refs_of(spec, "docs")[0]
    with SampleReader(_sources(spec)) as reader:
        for bad in (dataclasses.replace(ref, size=10_000), dataclasses.replace(ref, offset=99)):
            with pytest.raises(CorruptSample) as e:
                reader.read(bad)
            _one_line(e.value, ref)


def test_unknown_source_is_a_user_error_not_a_corrupt_sample(spec):
    ref = dataclasses.replace(refs_of(spec, "text")[0], source="nope")
    with SampleReader(_sources(spec)) as reader, pytest.raises(UserError) as e:
        reader.read(ref)
    assert not isinstance(e.value, CorruptSample) and "nope" in str(e.value)
