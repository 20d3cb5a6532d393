"""``omniscale data index`` from the command line: one line per problem, exit codes, no
tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.loaders.index_fixtures import caption_members, image_bytes, write_tar, write_tokenizer

REPO = Path(__file__).resolve().parents[2]


def omniscale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omniscale", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_reports_corrupt_members_and_exit_codes(tmp_path):
    write_tokenizer(tmp_path / "tokenizer.json")
    source = tmp_path / "images"
    write_tar(source / "images-000.tar",
              caption_members("good", "a cat", jpg=image_bytes(64, 64))
              + caption_members("bad", "a cat", jpg=b"not an image")
              + caption_members("worse", "a dog", png=b"\x89PNG garbage"))
    done = omniscale("data", "index", str(source), "--workers", "1")
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    shard = f"{source}/images-000.tar"
    assert lines == [
        f"{shard}: member 'bad.jpg': not an image (cannot identify image file)",
        f"{shard}: member 'worse.png': not an image (cannot identify image file)",
        "omniscale: 2 corrupt member(s) marked in the index and skipped (--allow-corrupt "
        "exits 0)"]
    assert "Traceback" not in done.stdout + done.stderr
    assert (source / "_index.parquet").is_file()

    allowed = omniscale("data", "index", str(source), "--allow-corrupt")
    assert allowed.returncode == 0
    assert len(allowed.stderr.strip().splitlines()) == 2
    assert "0 indexed, 1 unchanged" in allowed.stdout


def test_cli_missing_path_is_one_line(tmp_path):
    done = omniscale("data", "index", str(tmp_path / "nope"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"omniscale: error: {tmp_path / 'nope'}: no such file or directory"]
    assert "Traceback" not in done.stdout + done.stderr
