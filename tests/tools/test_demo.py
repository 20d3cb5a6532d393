"""The demo-data generator: real WebDataset shards and Parquet, captions that match their
labels, media within their documented bounds, a working tokenizer and specs, determinism."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import decord
import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import webdataset as wds
import yaml
from PIL import Image
from tokenizers import Tokenizer

from omniscale.errors import UserError
from omniscale.geometry import MediaGeometry
from omniscale.layout import (
    DEFAULT_SPECIAL_TOKENS,
    SPECIAL_TOKENS,
    count_markers,
    media_order,
    split_member_name,
)
from omniscale.loaders.conversation import load_sample
from omniscale.tools.demo import Plan, audio, build, generate, scenes, text
from omniscale.tools.demo.dataset import _ranges

IMAGE = DEFAULT_SPECIAL_TOKENS.image
SPLITS = {"train": ("text", "image_caption", "video_caption", "audio_caption", "interleaved",
                    "chat"),
          "eval": ("text", "image_caption", "video_caption", "audio_caption", "chat")}
TASK_ONLY = ("chat",)  # in the fine-tuning demo's specs, not the main mixture's
TEST_PLAN = Plan({(split, source): 3 for split, sources in SPLITS.items() for source in sources},
                 {"train": 2, "eval": 2})


def tree_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def read_samples(tar_path: Path) -> dict[str, dict[str, bytes]]:
    """key -> {suffix: bytes}, checking that each key's members are contiguous."""
    samples: dict[str, dict[str, bytes]] = {}
    last = None
    with tarfile.open(tar_path) as tar:
        for member in tar:
            key, suffix = split_member_name(member.name)
            if key != last:
                assert key not in samples, f"{tar_path.name}: members of {key} not contiguous"
                last = key
            samples.setdefault(key, {})[suffix] = tar.extractfile(member).read()
    return samples


def source_samples(root: Path, split: str, source: str) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for shard in sorted((root / split / source).glob("*.tar")):
        out.update(read_samples(shard))
    return out


def centroid(frame: np.ndarray, background: np.ndarray) -> np.ndarray:
    """(x, y) centre of the pixels that differ clearly from the background."""
    ys, xs = np.nonzero(np.abs(frame.astype(int) - background).sum(-1) > 90)
    return np.array([xs.mean(), ys.mean()])


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("demo")
    return root, build(root, TEST_PLAN, seed=7, workers=1)


def test_layout_and_summary(demo):
    root, summary = demo
    assert json.loads((root / "demo.json").read_text()) == summary
    for split, sources in SPLITS.items():
        for source in sources:
            entry = summary["sources"][split][source]
            assert entry["shards"] >= 2 and len(entry["files"]) == entry["shards"]
            assert len(source_samples(root, split, source)) == entry["samples"]
    assert summary["sources"]["train"]["docs"]["format"] == "parquet"
    assert "docs" not in summary["sources"]["eval"]
    for name in ("tokenizer.json", "mix.yaml", "eval.yaml"):
        assert (root / name).is_file()


def test_shards_are_webdataset(demo):
    root, summary = demo
    for split, sources in SPLITS.items():
        for source in sources:
            shards = sorted(str(p) for p in (root / split / source).glob("*.tar"))
            rows = list(wds.WebDataset(shards, shardshuffle=False, empty_check=False))
            assert len(rows) == summary["sources"][split][source]["samples"]
            for row in rows:
                assert "." not in row["__key__"] and ("json" if source == "chat" else "txt") in row


def test_image_captions_match_labels_and_sizes(demo):
    root, _ = demo
    for split in SPLITS:
        for key, members in source_samples(root, split, "image_caption").items():
            labels = json.loads(members["json"])
            assert members["txt"].decode() == scenes.image_caption(labels)
            assert 1 <= len(labels["shapes"]) <= 3
            ext = labels["format"]
            img = Image.open(io.BytesIO(members[ext]))
            assert img.format == {"jpg": "JPEG", "png": "PNG"}[ext]
            assert img.size == (labels["width"], labels["height"])
            assert all(64 <= side <= 1024 for side in img.size)
            assert max(img.size) / min(img.size) <= 3.2


