"""Cost features from headers equal what a full decode measures, for every modality."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniscale.geometry import MediaGeometry
from omniscale.index_schema import read_index
from omniscale.loaders.index import index_source
from tests.loaders.decode_oracle import assert_row_matches_full_decode, text_tokens_of
from tests.loaders.index_fixtures import (
    audio_bytes,
    caption_members,
    image_bytes,
    video_bytes,
    write_jsonl,
    write_tar,
    write_tokenizer,
)

# Small audio_max_seconds so that one clip is truncated.
GEOMETRY = MediaGeometry(audio_max_seconds=2.0)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni")
    tokenizer = write_tokenizer(root / "tokenizer.json")
    source = root / "train" / "omni"
    write_tar(source / "omni-000.tar",
              caption_members("img_a", "a photo of a cat", jpg=image_bytes(100, 60))
              + caption_members("img_b", "<image> left <image> right",
                                **{"0_jpg": image_bytes(50, 50),
                                   "1_png": image_bytes(300, 500, "PNG")})
              + caption_members("img_c", "big", webp=image_bytes(1000, 800, "WEBP"))
              + caption_members("vid_a", "a clip", mp4=video_bytes(12, 6, 96, 64))
              + caption_members("vid_b", "no frame count in matroska",
                                mkv=video_bytes(30, 10, 160, 90, "matroska")))
    write_tar(source / "omni-001.tar",
              caption_members("aud_a", "speech", wav=audio_bytes(1.3, 44100))
              + caption_members("aud_b", "the weather", flac=audio_bytes(0.7, 8000, "FLAC"))
              + caption_members("aud_c", "truncated to two seconds", wav=audio_bytes(2.5, 16000))
              + caption_members("inter", "<image> a dog <video> and <audio> sings",
                                jpg=image_bytes(64, 64), mp4=video_bytes(8, 4, 64, 48),
                                wav=audio_bytes(0.5, 22050))
              + [("text.txt", "the quick brown fox jumps over the lazy dog".encode()),
                 ("meta.txt", b"with metadata"), ("meta.json", b'{"label": 1}')])
    report = index_source(source, "webdataset", tokenizer, GEOMETRY, workers=1, progress=False)
    return source, tokenizer, report


def test_features_equal_full_decode(omni):
    source, tokenizer, report = omni
    assert (report.corrupt, report.errors, report.samples) == (0, [], 11)
    rows = read_index(source).to_pylist()
    seen_kinds = set()
    for row in rows:
        seen_kinds |= assert_row_matches_full_decode(source, row, tokenizer, GEOMETRY)
    assert seen_kinds == {"image", "video", "audio", "text", "meta"}
    by_key = {r["key"]: r for r in rows}
    assert by_key["aud_c"]["audio_frames"] == [2 * 16000 // 160 + 1]  # truncated to 2 s
    assert len(by_key["inter"]["image_patches"]) == len(by_key["inter"]["video_patches"]) == 1


def test_parquet_and_jsonl_text_sources(tmp_path, omni):
    _, tokenizer, _ = omni
    texts = ["the quick brown fox", "a photo of a cat", "", "speech about the weather"]
    parquet_dir = tmp_path / "docs"
    parquet_dir.mkdir()
    pq.write_table(pa.table({"text": texts}), parquet_dir / "docs-0.parquet", row_group_size=3)
    pq.write_table(pa.table({"text": texts[:2], "key": ["k0", None]}),
                   parquet_dir / "docs-1.parquet")
    report = index_source(parquet_dir, "parquet", tokenizer, GEOMETRY, workers=1, progress=False)
    assert (report.samples, report.corrupt) == (6, 0)
    rows = read_index(parquet_dir).to_pylist()
    assert [r["key"] for r in rows] == ["docs-0-0", "docs-0-1", "docs-0-2", "docs-0-3", "k0",
                                        "docs-1-1"]
    for row in rows:
        group = pq.ParquetFile(parquet_dir / row["shard"]).read_row_group(row["offset"])
        text = group.column("text")[row["size"]].as_py()
        assert row["text_tokens"] == row["llm_tokens"] == text_tokens_of(tokenizer, text)
        assert row["members"] == [] and row["image_patches"] == []

    jsonl_dir = tmp_path / "chat"
    shard = write_jsonl(jsonl_dir / "chat-0.jsonl",
                        [{"text": texts[0]}, b"", {"text": texts[1], "key": "x"}, b"  ",
                         {"text": texts[3]}])
    report = index_source(jsonl_dir, "jsonl", tokenizer, GEOMETRY, workers=1, progress=False)
    assert (report.samples, report.corrupt) == (3, 0)
    data = shard.read_bytes()
    rows = read_index(jsonl_dir).to_pylist()
    assert [r["key"] for r in rows] == ["chat-0-0", "x", "chat-0-4"]
    for row in rows:
        text = json.loads(data[row["offset"]:row["offset"] + row["size"]])["text"]
        assert row["text_tokens"] == text_tokens_of(tokenizer, text)
