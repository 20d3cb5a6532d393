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

from omniscale.tools.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
SIM = [sys.executable, "-m", "omniscale", "balance", "simulate"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SIM, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_table_plot_and_plan_out(tmp_path):
    plot, plan = tmp_path / "load.png", tmp_path / "plan.parquet"
    proc = run("--dist", "lognormal", "--dp", "8", "--steps", "4", "--samples-per-rank", "8",
               "--plot", str(plot), "--plan-out", str(plan))
    assert proc.returncode == 0, proc.stderr
    for name in ("omniscale", "strided (no split)", "first_fit (no split)",
                 "token_lpt (no split)", "kk_cost (no split)", "strided+split", "first_fit+split",
                 "token_lpt+split", "kk_cost+split", "imb mean", "DDP/ideal", "violations",
                 "comm 25 GB/s per rank", "faster than the best baseline (",
                 "faster than the best no-split baseline ("):
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
                                       "kk_cost", "strided+split", "first_fit+split",
                                       "token_lpt+split", "kk_cost+split"}
    assert result["best_baseline"]["ddp"].endswith("+split")
    assert not result["best_baseline_no_split"]["ddp"].endswith("+split")
    assert result["comm"]["bandwidth_bytes_per_s"] == 25e9
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
    (["--dist", "lognormal", "--bandwidth", "0"], "--bandwidth: must be > 0"),
    (["--dist", "lognormal", "--layers", "0"], "--layers: must be > 0"),
    (["--dist", "lognormal", "--unit-seconds", "-1"], "--unit-seconds: must be > 0"),
    (["--dist", "lognormal", "--dp", "2", "--rank-speeds", "1,x"], "--rank-speeds 1,x"),
    (["--dist", "lognormal", "--dp", "4", "--rank-speeds", "1,0.5"], "one finite speed > 0"),
    (["--dist", "lognormal", "--dp", "2", "--rank-speeds", "1,0"], "--rank-speeds 1,0"),
    (["--dist", "lognormal", "--costs", "missing.json"], "missing.json: not a cost file"),
    # the cost file is read before the samples: a bad one is refused before they are read
    (["--lengths", "no-lengths.parquet", "--costs", "missing.json"],
     "missing.json: not a cost file"),
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
    assert (args.bandwidth, args.hidden_size, args.layers, args.dtype_bytes) == (25.0, 4096, 32, 2)
    assert args.unit_seconds == pytest.approx(6 * 32 * 4096 / 400e12)


def test_bandwidth_changes_only_what_communication_costs(capsys):
    """Free communication (inf) against 12.5 GB/s: the no-split baselines move no bytes, so
    they time the same; everyone that splits pays, and the ideal (compute only) stays."""
    results = {}
    for bandwidth in ("inf", "12.5"):
        assert main(["balance", "simulate", "--dist", "lognormal", "--dp", "8", "--steps", "4",
                     "--bandwidth", bandwidth, "--json"]) == 0
        results[bandwidth] = json.loads(capsys.readouterr().out)
    free, slow = results["inf"], results["12.5"]
    assert free["comm"]["bandwidth_bytes_per_s"] is None and free["comm"]["sp_comm_per_token"] == 0
    assert slow["comm"]["bandwidth_bytes_per_s"] == 12.5e9
    assert free["ideal_time"] == slow["ideal_time"]
    for name in ("strided", "token_lpt"):
        assert free["policies"][name]["ddp_time"] == slow["policies"][name]["ddp_time"]
    for name in ("omniscale", "token_lpt+split"):
        assert free["policies"][name]["sp_comm_per_rank"] == 0
        assert slow["policies"][name]["sp_comm_per_rank"] > 0
        assert slow["policies"][name]["ddp_time"] > free["policies"][name]["ddp_time"]


