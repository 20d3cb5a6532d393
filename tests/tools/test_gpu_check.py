"""tools/bench/gpu_check.sh and its helpers, without a GPU: the dry run wires every stage (the
trainer's exact arguments through its own parser, the wheel list --prepare downloads, the
`gpu` tests collected); _hf_step.py runs on CPU at tiny shapes and takes its batch from the
trainer's summary; the wheel folder's closure, checks and install; the train summary's medians
and model; the report's one JSON, and the kernels JSON tools/bench/all.py reads."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import re
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from omniscale.backbone.config import ModelConfig
from omniscale.tools.bench import _gpu_deps, _gpu_report, _gpu_train_summary
from omniscale.tools.bench.all import headline_rows

REPO = Path(__file__).resolve().parents[2]
STAGES = ("syntax", "deps", "imports", "env", "gpu_tests", "data", "train", "train_summary",
          "hf_step", "kernels")


@pytest.mark.slow
def test_dry_run_wires_every_stage_without_a_gpu_or_wheels(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": str(tmp_path / "no_wheels")}
    done = subprocess.run(["bash", "tools/bench/gpu_check.sh", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    status = {line.split()[0]: line.split()[1] for line in out.splitlines()
              if line.startswith("  ") and len(line.split()) > 2 and line.split()[0] in STAGES}
    assert status == dict.fromkeys(STAGES, "passed"), out
    # the list --prepare downloads is the one the install derives, at the versions here
    pins = " ".join(f"{d}=={importlib.metadata.version(d)}" for d in _gpu_deps.SHIPPED)
    assert f"--prepare downloads: {pins}" in out
    assert f"no {tmp_path / 'no_wheels'}/ here" in out
    # the timed run's arguments, parsed by `omniscale train`'s parser and validated
    assert re.search(r"omniscale train configs/demo_lm.yaml with \d+ --set: valid", out)
    assert "gpu_check: passed" in out


def test_check_train_refuses_an_unknown_key(capsys):
    assert _gpu_report.main(["check-train", "configs/demo_lm.yaml", "--nproc", "1",
                             "--set", "model.preset=1b", "--set", "parallel.devcie=cuda"]) == 1
    assert "parallel.devcie: unknown key" in capsys.readouterr().err
    assert _gpu_report.main(["check-train", "configs/demo_lm.yaml", "--no-progress",
                             "--set", "parallel.device=cuda"]) == 0



# -- _hf_step.py --------------------------------------------------------------------------------
def test_hf_step_runs_on_cpu_at_tiny_shapes(tmp_path):
    out = tmp_path / "hf.json"
    done = subprocess.run([sys.executable, "tools/bench/_hf_step.py", "--device", "cpu",
                           "--tiny", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    d = json.loads(out.read_text())
    run = d["hf"]["fp32"]
    assert d["architecture"] == "Qwen3MoeForCausalLM" and d["attn_implementation"] == "sdpa"
    # transformers' own parameter count is our accounting's: the same model
    assert run["params_hf"] == ModelConfig.preset("tiny").param_count()
    assert d["batch"]["tokens_per_step"] == 2 * 64 * 2
    assert len(run["step_s_all"]) == 3 and run["step_s"] == statistics.median(run["step_s_all"])
    assert run["tokens_per_s"] == pytest.approx(256 / run["step_s"])
    assert math.isfinite(run["loss_first"]) and math.isfinite(run["loss_last"])
    assert "ratio" not in d and d["ours"] is None  # no trainer run to compare with


def test_hf_step_takes_the_runs_batch_and_prices_both_alike(tmp_path, capsys):
    from omniscale.tools.bench import _hf_step as hf_step

    tiny = ModelConfig.preset("tiny")
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({
        "model": {"decoder_config": dataclasses.asdict(tiny)}, "micro_batches": 2.0,
        "tokens_per_step": 300, "mean_sequence_tokens": 49.6, "tokens_per_s": 1000.0,
        "tflops_per_s": 2e-3, "mfu": 0.5, "peak_tflops": 4e-3}))
    out = tmp_path / "hf.json"
    assert hf_step.main(["--device", "cpu", "--from-summary", str(summary), "--warmup", "0",
                         "--steps", "2", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    # L = the mean length, S = tokens per micro-batch / L = 300 / 2 / 50
    assert {k: d["batch"][k] for k in ("seq_len", "seqs_per_micro_batch", "micro_batches",
                                       "tokens_per_step")} == {
        "seq_len": 50, "seqs_per_micro_batch": 3, "micro_batches": 2, "tokens_per_step": 300}
    alpha, beta = tiny.cost_coefficients()  # the trainer's price of a sequence
    run = d["hf"]["fp32"]
    assert d["batch"]["flops_per_step"] == pytest.approx(6 * (alpha * 50 + beta * 50 ** 2))
    assert run["tflops_per_s"] == pytest.approx(d["batch"]["flops_per_step"] / run["step_s"]
                                                / 1e12)
    assert run["mfu"] == pytest.approx(run["tflops_per_s"] / 4e-3)  # the trainer's peak
    assert d["ratio"] == pytest.approx(1000.0 / run["tokens_per_s"])
    assert d["ratio_model_flops"] == pytest.approx(2e-3 / run["tflops_per_s"])
    assert "ratio ours/HF fp32" in capsys.readouterr().out


# -- _gpu_deps.py -------------------------------------------------------------------------------
def fake_wheel(folder: Path, name: str, version: str, requires=(), module: str | None = None):
    """A minimal installable wheel: METADATA (with Requires-Dist), WHEEL, RECORD."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
             + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    if module:
        files[f"{module}.py"] = "VALUE = 42\n"
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def pydantic_folder(folder: Path) -> Path:
    folder.mkdir()
    here = importlib.metadata.version("pydantic")
    fake_wheel(folder, "pydantic", here, ["annotated-types>=0.6.0", "pydantic-core==9.9.9",
                                          "typing-extensions>=4.14.1",
                                          "email-validator>=2.0.0; extra == 'email'"])
    fake_wheel(folder, "pydantic_core", "9.9.9", ["typing-extensions>=4.14.1"])
    fake_wheel(folder, "typing_extensions", "4.16.0")
    fake_wheel(folder, "annotated_types", "0.8.0")
    return folder


