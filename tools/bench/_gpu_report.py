"""The parts of tools/bench/gpu_check.sh that are Python: the machine's description, checks of
the trainer's config keys, and the one JSON the run reports in.

    python tools/bench/_gpu_report.py env --json env.json       # GPU, versions, commit, kernels
    python tools/bench/_gpu_report.py check-train CONFIG --set K=V ...   # parse as `omniscale
                                                       # train` does, then validate the config
    python tools/bench/_gpu_report.py assemble --work DIR --out OUT     # OUT/gpu_check.json

``assemble`` reads what the stages left in the work directory (each stage's exit status and
seconds in stages.tsv, then the JSON or JUnit XML each one wrote), writes
OUT/gpu_check.json and OUT/kernels_h200.json (tools/bench/kernel_ops.py's format, rows of every op:
what ``omniscale bench all`` reads), and prints the headline figures.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def commit(wheels: Path | None) -> dict:
    """The commit measured: git's, else ``GIT_COMMIT``, else the one --prepare recorded
    (the device copy of the tree may carry no .git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO,
                                    capture_output=True, text=True).stdout.strip())
        return {"commit": head, "dirty": dirty, "source": "git"}
    except (OSError, subprocess.CalledProcessError):
        pass
    if os.environ.get("GIT_COMMIT"):
        return {"commit": os.environ["GIT_COMMIT"], "dirty": None, "source": "GIT_COMMIT"}
    prepared = (wheels or REPO / "gpu_wheels") / "prepared.json"
    if prepared.exists():
        info = json.loads(prepared.read_text())
        return {"commit": info.get("git_commit"), "dirty": info.get("git_dirty"),
                "source": f"{prepared.name}: the tree when --prepare ran"}
    return {"commit": None, "dirty": None, "source": None}


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def env(wheels: Path | None) -> dict:
    import torch

    info = {"python": platform.python_version(), "executable": sys.executable,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": version("triton"), "transformers": version("transformers"),
            "flash_attn": importlib.util.find_spec("flash_attn") is not None,
            "cuda_available": torch.cuda.is_available(), **commit(wheels)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=props.total_memory / 2 ** 30,
                    multiprocessors=props.multi_processor_count)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    from omniscale import kernels

    # the backend each op resolves to on CUDA (attention included): what the trainer runs
    info["kernel_registry_cuda"] = kernels.describe("cuda")
    return info


def junit(path: Path) -> dict | None:
    """pytest's --junitxml: counts and the failures' first lines."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for bad in case.findall("failure") + case.findall("error"):
            first = (bad.get("message") or "").strip().splitlines()[:1]
            failed.append(f"{case.get('classname')}::{case.get('name')}: "
                          f"{first[0][:200] if first else bad.tag}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def stages(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds, limit = line.split("\t")
            status = "skipped" if rc == "skipped" else "passed" if rc == "0" else \
                "timed out" if rc in ("124", "137") else "failed"
            rows.append({"stage": name, "status": status,
                         "exit": None if rc == "skipped" else int(rc),
                         "seconds": int(seconds), "limit_s": int(limit)})
    return rows


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def kernel_rows(folder: Path) -> dict | None:
    """The per-op JSONs of tools/bench/kernel_ops.py merged into its own format."""
    parts = [read_json(p) for p in sorted(folder.glob("*.json"))] if folder.exists() else []
    parts = [p for p in parts if p]
    if not parts:
        return None
    merged = {k: v for k, v in parts[0].items() if k not in ("rows", "command")}
    merged["command"] = [p.get("command") for p in parts]
    merged["rows"] = [row for p in parts for row in p.get("rows", [])]
    return merged


def assemble(work: Path, out: Path, budget_s: int) -> dict:
    from omniscale.tools.bench._gpu_train_summary import host_syncs
    from omniscale.tools.train.metrics import read_metrics

    ran = stages(work / "stages.tsv")
    environment = read_json(work / "env.json") or {}
    environment["imports"] = read_json(work / "imports.json")
    tests = junit(work / "gpu_tests.xml")
    kernels = kernel_rows(work / "kernels")
    if kernels:
        (out / "kernels_h200.json").write_text(json.dumps(kernels, indent=1) + "\n")
    trainer = read_json(work / "train_summary.json")
    syncs_metrics = work / "train_syncs" / "metrics.jsonl"
    syncs = host_syncs(read_metrics(syncs_metrics)) if syncs_metrics.exists() else None
    if trainer and trainer.get("host_syncs") is None and syncs is not None:
        trainer.update(host_syncs=syncs, host_syncs_per_micro_batch=syncs["per_micro_batch"],
                       host_syncs_source="separate run (train_syncs, debug.count_host_syncs)")
    hf = read_json(work / "hf_step.json")
    hf_base = (hf or {}).get("hf", {}).get((hf or {}).get("hf_baseline"), {})
    t = trainer or {}
    report = {
        "passed": bool(ran) and all(s["status"] == "passed" for s in ran),
        "ran_on_gpu": environment.get("gpu"),
        "headline": {
            "gpu_tests": (f"{tests['passed']} passed, {tests['failures'] + tests['errors']} "
                          f"failed, {tests['skipped']} skipped") if tests else None,
            "train_tokens_per_s": t.get("tokens_per_s"), "train_mfu": t.get("mfu"),
            "train_tflops_per_s": t.get("tflops_per_s"), "train_peak_mem_gib": t.get(
                "peak_mem_gib"),
            "host_syncs_per_micro_batch": t.get("host_syncs_per_micro_batch"),
            "hf_tokens_per_s": hf_base.get("tokens_per_s"),
            "hf_precision": (hf or {}).get("hf_baseline"),
            "ratio_ours_over_hf_tokens_per_s": (hf or {}).get("ratio"),
            "ratio_ours_over_hf_model_flops": (hf or {}).get("ratio_model_flops")},
        "mfu_formula": t.get("mfu_formula"),
        "budget_s": budget_s, "stages": ran, "environment": environment,
        "gpu_tests": tests,
        "kernels": {"registry_cuda": environment.get("kernel_registry_cuda"),
                    "rows": (kernels or {}).get("rows")},
        "trainer": trainer, "hf_comparison": hf}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="GPU, versions, commit, the kernel registry's CUDA choice")
    e.add_argument("--json", type=Path, required=True)
    e.add_argument("--wheels", type=Path)
    c = sub.add_parser("check-train", help="`omniscale train` arguments: parsed by its own "
                       "parser, the config and --set's validated (nothing runs)")
    c.add_argument("train_args", nargs=argparse.REMAINDER)
    a = sub.add_parser("assemble", help="OUT/gpu_check.json from the stages' files")
    a.add_argument("--work", type=Path, required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--budget-s", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "env":
        info = env(args.wheels)
        args.json.write_text(json.dumps(info, indent=1) + "\n")
        print(json.dumps(info, indent=1))
    elif args.cmd == "check-train":
        from omniscale.errors import UserError
        from omniscale.tools.cli import build_parser
        from omniscale.tools.train.config import load_config

        train = build_parser().parse_args(["train", *args.train_args])
        try:
            load_config(train.config, train.set or [])
        except UserError as e:
            print(f"_gpu_report: {e}", file=sys.stderr)
            return 1
        print(f"omniscale train {train.config} with {len(train.set or [])} --set: valid")
    elif args.cmd == "assemble":
        r = assemble(args.work, args.out, args.budget_s)
        for s in r["stages"]:
            print(f"  {s['stage']:14s} {s['status']:9s} {s['seconds']:4d} s (limit {s['limit_s']})")
        print("headline: " + json.dumps(r["headline"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
