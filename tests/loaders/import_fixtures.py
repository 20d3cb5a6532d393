"""Tiny real media and helpers for the conversation importer tests."""

from __future__ import annotations

import io
import json
import tarfile
import wave
from pathlib import Path

from omniscale.layout import member_kind
from omniscale.loaders.conversation import load_sample
from omniscale.loaders.tar_scan import scan_tar


def png(color: str = "red") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 4), color).save(out, format="PNG")
    return out.getvalue()


def jpg(color: str = "blue") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, format="JPEG")
    return out.getvalue()


def wav(frames: int = 160) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x10\x00" * frames)
    return out.getvalue()


def demo_mp4(demo_root: Path) -> bytes:
    """The first clip of the demo's video source: a real H.264 mp4."""
    shard = demo_root / "train" / "video_caption" / "video_caption-000000.tar"
    with tarfile.open(shard) as tar:
        name = next(n for n in tar.getnames() if n.endswith(".mp4"))
        return tar.extractfile(name).read()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def write_jsonl(path: Path, records: list, raw_lines: dict[int, bytes] | None = None) -> Path:
    """One record per line; ``raw_lines`` puts bytes in place of the record at that index."""
    lines = [raw_lines.get(i) if raw_lines and i in raw_lines
             else json.dumps(r).encode() for i, r in enumerate(records)]
    return write(path, b"\n".join(lines) + b"\n")


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def read_source(out: Path) -> dict[str, dict]:
    """key -> {"json": parsed KEY.json, "members": {suffix: bytes}} of every shard in ``out``,
    read with the project's tar scanner; each KEY.json checked against its members."""
    samples = {}
    for shard in sorted(out.glob("*.tar")):
        data = shard.read_bytes()
        scan = scan_tar(shard)
        assert not scan.problems and all(s.error is None for s in scan.samples)
        for sample in scan.samples:
            members = {m.suffix: data[m.offset:m.offset + m.size] for m in sample.members}
            counts: dict[str, int] = {}
            for suffix in members:
                kind = member_kind(suffix)
                if kind in ("image", "video", "audio"):
                    counts[kind] = counts.get(kind, 0) + 1
            meta = load_sample(members.pop("json"), counts)
            assert sample.key not in samples
            samples[sample.key] = {"json": meta, "members": members}
    return samples


def tree(out: Path) -> dict[str, bytes]:
    """Every file under ``out`` by relative name: two imports compared byte for byte."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


def skipped(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "_skipped.jsonl").read_text().splitlines()]
