"""The README's main command, `make demo`, run as a user runs it (into a temporary folder)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None or not (ROOT / ".venv/bin/omniscale").exists(),
                    reason="needs make and the project's .venv (made by tools/setup.sh)")
def test_make_demo(tmp_path):
    demo = tmp_path / "demo"
    run = subprocess.run(["make", "-C", str(ROOT), "demo", f"DEMO={demo}"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stdout + run.stderr
    for source in ("text", "docs", "image_caption", "video_caption", "audio_caption",
                   "interleaved"):
        assert f"{source}: " in run.stdout  # the index line
        assert (demo / "train" / source / "_index.parquet").is_file()
    assert "0 corrupt" in run.stdout and "schedule" in run.stdout
    png = demo / "mix.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
