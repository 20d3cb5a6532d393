"""``omniscale balance simulate``: table, JSON, plan output, inputs, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tools.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
SIM = [sys.executable, "-m", "tools.cli", "balance", "simulate"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SIM, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_table_plot_and_plan_out(tmp_path):
    plot, plan = tmp_path / "load.png", tmp_path / "plan.parquet"
    proc = run("--dist", "lognormal", "--dp", "8", "--steps", "4", "--samples-per-rank", "8",
               "--plot", str(plot), "--plan-out", str(plan))
    assert proc.returncode == 0, proc.stderr
    for name in ("omniscale", "strided", "first_fit", "token_lpt", "kk_cost", "imb mean",
                 "DDP/ideal", "violations", "faster than the best baseline"):
        assert name in proc.stdout
    assert plot.stat().st_size > 0
    table = pq.read_table(plan)
    assert table.column_names == ["sample", "step", "rank", "micro_batch", "sp_group_size"]
    sample, size = table["sample"].to_numpy(), table["sp_group_size"].to_numpy()
    assert set(sample.tolist()) == set(range(4 * 64))
    rows = np.bincount(sample)
    assert np.array_equal(rows[sample], size)  # a sample split over k ranks has k rows
    assert table["step"].to_numpy().max() == 3 and table["rank"].to_numpy().max() <= 7


def test_json_from_an_index_skips_corrupt_rows(tmp_path, capsys):
    index = tmp_path / "_index.parquet"
    n = 70
    errors = [None] * n
    errors[3] = "truncated"
    pq.write_table(pa.table({
        "llm_tokens": pa.array(np.arange(1, n + 1) * 100, pa.int32()),
        "image_patches": pa.array([[1024] if i % 2 else [] for i in range(n)],
                                  pa.list_(pa.int32())),
        "video_patches": pa.array([[4096, 2048] if i % 7 == 0 else [] for i in range(n)],
                                  pa.list_(pa.int32())),
        "audio_frames": pa.array([[] for _ in range(n)], pa.list_(pa.int32())),
        "error": pa.array(errors, pa.string()),
    }), index)
    plan = tmp_path / "plan.parquet"
    assert main(["balance", "simulate", "--lengths", str(index), "--dp", "4",
                 "--samples-per-rank", "4", "--window", "2", "--json",
                 "--plan-out", str(plan)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == 4 and result["samples"] == 64
    assert result["items"] == sum(1 for i in range(n) if i % 2 and i < 65 and i != 3) + 2 * sum(
        1 for i in range(n) if i % 7 == 0 and i < 65)
    assert set(result["policies"]) == {"omniscale", "strided", "first_fit", "token_lpt",
                                       "kk_cost"}
    assert all(p["exactly_once"] for p in result["policies"].values())
    samples = set(pq.read_table(plan)["sample"].to_pylist())
    assert 3 not in samples and samples == set(range(65)) - {3}


def test_jsonl_with_encoder_patches_and_token_batches(tmp_path, capsys):
    lengths = tmp_path / "lengths.jsonl"
    rng = np.random.default_rng(0)
    lengths.write_text("".join(
        json.dumps({"llm_tokens": int(t), "encoder_patches": [256] * int(k)}) + "\n"
        for t, k in zip(rng.integers(300, 5000, 200), rng.integers(0, 3, 200))))
    assert main(["balance", "simulate", "--lengths", str(lengths), "--dp", "2",
                 "--global-batch-tokens", "40000", "--steps", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == 3 and result["items"] > 0
    assert result["policies"]["strided"]["violations"] == 0


@pytest.mark.parametrize("args,message", [
    (["--lengths", "missing.parquet"], "no such file"),
    (["--dist", "lognormal", "--dp", "0"], "--dp: must be >= 1"),
    (["--dist", "lognormal", "--lengths", "x.parquet"], "exactly one of"),
    ([], "exactly one of"),
    (["--dist", "zipf"], "--dist zipf"),
    (["--dist", "lognormal", "--sp-max", "3"], "power of two"),
    (["--dist", "lognormal", "--samples-per-rank", "2", "--global-batch-tokens", "9"],
     "at most one"),
    (["--dist", "lognormal", "--micro-batch-tokens", "1000", "--sp-max", "1"], "raise"),
])
def test_bad_input_is_one_line(args, message, capsys):
    assert main(["balance", "simulate", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_bad_files_exit_2_without_traceback(tmp_path):
    no_column = tmp_path / "x.parquet"
    pq.write_table(pa.table({"tokens": [1, 2, 3]}), no_column)
    proc = run("--lengths", str(no_column))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "no llm_tokens column" in proc.stderr and "Traceback" not in proc.stderr
    negative = tmp_path / "neg.jsonl"
    negative.write_text('{"llm_tokens": 5}\n{"llm_tokens": -1}\n')
    proc = run("--lengths", str(negative), "--dp", "1", "--samples-per-rank", "1")
    assert proc.returncode == 2 and "row 1: llm_tokens must be > 0" in proc.stderr


def test_parser_defaults():
    args = build_parser().parse_args(["balance", "simulate", "--dist", "omni"])
    assert (args.dp, args.window, args.cost_linear, args.cost_quadratic, args.sp_max,
            args.epsilon) == (8, 4, 24576.0, 1.0, 8, 0.05)