def test_video_frames_and_captions(demo):
    root, _ = demo
    for split in SPLITS:
        for key, members in source_samples(root, split, "video_caption").items():
            labels = json.loads(members["json"])
            assert members["txt"].decode() == scenes.video_caption(labels)
            reader = decord.VideoReader(io.BytesIO(members["mp4"]))
            assert len(reader) == labels["frames"] and 4 <= len(reader) <= 64
            h, w = labels["height"], labels["width"]
            assert reader[0].shape == (h, w, 3) and w % 2 == h % 2 == 0
            # The shape's centroid moves the way the caption says.
            background = np.array(scenes.BACKGROUNDS[labels["background"]])
            first, last = (centroid(reader[i].asnumpy(), background) for i in (0, len(reader) - 1))
            dx, dy = scenes.DIRECTIONS[labels["direction"]]
            assert np.sign(np.round(last - first)).tolist() == [dx, dy]


def test_audio_durations_and_captions(demo):
    root, _ = demo
    for split in SPLITS:
        for key, members in source_samples(root, split, "audio_caption").items():
            labels = json.loads(members["json"])
            assert members["txt"].decode() == audio.caption(labels)
            info = sf.info(io.BytesIO(members[labels["format"]]))
            assert info.samplerate == labels["sample_rate"] in audio.SAMPLE_RATES
            assert 1.0 <= info.duration <= 30.0
            assert abs(info.duration - labels["seconds"]) < 1e-3


def test_interleaved_markers_match_images(demo):
    root, _ = demo
    for key, members in source_samples(root, "train", "interleaved").items():
        images = sorted((s for s in members if s.split(".")[-1] in ("jpg", "png")),
                        key=media_order)
        assert [int(s.split(".")[0]) for s in images] == list(range(len(images)))
        doc = members["txt"].decode()
        assert count_markers(doc) == {"image": len(images), "video": 0, "audio": 0}
        labels = json.loads(members["json"])["images"]
        for j, scene in enumerate(labels):
            assert f"Figure {j + 1} shows {scenes.image_caption(scene)}" in doc
        assert 2 <= len(images) <= 4


def test_text_and_docs(demo):
    root, summary = demo
    paths = {split: {json.loads(m["json"])["path"]
                     for m in source_samples(root, split, "text").values()}
             for split in SPLITS}
    assert paths["train"] and paths["eval"] and not paths["train"] & paths["eval"]
    files = sorted((root / "train" / "docs").glob("*.parquet"))
    assert len(files) >= 2
    keys = []
    for f in files:
        meta = pq.ParquetFile(f)
        assert meta.num_row_groups >= 2
        assert meta.schema_arrow.names == ["key", "text"]
        assert all(str(t) == "string" for t in meta.schema_arrow.types)
        keys += meta.read().column("key").to_pylist()
    assert len(keys) == len(set(keys)) == len(text.topics())
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", k) for k in keys)


def test_split_parts_round_trip():
    sample = "".join(f"line {i} " + "x" * (i % 50) + "\n" for i in range(5000))
    parts = text.split_parts(sample, limit=4096)
    assert "".join(parts) == sample and len(parts) > 1
    assert all(len(p) <= 4096 and p.endswith("\n") for p in parts)


def test_tokenizer(demo):
    root, _ = demo
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.encode(IMAGE).ids == [tok.token_to_id(IMAGE)]
    assert tok.encode(f"look{IMAGE}here").ids.count(tok.token_to_id(IMAGE)) == 1
    caption = "a large red circle at the top left on a white background."
    assert tok.decode(tok.encode(caption).ids) == caption


def test_specs(demo):
    root, summary = demo
    mix = yaml.safe_load((root / "mix.yaml").read_text())
    MediaGeometry(**mix["media"])
    assert mix["tokenizer"] == "tokenizer.json" and (root / mix["tokenizer"]).is_file()
    assert [s["name"] for s in mix["sources"]] == [n for n in summary["sources"]["train"]
                                                    if n not in TASK_ONLY]
    assert all((root / s["path"]).is_dir() for s in mix["sources"])
    segments = mix["schedule"]["segments"]
    assert {s["kind"] for s in segments} == {"const", "linear", "cosine", "step"}
    assert segments[0]["start"] == 0 and segments[-1]["end"] is None
    assert all(a["end"] == b["start"] for a, b in zip(segments, segments[1:]))
    ev = yaml.safe_load((root / "eval.yaml").read_text())
    MediaGeometry(**ev["media"])
    assert "schedule" not in ev and all(s["weight"] > 0 for s in ev["sources"])
    assert {s["name"] for s in ev["sources"]} == set(SPLITS["eval"]) - set(TASK_ONLY)
    for name, split in (("sft.yaml", "train"), ("sft_eval.yaml", "eval")):
        sft = yaml.safe_load((root / name).read_text())
        assert [(s["name"], s["path"], s["template"]) for s in sft["sources"]] == \
            [("chat", f"{split}/chat", "conversation")]