def test_wheel_closure_check_and_prune(tmp_path):
    folder = pydantic_folder(tmp_path / "wheels")
    files, absent = _gpu_deps.closure(["pydantic"], folder)
    assert sorted(f.name.split("-")[0] for f in files) == [
        "annotated_types", "pydantic", "pydantic_core", "typing_extensions"]
    assert absent == []  # the `email` extra's dependency is not needed
    assert _gpu_deps.check(folder) == []
    # what the image has is pruned, the rest stays
    fake_wheel(folder, "numpy", "2.0.0")
    fake_wheel(folder, "nvidia-cublas", "13.0.0")
    assert _gpu_deps.main(["prune", str(folder)]) == 0
    assert sorted(p.name.split("-")[0] for p in folder.glob("*.whl")) == [
        "annotated_types", "pydantic", "pydantic_core", "typing_extensions"]
    # a missing dependency, a second version and a stale pin are each named
    (folder / "pydantic_core-9.9.9-py3-none-any.whl").unlink()
    fake_wheel(folder, "annotated_types", "0.7.0")
    problems = _gpu_deps.check(folder)
    assert any("needs pydantic-core" in p for p in problems)
    assert "two wheels of annotated-types" in problems
    stale = pydantic_folder(tmp_path / "stale")
    (stale / f"pydantic-{importlib.metadata.version('pydantic')}-py3-none-any.whl").unlink()
    fake_wheel(stale, "pydantic", "0.0.1", ["pydantic-core==9.9.9"])
    assert any("stale" in p for p in _gpu_deps.check(stale))