def assert_fair_comparison(result: dict) -> None:
    """The JSON of tools/bench/balance.py --quick: baselines with and without the split, a
    bandwidth sweep, the headline against the best baseline that may split, and where the
    figures come from. (The run itself: tests/tools/test_bench_all_quick.py, through
    `bench all`.)"""
    assert result["quick"] and len(result["git_commit"] or "x" * 40) == 40
    assert len(result["load_avg_at_start"]) == 3 and "noisy" in result["timing_note"]
    assert result["bandwidths"] == ["free", "200 GB/s", "25 GB/s", "12.5 GB/s"]
    assert result["default_bandwidth"] == "25 GB/s"
    assert result["comm_model"]["hidden"] == 4096 and result["comm_model"]["layers"] == 32
    assert len(result["targets"]) == 9
    for case in result["cases"]:
        assert set(case["no_split_baselines"]) == {"strided", "first_fit", "token_lpt",
                                                   "kk_cost"}
        assert not any(p["may_split"] for p in case["no_split_baselines"].values())
        assert len(case["runs"]) == 4 * 2  # bandwidths x sp_max
        for run in case["runs"]:
            assert set(run["split_baselines"]) == {"strided+split", "first_fit+split",
                                                   "token_lpt+split", "kk_cost+split"}
            assert run["best_baseline"]["ddp"] in run["split_baselines"]
            assert run["best_baseline_no_split"]["ddp"] in case["no_split_baselines"]
            assert set(run["speedup_vs_best_baseline"]) == {"ddp", "fsdp"}
            assert set(run["speedup_vs_best_no_split_baseline"]) == {"ddp", "fsdp"}
            assert all(p["violations"] == 0 and p["exactly_once"]
                       for p in [run["ours"], *run["split_baselines"].values()])
            assert (run["comm"]["sp_comm_per_token"] == 0) == (run["bandwidth"] == "free")
            # the bound with the necessary splits' communication is one: no policy's step,
            # ours or a baseline's, DDP or FSDP, comes in under it -- so the best baseline's
            # time over it is the most a planner could gain, and ours stays within that
            bound = run["bound_time"]
            for policy in [run["ours"], *run["split_baselines"].values()]:
                assert min(policy["ddp_time"], policy["fsdp_time"]) >= bound * (1 - 1e-9)
            for objective, name in run["best_baseline"].items():
                ceiling = run["split_baselines"][name][f"{objective}_time"] / bound
                assert run["speedup_ceiling_by_bound"][objective] == pytest.approx(ceiling)
                assert run["speedup_vs_best_baseline"][objective] <= ceiling * (1 + 1e-9)


def test_ranks_of_given_speeds_are_planned_by_ours_and_judged_in_time(capsys):
    """One rank at half speed: ours gives it less work, every plan is judged in time, the
    ideal spreads the work by speed (1 + 1 + 1 + 0.5 = 3.5 ranks' worth)."""
    args = ["balance", "simulate", "--dist", "omni", "--dp", "4", "--steps", "4",
            "--micro-batch-tokens", "32768", "--json"]
    assert main(args) == 0
    even = json.loads(capsys.readouterr().out)
    assert main(args + ["--rank-speeds", "1,1,1,0.5"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert even["rank_speed"] is None and slow["rank_speed"] == [1.0, 1.0, 1.0, 0.5]
    assert slow["ideal_time"] == pytest.approx(even["ideal_time"] * 4 / 3.5)
    # a baseline's plans are the same placements, now judged in time: slower
    for name in ("token_lpt+split", "kk_cost+split"):
        assert slow["policies"][name]["ddp_time"] > even["policies"][name]["ddp_time"]
    assert slow["speedup_vs_best_baseline"]["ddp"] > even["speedup_vs_best_baseline"]["ddp"]
    ours = slow["policies"]["omniscale"]["imbalance_mean"]  # in time: max / mean rank
    assert all(ours < p["imbalance_mean"] for name, p in slow["policies"].items()
               if name != "omniscale")
    assert slow["policies"]["omniscale"]["exactly_once"]


def _cost_file(path, alpha, beta, per_micro_batch=0.0):
    path.write_text(json.dumps({"unit": "seconds", "llm": {
        "alpha": alpha, "beta": beta, "gamma": 0.0, "per_micro_batch": per_micro_batch},
        "encoders": {}}))
    return str(path)


def test_a_cost_file_prices_as_its_coefficients_and_charges_each_micro_batch(tmp_path, capsys):
    """A calibrated file with the LLM's alpha and beta alone simulates exactly as those two
    flags with free communication; its micro-batch cost adds that much per slot to every
    policy's step."""
    base = ["balance", "simulate", "--dist", "lognormal", "--steps", "4", "--json"]
    assert main(base + ["--cost-linear", "3", "--cost-quadratic", "0.5",
                        "--bandwidth", "inf"]) == 0
    flags = json.loads(capsys.readouterr().out)
    assert main(base + ["--costs", _cost_file(tmp_path / "a.json", 3.0, 0.5)]) == 0
    filed = json.loads(capsys.readouterr().out)
    assert filed["cost"]["file"].endswith("a.json") and filed["comm"]["reshard_per_token"] == 0
    assert filed["ideal_time"] == pytest.approx(flags["ideal_time"])
    for name, p in flags["policies"].items():
        for key in ("ddp_time", "fsdp_time", "micro_batches_mean"):
            assert filed["policies"][name][key] == pytest.approx(p[key]), (name, key)
    assert main(base + ["--costs", _cost_file(tmp_path / "m.json", 3.0, 0.5, 100.0)]) == 0
    charged = json.loads(capsys.readouterr().out)
    for name, p in filed["policies"].items():
        slots = p["micro_batches_mean"] * p["steps"]
        assert charged["policies"][name]["fsdp_time"] == pytest.approx(
            p["fsdp_time"] + 100.0 * slots), name
