"""Indexing sources in an object store (a real S3 server process, moto): read in place by
ranged reads, the same index as the same files on disk, incremental by ETag, the index beside
the shards or under an index_dir, and one line for every mistake."""

from __future__ import annotations

import io
import json
import random
import shutil
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniscale.errors import UserError
from omniscale.index_schema import read_index, read_index_metadata
from omniscale.loaders.index import index_paths
from omniscale.loaders.ranged_file import MemberFile, RangedFile
from omniscale.location import Location
from omniscale.tools.cli import main
from omniscale.tools.s3_server import S3Server
from tests.loaders.index_fixtures import (
    audio_bytes,
    caption_members,
    image_bytes,
    video_bytes,
    write_jsonl,
    write_tar,
    write_tokenizer,
)
from tests.s3_fixtures import (  # noqa: F401 -- fixtures
    new_bucket,
    s3_fixture,
    s3_server_fixture,
    upload_tree,
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Local sources, uploaded per test: large media (so that reading them whole would show)
    next to small ones, a corrupt member, and text sources."""
    root = tmp_path_factory.mktemp("remote")
    write_tokenizer(root / "tokenizer.json")
    big = []
    for i in range(5):  # ~600 KB of uncompressed pixels and ~100 KB of audio per sample
        big += caption_members(f"s{i}", "<image> a cat <audio>",
                               jpg=image_bytes(500 + i, 400, "BMP"),
                               wav=audio_bytes(3.0 + i / 10, 16000))
    big += caption_members("bad", "a cat", jpg=b"not an image")
    write_tar(root / "pics" / "pics-000.tar", big)
    write_tar(root / "pics" / "sub" / "pics-001.tar",
              caption_members("v", "a clip", mp4=video_bytes(4, 4, 64, 48))
              + caption_members("j", "a photo", jpg=image_bytes(96, 64)))
    write_jsonl(root / "lines" / "a.jsonl", [{"text": "hello there"}, b"{not json",
                                             {"text": "general kenobi", "key": "k"}])
    (root / "table").mkdir()
    pq.write_table(pa.table({"text": ["one", "two", None]}), root / "table" / "t.parquet",
                   row_group_size=2)
    return root


def upload(s3: S3Server, local: Path, prefix: str) -> Location:
    """``local``'s files under ``s3://<a new bucket>/<prefix>``."""
    return upload_tree(s3, local, new_bucket(s3, "index"), prefix)


def objects(loc: Location) -> list[str]:
    fs, path = loc.fs()
    fs.invalidate_cache()
    return sorted(fs.find(path))


def without_fingerprints(meta: dict) -> dict:
    return {**meta, "shards": {s: {k: v for k, v in m.items() if k not in
                                   ("size", "etag", "mtime_ns")}
                               for s, m in meta["shards"].items()}}


def test_ranged_file_reads_what_bytesio_reads():
    data = random.Random(0).randbytes(300_000)
    ranges = []

    def opened() -> RangedFile:
        ranges.clear()
        return RangedFile(lambda a, b: ranges.append((a, b)) or data[a:b], len(data), "x",
                          min_block=1000, max_block=64_000, read_through=4000)

    f, oracle, rng = opened(), io.BytesIO(data), random.Random(1)
    for _ in range(400):
        if rng.random() < 0.4:
            whence = rng.choice([0, 1, 2])
            offset = [rng.randrange(len(data) + 10), rng.randrange(-min(oracle.tell(), 200), 200),
                      rng.randrange(-500, 10)][whence]
            assert f.seek(offset, whence) == oracle.seek(offset, whence)
        n = rng.randrange(5000)
        assert f.read(n) == oracle.read(n) and f.tell() == oracle.tell()
        member = MemberFile(f, rng.randrange(len(data)), rng.randrange(20_000))
        assert member.read() == data[member._offset:member._offset + member.size]
        f.seek(oracle.tell())  # a member's reads move the file it windows

    f = opened()  # read through in small steps: the ranges widen up to max_block
    while f.read(512):
        pass
    assert [b - a for a, b in ranges][:7] == [1000, 2000, 4000, 8000, 16_000, 32_000, 64_000]
    assert len(ranges) == 10 and f.fetched == len(data)  # 127 000 bytes, then 3 of 64 000
    f = opened()  # a header every 50 000 bytes: one small range each, nothing between
    for at in range(0, len(data), 50_000):
        f.seek(at)
        assert f.read(512) == data[at:at + 512]
    assert ranges == [(at, at + 1000) for at in range(0, len(data), 50_000)]


def test_remote_tar_read_by_ranges_matches_local(s3, files, tmp_path):
    local = files / "pics"
    remote = upload(s3, local, "a/pics")
    tokenizer = files / "tokenizer.json"
    s3.control(reset_stats=True)
    report, = index_paths([remote], tokenizer=tokenizer, workers=1, progress=False)
    sent = s3.stats()["bytes_out"]
    shard_bytes = sum(p.stat().st_size for p in local.rglob("*.tar"))
    # Headers only: each large member costs one small range, never its payload.
    assert sent < shard_bytes / 4, (sent, shard_bytes)
    assert (report.samples, report.corrupt) == (8, 1)
    assert report.errors == [f"{remote.url}/pics-000.tar: member 'bad.jpg': not an image "
                             "(cannot identify image file)"]
    assert report.summary().endswith(f"-> {remote.url}/_index.parquet")

    oracle_dir = shutil.copytree(local, tmp_path / "pics")  # the same files, read from disk
    index_paths([oracle_dir], tokenizer=tokenizer, workers=1, progress=False)
    assert read_index(remote).equals(read_index(oracle_dir))
    meta = read_index_metadata(remote)
    assert without_fingerprints(meta) == without_fingerprints(read_index_metadata(oracle_dir))
    for shard, entry in meta["shards"].items():  # the listing's ETag is the object's
        assert {k: entry[k] for k in ("size", "etag")} == remote.join(shard).fingerprint()


def test_remote_reindex_follows_etags(s3, files, tmp_path):
    remote = upload(s3, files / "pics", "b/pics")
    tokenizer = files / "tokenizer.json"
    first, = index_paths([remote], tokenizer=tokenizer, workers=1, progress=False)
    assert (first.shards_indexed, first.shards_unchanged) == (2, 0)
    before = read_index(remote)
    s3.control(reset_stats=True)
    again, = index_paths([remote], tokenizer=tokenizer, workers=1, progress=False)
    assert (again.shards_indexed, again.shards_unchanged, again.corrupt) == (0, 2, 1)
    assert s3.stats()["by_method"].get("PUT", 0) == 1  # the index; no shard was read
    fs, path = remote.fs()
    fs.pipe_file(f"{path}/sub/pics-001.tar", write_tar(
        tmp_path / "changed.tar", caption_members("n", "a new sample")).read_bytes())
    fs.rm_file(f"{path}/pics-000.tar")
    changed, = index_paths([remote], tokenizer=tokenizer, workers=1, progress=False)
    assert (changed.shards_total, changed.shards_indexed, changed.shards_unchanged) == (1, 1, 0)
    table = read_index(remote)
    assert table.column("key").to_pylist() == ["n"] and before.num_rows == 8


def test_remote_text_sources_match_local(s3, files, tmp_path):
    tokenizer = files / "tokenizer.json"
    for name in ("lines", "table"):
        remote = upload(s3, files / name, f"c/{name}")
        local = shutil.copytree(files / name, tmp_path / name)
        index_paths([remote, local], tokenizer=tokenizer, workers=1, progress=False)
        assert read_index(remote).equals(read_index(local)), name


def test_index_dir_keeps_a_read_only_source_untouched(s3, files, tmp_path):
    remote = upload(s3, files / "lines", "d/lines")
    bucket = remote.url.split("/")[2]
    tokenizer = files / "tokenizer.json"
    shards = objects(remote)
    report, = index_paths([remote], tokenizer=tokenizer, workers=1, progress=False,
                          index_dir=tmp_path / "idx")
    assert report.summary().endswith(f"-> {tmp_path}/idx/lines/_index.parquet")
    oracle = shutil.copytree(files / "lines", tmp_path / "oracle" / "lines")
    index_paths([oracle], tokenizer=tokenizer, workers=1, progress=False)
    assert read_index(tmp_path / "idx" / "lines").equals(read_index(oracle))
    index_paths([remote], tokenizer=tokenizer, workers=1, progress=False,
                index_dir=f"s3://{bucket}/indexes", storage_options=s3.storage_options)
    assert objects(remote) == shards  # nothing written beside the shards
    at = Location.of(f"s3://{bucket}/indexes/lines", s3.storage_options)
    assert objects(at) == [f"{bucket}/indexes/lines/_index.parquet"]
    assert read_index(at).equals(read_index(oracle))


def write_spec(path: Path, s3: S3Server, url: str, index_dir: str | None) -> Path:
    lines = f"index_dir: {index_dir}\n" if index_dir else ""
    path.write_text(lines + textwrap.dedent(f"""\
        tokenizer: {path.parent / "tokenizer.json"}
        sources:
          - name: lines
            path: {url}
            format: jsonl
            template: text
            storage_options: {json.dumps(s3.storage_options)}
        schedule:
          unit: steps
          segments:
            - {{kind: const, start: 0, end: null, weights: {{lines: 1}}}}
        """))
    return path


def test_spec_with_remote_source_and_index_dir(s3, files, tmp_path):
    url = upload(s3, files / "lines", "e/lines").url
    write_tokenizer(tmp_path / "tokenizer.json")
    spec = write_spec(tmp_path / "mix.yaml", s3, url, "idx")
    report, = index_paths([spec], workers=1, progress=False)
    assert read_index(tmp_path / "idx" / "lines").num_rows == 3 and report.source == "lines"
    same, = index_paths([spec], workers=1, progress=False, index_dir=tmp_path / "idx")
    assert (same.shards_indexed, same.shards_unchanged) == (0, 1)
    with pytest.raises(UserError) as refused:
        index_paths([spec], workers=1, progress=False, index_dir=tmp_path / "elsewhere")
    assert str(refused.value) == (
        f"{spec}: --index-dir {tmp_path / 'elsewhere'}, but the spec names index_dir: "
        f"{tmp_path / 'idx'}; put `index_dir: {tmp_path / 'elsewhere'}` in the spec (the data "
        "plane reads the indexes where it says)")
    bare = write_spec(tmp_path / "bare.yaml", s3, url, None)
    with pytest.raises(UserError, match=r"the spec has no index_dir; put `index_dir: "):
        index_paths([bare], workers=1, progress=False, index_dir=tmp_path / "idx")


def test_remote_mistakes_are_one_line_without_credentials(s3, files):
    tokenizer = files / "tokenizer.json"
    remote = upload(s3, files / "lines", "g/lines")
    bucket = remote.url.split("/")[2]
    with pytest.raises(UserError) as missing:
        index_paths([Location.of(f"s3://{bucket}/nowhere", s3.storage_options)],
                    tokenizer=tokenizer, progress=False)
    assert str(missing.value) == f"s3://{bucket}/nowhere: no such file or directory"
    with pytest.raises(UserError) as no_tokenizer:
        index_paths([remote], progress=False)
    assert str(no_tokenizer.value).startswith(f"{remote.url}: pass --tokenizer")
    secret = Location.of(f"s3://user:hunter2@{bucket}/g/lines", s3.storage_options)
    with pytest.raises(UserError) as e:
        index_paths([secret], tokenizer=tokenizer, progress=False)
    assert str(e.value).startswith(f"{remote.url}: cannot read the source (")
    assert "hunter2" not in str(e.value) and "\n" not in str(e.value)


def test_cli_indexes_a_url_into_an_index_dir(s3, files, tmp_path, capsys):
    url = upload(s3, files / "lines", "f/lines").url
    code = main(["data", "index", url, "--tokenizer", str(files / "tokenizer.json"),
                 "--workers", "1", "--storage-options", json.dumps(s3.storage_options),
                 "--index-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 3, err  # the line that is not JSON
    assert err.splitlines()[0] == (f"{url}/a.jsonl: line 2: not JSON (Expecting property name "
                                   "enclosed in double quotes: line 1 column 2 (char 1))")
    assert out.strip().endswith(f"-> {tmp_path}/lines/_index.parquet")
    oracle = shutil.copytree(files / "lines", tmp_path / "oracle")
    index_paths([oracle], tokenizer=files / "tokenizer.json", workers=1, progress=False)
    assert read_index(tmp_path / "lines").equals(read_index(oracle))
    code = main(["data", "index", url, "--storage-options", '{"secret": "x"}'])
    assert code == 2 and capsys.readouterr().err == (
        "omniscale: error: --storage-options.secret: credentials do not belong in a spec (it is "
        "copied into snapshots and run directories); set them in the environment "
        "(AWS_ACCESS_KEY_ID, …) or a profile (`profile: NAME`)\n")