def test_install_puts_only_the_missing_ones_wheels_in_the_target(tmp_path, monkeypatch):
    folder = tmp_path / "wheels"
    folder.mkdir()
    fake_wheel(folder, "omniscale-fake-dep", "1.0", ["omniscale-fake-base"],
               module="omniscale_fake_dep")
    fake_wheel(folder, "omniscale-fake-base", "1.0", module="omniscale_fake_base")
    fake_wheel(folder, "omniscale-fake-other", "1.0", module="omniscale_fake_other")
    monkeypatch.setattr(_gpu_deps, "REQUIRED", {"json": "json-is-stdlib",
                                               "omniscale_fake_dep": "omniscale-fake-dep"})
    target = tmp_path / "site"
    assert _gpu_deps.install(folder, target) == 0
    assert sorted(p.name for p in target.glob("*.py")) == ["omniscale_fake_base.py",
                                                          "omniscale_fake_dep.py"]
    # a missing module without a wheel: exit 1, naming it
    monkeypatch.setattr(_gpu_deps, "REQUIRED", {"omniscale_nowhere": "omniscale-nowhere"})
    assert _gpu_deps.install(folder, tmp_path / "site2") == 1


def test_lm_data_is_text_only_and_the_manifest_counts_every_file(tmp_path):
    folder = pydantic_folder(tmp_path / "wheels")
    assert _gpu_deps.main(["lm-data", str(folder / "lm_data")]) == 0
    spec = yaml.safe_load((folder / "lm_data" / "lm.yaml").read_text())
    # text only: the GPU run decodes no media (no av, soundfile or decord there)
    assert {(s["name"], s["format"], s["template"]) for s in spec["sources"]} == {
        ("text", "webdataset", "text"), ("docs", "parquet", "text")}
    assert (folder / "lm_data" / spec["tokenizer"]).is_file()
    info = _gpu_deps.manifest(folder, "3.12")
    on_disk = {p: p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and p.name != "prepared.json"}
    assert info["total_bytes"] == sum(on_disk.values())
    assert info["wheel_bytes"] == sum(v for p, v in on_disk.items() if p.suffix == ".whl")
    assert info["shipped"] == [f"pydantic=={importlib.metadata.version('pydantic')}"]
    assert json.loads((folder / "prepared.json").read_text()) == json.loads(json.dumps(info))


