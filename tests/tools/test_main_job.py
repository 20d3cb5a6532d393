"""The README's main command, `make demo`, run as a user runs it (into a temporary folder):
demo data, index, mixture report, then a 2-process training run of the omni MoE with the
embedded plane, held-out evaluation and the run report. Shortened to a few steps with
TRAIN_SET (the full run is the README's measured one)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.mark.skipif(shutil.which("make") is None or not (ROOT / ".venv/bin/omniscale").exists(),
                    reason="needs make and the project's .venv (made by tools/setup.sh)")
def test_make_demo(tmp_path):
    demo, run_dir = tmp_path / "demo", tmp_path / "run"
    short = f"--set steps={STEPS} --set checkpoint_every={STEPS} --set eval.max_samples=4"
    # the cost file timed with one run per measurement and a few held-out mixes: the same
    # command, shortened like the training run
    run = subprocess.run(["make", "-C", str(ROOT), "demo", f"DEMO={demo}", f"RUN={run_dir}",
                          f"TRAIN_SET={short}", "CALIBRATE=--repeats 1 --held-out 4"],
                         capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Traceback" not in out
    # torch's notices a user cannot act on stay out of the main job's output (the layout
    # calibration's ranks once printed DeviceMesh's, one per rank)
    assert "UserWarning" not in out, [line for line in out.splitlines() if "Warning" in line]
    for source in ("text", "docs", "image_caption", "video_caption", "audio_caption",
                   "interleaved"):
        assert f"{source}: " in run.stdout  # the index line
        assert (demo / "train" / source / "_index.parquet").is_file()
    assert "0 corrupt" in run.stdout and "schedule" in run.stdout
    png = demo / "mix.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000

    # the balancer's cost model, timed here, is what the run plans with
    costs = json.loads((demo / "costs.json").read_text())
    assert costs["unit"] == "seconds" and costs["nproc"] == 2 and costs["llm"]["alpha"] > 0
    config = (run_dir / "config.yaml").read_text()
    assert f"costs: {demo / 'costs.json'}" in config, config

    # the training run: one progress line per step, a checkpoint, the evaluation, the report
    assert f"step {STEPS}/{STEPS}" in run.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "held-out caption accuracy" in run.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert set(result["eval"]) == {"image_caption", "video_caption", "audio_caption"}
    assert (run_dir / "report" / "index.html").is_file()
    assert "wrote " in run.stdout and "index.html" in run.stdout
