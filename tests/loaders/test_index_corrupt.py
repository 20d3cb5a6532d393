"""Corrupt members are marked in the index and reported in one line each; indexing goes on."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniscale.errors import UserError
from omniscale.geometry import MediaGeometry
from omniscale.index_schema import read_index
from omniscale.loaders.index import index_paths, index_source
from tests.loaders.index_fixtures import (
    audio_bytes,
    caption_members,
    empty_video_bytes,
    image_bytes,
    video_bytes,
    write_jsonl,
    write_tar,
    write_tokenizer,
)


def build_corrupt_source(root):
    """A source with one corrupt sample of every kind, and good samples around them."""
    write_tokenizer(root / "tokenizer.json")
    source = root / "train" / "mix"
    good = (caption_members("ok_img", "a cat", jpg=image_bytes(80, 60))
            + caption_members("ok_vid", "a clip", mp4=video_bytes(6, 3, 64, 48)))
    write_tar(source / "mix-000.tar", good
              + caption_members("bad_img", "a cat", jpg=b"this is not a jpeg")
              + caption_members("bad_wav", "silence", wav=audio_bytes(0, 16000))
              + caption_members("ok_wav", "speech", wav=audio_bytes(0.5, 16000)))
    write_tar(source / "mix-001.tar",
              caption_members("bad_vid", "a clip", mp4=empty_video_bytes())
              + caption_members("junk_vid", "a clip", mp4=b"\x00garbage" * 50)
              + [("bad_txt.txt", b"caf\xe9 au lait")]
              + caption_members("bad_markers", "<image> <image> <image>",
                                **{"0_jpg": image_bytes(32, 32), "1_jpg": image_bytes(32, 32)})
              + caption_members("ok_txt", "fine"))
    truncated = write_tar(source / "mix-002.tar", good)
    data = truncated.read_bytes()
    truncated.write_bytes(data[:len(data) - 3000])  # inside ok_vid.mp4's data
    return source


EXPECTED = [
    "mix-000.tar: member 'bad_img.jpg': not an image (cannot identify image file)",
    "mix-000.tar: member 'bad_wav.wav': audio has no samples",
    "mix-001.tar: member 'bad_vid.mp4': video has no frames (no video stream)",
    "mix-001.tar: member 'junk_vid.mp4': not a video (Invalid data found when processing input)",
    "mix-001.tar: member 'bad_txt.txt': not UTF-8 (byte 0xe9 at byte 3)",
    "mix-001.tar: member 'bad_markers.txt': text has 3 <image> marker(s) but the sample has 2 "
    "image member(s)",
]


def test_corrupt_members_reported_and_skipped(tmp_path, monkeypatch):
    source = build_corrupt_source(tmp_path)
    monkeypatch.chdir(tmp_path)
    report, = index_paths([source.relative_to(tmp_path)], workers=1, progress=False)
    assert report.errors[:6] == [f"train/mix/{line}" for line in EXPECTED]
    truncated = report.errors[6]
    assert truncated.startswith("train/mix/mix-002.tar: truncated tar: member 'ok_vid.mp4' "
                                "at byte ")
    assert all("\n" not in line for line in report.errors)
    assert report.corrupt == 7 and report.samples == 12
    rows = read_index(source).to_pylist()
    status = {(r["shard"], r["key"]): r["error"] is None for r in rows}
    assert [k for (_, k), ok in status.items() if ok] == [
        "ok_img", "ok_vid", "ok_wav", "ok_txt", "ok_img"]
    for row in rows:
        if row["error"] is not None:
            assert row["llm_tokens"] is None and row["text_tokens"] is None
            assert row["image_patches"] == row["video_patches"] == row["audio_frames"] == []
        else:
            assert row["llm_tokens"] > row["text_tokens"] >= 1 or row["key"] == "ok_txt"


def test_bad_inputs_are_user_errors(tmp_path):
    write_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(UserError, match="no such file or directory"):
        index_paths([tmp_path / "missing"], progress=False)
    mixed = tmp_path / "mixed"
    write_jsonl(mixed / "a.jsonl", [{"text": "x"}])
    write_tar(mixed / "b.tar", caption_members("k", "x"))
    with pytest.raises(UserError, match="several formats"):
        index_paths([mixed], progress=False)
    no_text = tmp_path / "notext"
    no_text.mkdir()
    pq.write_table(pa.table({"body": ["x"]}), no_text / "a.parquet")
    with pytest.raises(UserError, match=r"notext/a.parquet: no 'text' column"):
        index_paths([no_text], workers=1, progress=False)
    orphan = tmp_path.parent / f"{tmp_path.name}-orphan"
    write_jsonl(orphan / "a.jsonl", [{"text": "x"}])
    if not any((d / "tokenizer.json").is_file() for d in orphan.resolve().parents):
        with pytest.raises(UserError, match="no tokenizer.json"):
            index_paths([orphan], progress=False)


def test_bad_jsonl_and_parquet_rows(tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tokenizer.json")
    source = write_jsonl(tmp_path / "chat" / "c.jsonl",
                         [{"text": "ok"}, b"{not json", {"body": "x"}, b"\xff\xfe",
                          {"text": "<audio> speech"}]).parent
    report = index_source(source, "jsonl", tokenizer, MediaGeometry(), workers=1,
                          progress=False)
    assert report.samples == 5 and report.corrupt == 4
    assert [e.split(": ", 1)[1].split(" (")[0] for e in report.errors] == [
        "line 2: not JSON", "line 3: not an object with a string 'text' field",
        "line 4: not UTF-8", "line 5: text has 1 <audio> marker(s) but the sample has 0 audio "
        "member(s)"]
    docs = tmp_path / "docs"
    docs.mkdir()
    pq.write_table(pa.table({"text": ["a", None, "b"]}), docs / "d.parquet")
    report = index_source(docs, "parquet", tokenizer, MediaGeometry(), workers=1,
                          progress=False)
    assert report.corrupt == 1 and report.errors[0].endswith("d.parquet: row 1: text is null")
