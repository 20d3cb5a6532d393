"""``omniscale data inspect``: numbers from hand-built indexes, the schedule table and the plot."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from rich.console import Console

from omniscale.errors import UserError
from omniscale.index_schema import INDEX_SCHEMA, index_path
from omniscale.tools.mix_report import inspect_spec

REPO = Path(__file__).resolve().parents[2]


def write_index(source_dir: Path, llm_tokens: list[int], errors: list[str | None] | None = None,
                images: list[int] | None = None) -> None:
    """An index following INDEX_SCHEMA: one row per sample, text-only unless ``images``."""
    n = len(llm_tokens)
    errors = errors or [None] * n
    images = images or [0] * n
    source_dir.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "shard": ["shard-000.tar"] * n,
        "key": [f"{i:06d}" for i in range(n)],
        "offset": [512 * i for i in range(n)],
        "size": [512] * n,
        "members": [[] for _ in range(n)],
        "text_tokens": [t - 64 * k for t, k in zip(llm_tokens, images)],
        "image_patches": [[256] * k for k in images],
        "video_patches": [[] for _ in range(n)],
        "audio_frames": [[] for _ in range(n)],
        "llm_tokens": llm_tokens,
        "text_ids": [None] * n,
        "error": errors,
        "target_tokens": [t - 64 * k - 1 for t, k in zip(llm_tokens, images)],
        "text_targets": [None] * n,
    }, schema=INDEX_SCHEMA)
    pq.write_table(table, index_path(source_dir))


@pytest.fixture
def spec_path(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    # short: 1..100 tokens, plus two corrupt rows that must not count
    write_index(tmp_path / "data" / "short", list(range(1, 101)) + [99999, 5],
                errors=[None] * 100 + ["truncated tar member", "bad header"])
    # long: 10 samples of 1000 tokens, each with one image
    write_index(tmp_path / "data" / "long", [1000] * 10, images=[1] * 10)
    spec = {
        "tokenizer": "tokenizer.json",
        "accounting": "samples",
        "sources": [
            {"name": "short", "path": "data/short", "format": "webdataset", "template": "text"},
            {"name": "long", "path": "data/long", "format": "webdataset",
             "template": "image_caption"},
        ],
        "schedule": {"unit": "steps", "segments": [
            {"kind": "const", "start": 0, "end": 100, "weights": {"short": 1}},
            {"kind": "linear", "start": 100, "end": 300, "from": {"short": 1},
             "to": {"short": 1, "long": 1}},
        ]},
    }
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def test_source_numbers_exclude_corrupt_rows(spec_path):
    out = inspect_spec(spec_path, console=quiet())
    short, long = out["sources"]["short"], out["sources"]["long"]
    assert (short["samples"], short["corrupt"]) == (100, 2)
    assert short["llm_tokens"] == 5050 and short["text_tokens"] == 5050
    assert (short["p50"], short["p90"], short["p99"], short["max"]) == (50, 90, 99, 100)
    assert short["mean_llm_tokens"] == 50.5
    assert (short["format"], short["template"]) == ("webdataset", "text")
    assert (long["samples"], long["corrupt"], long["images"], long["videos"]) == (10, 0, 10, 0)
    assert long["llm_tokens"] == 10000 and long["text_tokens"] == 10000 - 640
    assert (long["p50"], long["max"]) == (1000, 1000)


def test_weights_and_implied_token_share_at_default_points(spec_path):
    out = inspect_spec(spec_path, console=quiet())
    # segment starts and midpoints, then the end (after which the final weights hold)
    assert out["points"] == [0, 50, 100, 200, 300]
    assert out["weights"][0] == {"short": 1.0, "long": 0.0}
    assert out["weights"][3] == {"short": 0.75, "long": 0.25}
    assert out["weights"][4] == {"short": 0.5, "long": 0.5}
    # half the samples are long ones at 1000 tokens vs 50.5: most tokens are long
    assert out["token_share"][4]["long"] == pytest.approx(1000 / 1050.5)
    assert out["sample_share"][4] == out["weights"][4]


def test_steps_given_and_printed(spec_path):
    console = quiet()
    out = inspect_spec(spec_path, steps=[150, 10_000], console=console)
    assert out["points"] == [150, 10_000]
    assert out["weights"][0]["long"] == pytest.approx(0.125)
    assert out["weights"][1] == {"short": 0.5, "long": 0.5}
    text = console.file.getvalue()
    assert "short" in text and "image_caption" in text and "10,000" in text
    assert "0.125 -> " in text


def test_token_accounting_implies_sample_share(spec_path):
    spec = yaml.safe_load(spec_path.read_text())
    spec["accounting"] = "tokens"
    spec_path.write_text(yaml.safe_dump(spec))
    out = inspect_spec(spec_path, steps=[300], console=quiet())
    assert out["token_share"][0] == {"short": 0.5, "long": 0.5}
    # equal tokens from 50.5-token and 1000-token samples: mostly short samples
    assert out["sample_share"][0]["short"] == pytest.approx(1000 / 1050.5)


def test_plot_writes_a_png(spec_path, tmp_path):
    plot = tmp_path / "plots" / "nested" / "mix.png"
    console = quiet()
    out = inspect_spec(spec_path, plot=plot, console=console)
    assert out["plot"] == str(plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    assert str(plot) in console.file.getvalue()


def test_missing_index_is_a_user_error(spec_path):
    index_path(spec_path.parent / "data" / "long").unlink()
    with pytest.raises(UserError, match="no index"):
        inspect_spec(spec_path, console=quiet())


def test_cli_inspect(spec_path, tmp_path):
    plot = tmp_path / "out.png"
    cmd = [sys.executable, "-m", "omniscale", "data", "inspect", str(spec_path),
           "--steps", "0,250", "--plot", str(plot)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "250" in proc.stdout and plot.is_file()
    index_path(spec_path.parent / "data" / "short").unlink()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "no index" in proc.stderr
