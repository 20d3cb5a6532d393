"""Cost features from headers equal what a full decode measures, for every modality."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from index_fixtures import (audio_bytes, caption_members, image_bytes, video_bytes,
                            write_jsonl, write_tar, write_tokenizer)

from loaders.geometry import (MediaGeometry, audio_tokens, image_grid, video_frame_indices,
                              video_grid, vision_tokens)
from loaders.index import index_source
from loaders.index_schema import read_index
from loaders.layout import MARKER_OF, media_order, member_kind

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


def full_decode_features(kind: str, data: bytes, g: MediaGeometry) -> tuple[int, int]:
    """(feature, LLM tokens) of one media item measured by decoding all of it."""
    if kind == "image":
        from PIL import Image

        image = Image.open(io.BytesIO(data))
        image.load()
        grid = image_grid(image.height, image.width, g)
        return int(np.prod(grid)), vision_tokens(grid, g)
    if kind == "video":
        import decord

        reader = decord.VideoReader(io.BytesIO(data))
        n, fps = len(reader), reader.get_avg_fps()
        height, width = reader[0].shape[:2]
        grid = video_grid(n, fps, height, width, g)
        frames = reader.get_batch(video_frame_indices(n, fps, g)).shape[0]
        assert frames == grid[0] * g.temporal_patch_size
        return int(np.prod(grid)), vision_tokens(grid, g)
    import soundfile
    import torch
    import torchaudio

    wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    wave = torch.from_numpy(wave.T.copy()).mean(0)
    wave = torchaudio.functional.resample(wave, rate, g.audio_sample_rate)
    wave = wave[:int(g.audio_max_seconds * g.audio_sample_rate)]
    mel = torchaudio.transforms.MelSpectrogram(sample_rate=g.audio_sample_rate, n_fft=400,
                                               hop_length=160, n_mels=g.n_mels)(wave)
    return mel.shape[-1], audio_tokens(mel.shape[-1])


def text_tokens_of(tokenizer_path, text: str) -> int:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    markers = {tokenizer.token_to_id(m) for m in MARKER_OF.values()}
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return len(ids) - sum(i in markers for i in ids) + 1


def test_features_equal_full_decode(omni):
    source, tokenizer, report = omni
    assert (report.corrupt, report.errors, report.samples) == (0, [], 11)
    rows = read_index(source).to_pylist()
    seen_kinds = set()
    for row in rows:
        data = (source / row["shard"]).read_bytes()
        expected = {"image": [], "video": [], "audio": []}
        llm_media, text = 0, ""
        for member in sorted(row["members"], key=lambda m: media_order(m["name"].split(".", 1)[1])):
            kind = member_kind(member["name"].split(".", 1)[1])
            payload = data[member["offset"]:member["offset"] + member["size"]]
            if kind == "text":
                text = payload.decode()
            elif kind in expected:
                feature, tokens = full_decode_features(kind, payload, GEOMETRY)
                expected[kind].append(feature)
                llm_media += tokens
                seen_kinds.add(kind)
        assert row["error"] is None
        assert row["image_patches"] == expected["image"], row["key"]
        assert row["video_patches"] == expected["video"], row["key"]
        assert row["audio_frames"] == expected["audio"], row["key"]
        assert row["text_tokens"] == text_tokens_of(tokenizer, text), row["key"]
        assert row["llm_tokens"] == row["text_tokens"] + llm_media, row["key"]
    assert seen_kinds == {"image", "video", "audio"}
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
