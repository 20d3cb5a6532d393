"""``omniscale bench all``: the headline table from canned JSON, failure handling with stand-in
benches, and one real quick run of the cheapest bench."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from omniscale.errors import UserError
from omniscale.tools.bench import all as bench_all
from omniscale.tools.bench.all import BENCHES, Bench, Goal, Metric, headline_rows, markdown_table

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "bench"


def by_metric(rows: list[dict]) -> dict[str, dict]:
    return {r["metric"]: r for r in rows}


# Scripts under tools/bench that `bench all` does not run, and why.
OUTSIDE_BENCH_ALL = {
    "mutation.py": "the mutation score of the tests (issue #46): about an hour, outside CI",
}


def test_every_bench_script_is_registered():
    """A new tools/bench script must be added to BENCHES, or `bench all` would skip it
    (`_name.py`: a helper another bench runs), or be named in OUTSIDE_BENCH_ALL."""
    scripts = {p.name for p in (REPO / "tools" / "bench").glob("*.py")
               if 'if __name__ == "__main__"' in p.read_text() and p.name != "all.py"
               and not p.name.startswith("_") and p.name not in OUTSIDE_BENCH_ALL}
    scripts |= {p.name for p in (REPO / "tools" / "bench").glob("*.sh")}
    assert scripts == {b.script for b in BENCHES.values()}


# Committed JSONs no bench of the registry writes, and why.
NOT_WRITTEN_BY_A_BENCH = {
    "calibrate_demo_omni.json": "written by `omniscale balance calibrate` (the demo's cost file)",
    "demo_runs.json": "the README's demo runs, measured by hand",
    "balance_scale_before.json": "the planner's code before the scale work (commit 07a44fa)",
    "plane_ramp_before.json": "plane_ramp's command on an export with the mixer of a93aacb (a "
                              "stop per draw inside a ramp over tokens, before fa09370)",
    "mutation.json": "tools/bench/mutation.py: the tests' mutation score, hours, outside bench all",
}


RENAMED = {"kernels.py": "kernel_ops.py"}  # it shadowed the `kernels` package transformers imports


def test_every_committed_json_is_written_by_a_bench_with_the_arguments_it_records():
    """`bench all --write-docs` can regenerate every cited figure: each committed JSON has its
    bench (or a variant) in the registry, and the arguments the registry gives that bench are
    the ones the JSON's own command line recorded."""
    from omniscale.tools.bench.all import docs_json

    writers = {docs_json(name, bench): bench for name, bench in BENCHES.items()}
    for path in sorted(DOCS.glob("*.json")):
        if path.name in NOT_WRITTEN_BY_A_BENCH:
            continue
        assert path.name in writers, f"{path.name}: no bench in the registry writes it"
        bench = writers[path.name]
        command = json.loads(path.read_text()).get("command")
        if command is None or bench.json_in_out_dir:
            continue  # predates recording its command / a shell script under $OUT
        recorded = command.split()
        script = RENAMED.get(Path(recorded[0]).name, Path(recorded[0]).name)
        assert script == bench.script, (path.name, command)
        args = list(bench.full_args)
        for i, flag in enumerate(args):
            if not flag.startswith("--"):
                continue
            assert flag in recorded, f"{path.name}: {command!r} lacks {flag} of the registry"
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            if value is not None:
                assert recorded[recorded.index(flag) + 1] == value, (path.name, flag, command)
        if bench.variant_of:
            assert bench.script == BENCHES[bench.variant_of].script


def test_the_cli_names_every_bench_in_order():
    from omniscale.tools import cli

    assert cli.BENCH_NAMES == tuple(BENCHES)


def test_headlines_from_the_committed_bench_json():
    """docs/bench holds each bench's JSON as it writes it: the mapping must find its numbers."""
    raw = json.loads((DOCS / "linear_ce_memory.json").read_text())
    lce = headline_rows("linear_ce_memory", raw)
    peak = by_metric(lce)["peak RSS bytes: fused vs unfused linear CE"]
    assert peak["value"] == raw["variants"]["fused"]["peak_bytes"]
    assert peak["baseline"] == raw["variants"]["unfused"]["peak_bytes"]
    assert peak["ratio"] == pytest.approx(raw["peak_ratio"], abs=1e-4)
    assert peak["target"] == "<= 0.25" and peak["met"] is True
    raw = json.loads((DOCS / "hf_load_memory.json").read_text())
    hf = by_metric(headline_rows("hf_load_memory", raw))
    shard = hf["peak RSS growth per rank: sharded vs transformers from_pretrained"]
    assert shard["value"] == raw["median_peak_growth_bytes"]["sharded"]
    assert shard["baseline"] == raw["median_peak_growth_bytes"]["transformers"]
    assert shard["ratio"] == pytest.approx(raw["median_peak_growth_bytes"]["sharded"]
                                           / raw["median_peak_growth_bytes"]["transformers"])

    balance = headline_rows("balance", json.loads((DOCS / "balance.json").read_text()))
    assert len(balance) == 9 and all(r["target"] and r["met"] in (True, False) for r in balance)

    kernel_json = json.loads((DOCS / "kernels_cpu.json").read_text())
    kernels = by_metric(headline_rows("kernels", kernel_json))
    ms = kernel_json["rows"][0]["ms"]  # rms_norm: the ratio is the reference's time over eager's
    eager = kernels["rms_norm fwd+bwd ms: eager (hand-written backward) vs reference"]
    assert eager["ratio"] == pytest.approx(ms["reference"] / ms["eager"])
    assert "rms_norm fwd+bwd ms: torch.compile vs reference" in kernels
    assert "swiglu fwd+bwd ms: eager (hand-written backward) vs reference" not in kernels
    assert not any("Triton" in m for m in kernels)  # CPU JSON: no Triton rows

    loader_json = json.loads((DOCS / "loader.json").read_text())
    loader = by_metric(headline_rows("loader", loader_json))
    for workload in loader_json["workloads"]:
        name = workload["workload"]
        tokens = loader[f"{name} tokens/s: RankLoader vs the faster baseline (median of paired "
                        "rounds)"]
        paired = sorted(r["ratio"]["tokens_per_s"] for r in workload["rounds"])
        assert len(paired) >= 5 and tokens["ratio"] == statistics.median(paired)
        samples = loader[f"{name} samples/s: RankLoader vs the faster of webdataset and "
                         "Megatron-Energon (median of paired rounds)"]
        if samples["target"] is not None:
            assert samples["met"] is (samples["ratio"] >= float(samples["target"][3:]))
        for base, label in (("webdataset", "DataLoader + webdataset"),
                            ("energon", "Megatron-Energon")):
            alone = loader[f"{name} samples/s: RankLoader vs {label}"]
            assert alone["ratio"] == statistics.median(
                r["ratio_vs"][base]["samples_per_s"] for r in workload["rounds"])
            assert samples["ratio"] <= alone["ratio"] + 1e-12  # the faster one is the bar
    assert {w["workload"] for w in loader_json["workloads"]} == {"mixed", "image", "video",
                                                                 "text"}
    assert "RSS growth MiB per worker, ours, 1000 sources" in loader

    e2e_json = json.loads((DOCS / "e2e.json").read_text())
    e2e = by_metric(headline_rows("e2e", e2e_json))
    speed = e2e["training tokens/s: ours vs the best baseline policy (median of rounds)"]
    assert speed["ratio"] == e2e_json["ratio_vs_best_baseline"]["median"]
    assert speed["target"] == ">= 0.98" and speed["met"] is (speed["ratio"] >= 0.98)


def test_model_headlines_from_the_committed_bench_json():
    """Every row of docs/bench/model.json maps to its headlines; expected values come from the
    JSON itself, so a re-measurement needs no edit here."""
    model_json = json.loads((DOCS / "model.json").read_text())
    results = model_json["results"]
    if any("hf_layout" not in r for r in results):
        pytest.skip("docs/bench/model.json predates the HF packed baseline and parameter "
                    "counts: re-measure it (tools/bench/model.py docstring)")
    assert {"git_commit", "git_dirty", "load_avg_at_start", "command"} <= set(model_json)
    assert any(r["params_total"] >= 100_000_000 for r in results)  # one preset is no toy
    model = by_metric(headline_rows("model", model_json))
    for r in results:
        key = f"{r['preset']} {r['batch']}"
        if "hf_best" in r:  # HF's fastest way to run the batch, bucketed and padded included
            best = model[f"{key}: ratio vs HF's fastest ({r['hf_best']})"]
            assert best["value"] == r["ratio_vs_hf_best_default"] and best["target"] == ">= 1.2"
            ways = [k[:-len("_tokens_per_s")] for k in r if k.startswith("hf")
                    and k.endswith("_tokens_per_s") and k != "hf_best_tokens_per_s"]
            assert r["hf_best_tokens_per_s"] == max(r[f"{w}_tokens_per_s"] for w in ways)
        if r["batch"] == "equal":
            equal = model[f"{key}: tokens/s ours vs HF Qwen3-MoE"]
            assert equal["ratio"] == r["ratio"] and equal["met"] == (r["ratio"] >= 1.2)
            assert model[f"{r['preset']}: parameters, total"]["value"] == r["params_total"]
            assert model[f"{r['preset']}: parameters, active per token"]["value"] \
                == r["params_active"]
        else:
            assert r["hf_packed_check"]["max_abs_logit_diff"] <= r["hf_packed_check"]["atol"]
            packed = model[f"{key}: tokens/s ours vs HF packed (block-causal)"]
            assert packed["ratio"] == r["ratio"] and packed["baseline"] == r["hf_tokens_per_s"]
            assert packed["target"] is None
            assert model[f"{key}: ratio vs HF padded (information)"]["value"] \
                == r["ratio_padded"]
            assert model[f"{key}: ratio vs HF bucketed (information)"]["value"] \
                == r["ratio_bucketed"]


def test_headlines_of_plane_and_gpu_kernels_from_canned_json():
    plane = {"rows": [{"what": "memory: replicated / (plane + client)", "baseline": "900 MiB",
                       "measured": "40 MiB", "value": "22.5x", "target": ">= 20x", "met": True},
                      {"what": "serving: latency p50 / p99", "baseline": "-",
                       "measured": "p50 1 ms", "value": "25 ms", "target": "p99 <= 20 ms",
                       "met": False}]}
    rows = headline_rows("plane", plane)
    assert [(r["value"], r["target"], r["met"]) for r in rows] == [
        ("22.5x", ">= 20x", True), ("25 ms", "p99 <= 20 ms", False)]
    # --quick shrinks plane's sizes below its own --quick: its verdicts are shown, not judged
    rows = headline_rows("plane", plane, quick=True)
    assert [r["met"] for r in rows] == ["n/a (quick sizes)"] * 2

    gpu = {"rows": [{"op": "rms_norm", "ms": {"reference": 2.0, "eager": 1.6, "compiled": 1.0,
                                              "triton": 0.5},
                     "peak_fraction": {"triton": 0.61}, "metric": "HBM bandwidth"}]}
    rows = by_metric(headline_rows("gpu_check", gpu))
    assert rows["rms_norm fwd+bwd ms: Triton vs reference"]["ratio"] == 4.0  # 2.0 / 0.5
    assert rows["rms_norm fwd+bwd ms: eager (hand-written backward) vs reference"]["ratio"] \
        == 1.25
    assert rows["rms_norm: Triton fraction of peak HBM bandwidth"]["value"] == 0.61


def test_quick_sizes_show_targets_without_judging_them():
    lce = json.loads((DOCS / "linear_ce_memory.json").read_text())
    peak = headline_rows("linear_ce_memory", lce, quick=True)[0]
    assert peak["target"] == "<= 0.25" and peak["met"] == "n/a (quick sizes)"


def test_markdown_table_from_canned_results():
    results = {"quick": False, "benches": {
        "linear_ce_memory": {"status": "ok", "seconds": 12.0, "command": "python x.py",
                             "headlines": headline_rows(
                                 "linear_ce_memory",
                                 json.loads((DOCS / "linear_ce_memory.json").read_text()))},
        "loader": {"status": "failed", "seconds": 3.0, "command": "python l.py",
                   "error": "RuntimeError: a | b"},
        "gpu_check": {"status": "skipped", "note": "needs CUDA; none here"}}}
    text = markdown_table(results)
    lines = text.splitlines()
    assert lines[2] == "| bench | metric | value | baseline | ratio | target | met? |"
    raw = json.loads((DOCS / "linear_ce_memory.json").read_text())
    fused, unfused = (raw["variants"][v]["peak_bytes"] for v in ("fused", "unfused"))
    assert (f"| linear_ce_memory | peak RSS bytes: fused vs unfused linear CE | {fused:,} | "
            f"{unfused:,} | {fused / unfused:.4f} | <= 0.25 | yes |") in lines
    assert "| linear_ce_memory | fused and unfused losses agree | yes | - | - | - | - |" in lines
    assert "| loader | (failed) RuntimeError: a \\| b | - | - | - | - | - |" in lines
    assert "| gpu_check | (skipped) needs CUDA; none here | - | - | - | - | - |" in lines
    assert "| loader | failed | 3.0 | `python l.py` |" in lines
    # every row of the first table has the header's seven cells (escaped pipes are text)
    first_table = lines[2:lines.index("", 2)]
    assert len(first_table) == 7
    assert all(len(re.split(r"(?<!\\)\|", line)) == 9 for line in first_table)


def write_script(path: Path, body: str) -> str:
    path.write_text("import argparse, json, sys\n"
                    "p = argparse.ArgumentParser(); p.add_argument('--out'); "
                    "p.add_argument('--small', action='store_true'); a = p.parse_args()\n" + body)
    return str(path)  # an absolute script path: BENCH_DIR / it is itself


def test_a_failing_bench_is_recorded_and_the_rest_still_run(tmp_path, capsys):
    metric = (Metric("speed-up", value="ours", baseline="base", ratio="ratio",
                     target=Goal(">=", 1.5)),)
    benches = {
        "boom": Bench(write_script(tmp_path / "boom.py",
                                   "print('working', flush=True)\n"
                                   "print('Traceback ...\\nOSError: disk on fire', "
                                   "file=sys.stderr)\nsys.exit(3)\n"), metrics=metric),
        "fine": Bench(write_script(tmp_path / "fine.py",
                                   "assert a.small\n"
                                   "json.dump({'ours': 3.0, 'base': 1.5, 'ratio': 2.0}, "
                                   "open(a.out, 'w'))\n"),
                      metrics=metric, quick_args=("--small",), quick_is_own_flag=True),
        "missed": Bench(write_script(tmp_path / "missed.py",
                                     "json.dump({'ours': 1.0, 'base': 1.0, 'ratio': 1.0}, "
                                     "open(a.out, 'w')); sys.exit(1)\n"),
                        metrics=metric, quick_is_own_flag=True, missed_exit_code=1),
    }
    out = tmp_path / "results" / "bench-results.json"
    assert bench_all.run_all(list(benches), True, out, benches) == 1
    printed = capsys.readouterr().out
    assert "[1/3] boom: failed in" in printed and "OSError: disk on fire" in printed
    assert "[2/3] fine: ok in" in printed and "[3/3] missed: targets missed in" in printed
    results = json.loads(out.read_text())["benches"]
    assert results["boom"]["status"] == "failed"
    assert results["boom"]["error"] == "OSError: disk on fire"
    assert results["fine"]["headlines"][0]["met"] is True
    assert results["fine"]["result"] == {"ours": 3.0, "base": 1.5, "ratio": 2.0}
    assert results["missed"]["headlines"][0]["met"] is False
    assert "--small" in results["fine"]["command"] and "$SCRATCH/result.json" in \
        results["fine"]["command"]
    assert "(failed) OSError: disk on fire" in out.with_suffix(".md").read_text()


def test_gpu_check_is_skipped_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_all, "cuda_available", lambda: False)
    out = tmp_path / "r.json"
    assert bench_all.run_all(["gpu_check"], False, out) == 0
    assert "gpu_check: skipped (needs CUDA)" in capsys.readouterr().out
    assert json.loads(out.read_text())["benches"]["gpu_check"]["status"] == "skipped"


def test_only_selects_in_registry_order_and_rejects_unknown_names():
    assert bench_all.select("plane, balance") == ["balance", "plane"]
    with pytest.raises(UserError, match="unknown bench 'nope'"):
        bench_all.select("balance,nope")


def test_write_docs_runs_full_sizes_into_the_committed_json_from_a_clean_tree(
        tmp_path, monkeypatch, capsys):
    from omniscale.tools.bench import provenance

    metric = (Metric("speed-up", value="ours"),)
    script = tmp_path / "full.py"
    script.write_text("import argparse, json, sys\n"
                      "p = argparse.ArgumentParser(); p.add_argument('--out'); "
                      "p.add_argument('--small', action='store_true'); p.add_argument('--rounds')\n"
                      "a = p.parse_args(); assert not a.small\n"
                      "json.dump({'ours': 2.0, 'argv': sys.argv[1:]}, open(a.out, 'w'))\n")
    script = str(script)
    benches = {"full": Bench(script, metrics=metric, quick_args=("--small",),
                             full_args=("--rounds", "3"), docs_json="full_cpu.json")}
    docs = tmp_path / "docs-bench"
    docs.mkdir()
    monkeypatch.setattr(bench_all, "DOCS_BENCH", docs)
    out = tmp_path / "r.json"
    # a dirty tree (or none) and --quick are refused, in one line, before anything runs
    for dirty, quick, message in ((True, False, "commit first"), (None, False, "commit first"),
                                  (False, True, "--write-docs --quick")):
        monkeypatch.setattr(provenance, "provenance", lambda d=dirty: {"git_dirty": d})
        with pytest.raises(UserError, match=message):
            bench_all.run_all(["full"], quick, out, benches, write_docs=True)
    assert list(docs.iterdir()) == []
    monkeypatch.setattr(provenance, "provenance", lambda: {"git_dirty": False})
    assert bench_all.run_all(["full"], False, out, benches, write_docs=True) == 0
    written = json.loads((docs / "full_cpu.json").read_text())
    assert written["argv"] == ["--rounds", "3", "--out", str(docs / "full_cpu.json")]