# -- _gpu_train_summary.py ----------------------------------------------------------------------
def write_rows(path: Path, rows: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_train_summary_medians_after_warmup_and_syncs_from_a_second_run(tmp_path):
    rows = [{"step": i, "loss": 9.0 - i, "tokens_per_s": 100.0 * (i + 1),
             "tflops_per_s": i + 1.0, "mfu": (i + 1) / 100, "step_s": 1.0 / (i + 1),
             "tokens": 1000 + i, "micro_batches": 2, "peak_mem_gib": float(i),
             "mix_samples": {"text": 2, "docs": 1}, "mix_tokens": {"text": 600, "docs": 300 + i}}
            for i in range(8)]
    write_rows(tmp_path / "train", rows)
    write_rows(tmp_path / "syncs", [{"step": i, "host_syncs_per_micro_batch": v,
                                     "host_syncs": {"tolist": 2 * v}}
                                    for i, v in enumerate([5.5, 6.0, 6.0])])
    s = _gpu_train_summary.summarise(tmp_path / "train", tmp_path / "syncs")
    assert s["steps_measured"] == 3  # steps 5, 6, 7
    assert (s["tokens_per_s"], s["tflops_per_s"], s["mfu"]) == (700.0, 7.0, 0.07)
    assert s["peak_tflops"] == pytest.approx(100.0)
    assert s["tokens_per_step"] == 1006 and s["micro_batches"] == 2
    assert s["mean_sequence_tokens"] == pytest.approx((3 * 900 + 5 + 6 + 7) / 9)
    assert s["peak_mem_gib"] == 7.0 and s["final_loss"] == 2.0
    assert s["host_syncs_per_micro_batch"] == 6.0
    assert s["host_syncs"]["by_op_last_step"] == {"tolist": 12.0}
    assert "separate run" in s["host_syncs_source"]
    assert "error" in s["model"]  # no config.yaml in this run dir


def test_train_summary_model_is_the_decoder_the_trainer_builds(demo, tmp_path):
    from tokenizers import Tokenizer

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "task": "lm", "model": {"preset": "tiny", "vision": None, "audio": None},
        "data": {"spec": str(demo / "lm.yaml")}}))
    model = _gpu_train_summary.model_summary(run)
    ids = Tokenizer.from_file(str(demo / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True)
    expected = ModelConfig.preset("tiny", vocab_size=max(1024, -(-ids // 64) * 64))
    assert model["vocab_size"] == expected.vocab_size
    assert ModelConfig(**model["decoder_config"]) == expected  # what _hf_step.py rebuilds
    assert model["params_total"] == expected.param_count()
    assert (model["flops_alpha"], model["flops_beta"]) == expected.cost_coefficients()
    assert model["model_memory_estimate_gib"] is None


# -- _gpu_report.py assemble --------------------------------------------------------------------
def junit_of_a_real_session(tmp_path: Path) -> Path:
    """pytest's own JUnit XML for one pass, one failure, one skip."""
    tests = tmp_path / "probe" / "test_probe.py"
    tests.parent.mkdir()
    tests.write_text("import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n"
                     "    assert 1 == 2\n\n@pytest.mark.skip(reason='no')\ndef test_c():\n"
                     "    pass\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider",
                    "-o", "addopts=", f"--junitxml={xml}", "--rootdir", str(tests.parent)],
                   cwd=tests.parent, capture_output=True, timeout=120)
    return xml


def test_report_assembles_one_json_and_the_kernels_json_bench_all_reads(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "kernels").mkdir(parents=True)
    out.mkdir()
    (work / "stages.tsv").write_text("deps\t0\t3\t60\ngpu_tests\t1\t40\t120\n"
                                     "kernels\t124\t120\t120\ntrain_syncs\tskipped\t0\t0\n")
    junit_of_a_real_session(tmp_path).rename(work / "gpu_tests.xml")
    for op, ms in (("rms_norm", {"reference": 2.0, "triton": 0.5}),
                   ("swiglu", {"reference": 3.0, "triton": 1.5})):
        (work / "kernels" / f"{op}.json").write_text(json.dumps({
            "device": "cuda", "command": f"tools/bench/kernel_ops.py --ops {op}",
            "rows": [{"op": op, "ms": ms, "peak_fraction": {"triton": 0.5},
                      "metric": "HBM bandwidth"}]}))
    (work / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "kernel_registry_cuda": {
        "rms_norm": "triton"}}))
    (work / "train_summary.json").write_text(json.dumps({
        "tokens_per_s": 5000.0, "mfu": 0.2, "tflops_per_s": 198.0, "peak_mem_gib": 40.0,
        "host_syncs": None, "host_syncs_per_micro_batch": None, "mfu_formula": "f"}))
    write_rows(work / "train_syncs", [{"step": 0, "host_syncs_per_micro_batch": 4.0}])
    (work / "hf_step.json").write_text(json.dumps({
        "hf": {"autocast": {"tokens_per_s": 4000.0}}, "hf_baseline": "autocast",
        "ratio": 1.25, "ratio_model_flops": 1.3}))
    report = _gpu_report.assemble(work, out, 450)
    assert report == json.loads((out / "gpu_check.json").read_text())
    assert report["passed"] is False
    assert [(s["stage"], s["status"]) for s in report["stages"]] == [
        ("deps", "passed"), ("gpu_tests", "failed"), ("kernels", "timed out"),
        ("train_syncs", "skipped")]
    tests = report["gpu_tests"]
    assert {k: tests[k] for k in ("tests", "passed", "failures", "errors", "skipped")} == {
        "tests": 3, "passed": 1, "failures": 1, "errors": 0, "skipped": 1}
    assert len(tests["failed"]) == 1 and "test_b" in tests["failed"][0]
    assert report["headline"]["gpu_tests"] == "1 passed, 1 failed, 1 skipped"
    assert report["headline"]["host_syncs_per_micro_batch"] == 4.0  # from the second run
    assert report["headline"]["hf_tokens_per_s"] == 4000.0
    assert report["headline"]["ratio_ours_over_hf_tokens_per_s"] == 1.25
    assert [r["op"] for r in report["kernels"]["rows"]] == ["rms_norm", "swiglu"]
    assert report["kernels"]["registry_cuda"] == {"rms_norm": "triton"}
    rows = {r["metric"]: r for r in headline_rows(
        "gpu_check", json.loads((out / "kernels_h200.json").read_text()))}
    assert rows["rms_norm fwd+bwd ms: Triton vs reference"]["ratio"] == 4.0
    assert rows["swiglu fwd+bwd ms: Triton vs reference"]["ratio"] == 2.0