def test_conversations_are_in_the_import_form_and_answer_from_the_labels(demo):
    root, _ = demo
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    assert all(tok.token_to_id(t) is not None for t in ("<|im_start|>", "<|im_end|>"))
    for split in SPLITS:
        for key, members in source_samples(root, split, "chat").items():
            body = json.loads(members["json"])
            labels, messages = body["labels"], body["messages"]
            media = {s.split(".")[1]: len(data) for s, data in members.items() if s != "json"}
            load_sample(members["json"], {labels["kind"]: len(media)})  # parts = members
            assert list(media) == [
                {"image": labels.get("format"), "video": "mp4",
                 "audio": labels.get("format")}[labels["kind"]]]
            roles = [m["role"] for m in messages]
            assert roles == ["user", "assistant"] * (len(roles) // 2) and 4 <= len(roles) <= 8
            first = messages[1]["content"][0]["text"]
            want = {"image": lambda: scenes.image_caption(labels),
                    "video": lambda: scenes.video_caption(labels),
                    "audio": lambda: audio.caption(labels)}[labels["kind"]]()
            assert first == want, key


def test_deterministic_whatever_the_workers(demo, tmp_path):
    root, _ = demo
    build(tmp_path, TEST_PLAN, seed=7, workers=2)
    assert tree_hashes(tmp_path) == tree_hashes(root)


def test_other_seed_differs(demo, tmp_path):
    root, _ = demo
    plan = Plan({("train", "image_caption"): 2}, {"train": 1})
    build(tmp_path, plan, seed=8, workers=1)
    ours = read_samples(tmp_path / "train/image_caption/image_caption-000000.tar")
    theirs = read_samples(root / "train/image_caption/image_caption-000000.tar")
    assert ours["train-000000"] != theirs["train-000000"]
    # A partial plan still gets a spec whose weights name only its own sources.
    mix = yaml.safe_load((tmp_path / "mix.yaml").read_text())
    names = {s["name"] for s in mix["sources"]}
    assert names == {"image_caption", "docs"} and not (tmp_path / "eval.yaml").exists()
    for segment in mix["schedule"]["segments"]:
        for k in ("weights", "from", "to"):
            assert set(segment.get(k, {})) <= names


def test_ranges_cover_evenly():
    for n in range(0, 70):
        for size in (1, 2, 16, 32):
            ranges = _ranges(n, size)
            assert sum(c for _, c in ranges) == n
            assert all(a + c == b for (a, c), (b, _) in zip(ranges, ranges[1:]))
            if n >= 2:
                assert len(ranges) >= 2 and max(c for _, c in ranges) <= max(size, -(-n // 2))


def test_generate_tiny_then_reuse(tmp_path, monkeypatch):
    import omniscale.tools.demo.dataset as demo_dataset

    out = tmp_path / "demo"
    summary = generate(out, scale="tiny", seed=0, workers=2, progress=False)
    for split in summary["sources"].values():
        assert all(e["shards"] >= 2 for e in split.values())
    lengths = [len(m["txt"]) for m in source_samples(out, "train", "text").values()]
    p10, p50, p90 = np.percentile(lengths, [10, 50, 90])
    assert p90 > 4 * p50 and p50 > 4 * p10  # long-tailed, as real files are
    # Reuse does no work: nothing is built, no file is rewritten (a counter and the files'
    # identities, not a duration).
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*")}
    builds = []
    monkeypatch.setattr(demo_dataset, "build", lambda *a, **k: builds.append(a))
    assert generate(out, scale="tiny", seed=0, progress=False) == summary
    assert builds == []
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no partial directories


def test_generate_errors(tmp_path):
    with pytest.raises(UserError, match="scale"):
        generate(tmp_path / "x", scale="huge", progress=False)
    with pytest.raises(UserError, match="seed"):
        generate(tmp_path / "x", seed=-1, progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        generate(tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_crash_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    import omniscale.tools.demo.dataset as demo_dataset

    def crash(dest, *args, **kwargs):
        (dest / "tokenizer.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo_dataset, "build", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        generate(tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []
