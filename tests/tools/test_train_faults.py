"""``omniscale train`` against faults, with real processes: the plane killed with ``kill -9``
mid-run and restarted from its state dir (the ranks ride it out on the client's retry), and the
audit then finds no sample lost or repeated.

The test synchronises on the processes' output lines (the plane's "serving" line, the
trainer's "step N/M" lines), never by sleeping.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import Proc as _Proc
from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180  # seconds any one wait may take before the test fails (never a pacing delay)


def Proc(args: list[str]) -> _Proc:
    return _Proc(args, timeout=TIMEOUT)


CONFIG = "configs/demo_omni.yaml"


def run_sets(spec: Path, run: Path) -> dict:
    return {"data.spec": spec, "data.workers": 0, "eval.enabled": False,
            "data.global_batch_tokens": 4096, "data.micro_batch_tokens": 4096,
            "optim.warmup_steps": 1, "steps": 6, "checkpoint_every": 3, "output_dir": run}


def serve(sets: dict, state: Path, port: int) -> tuple[Proc, str]:
    """The plane for a 2-process run of ``sets``, started with the flags the launch recipe's
    ``plane_args`` prints for it (the trainer refuses a plane that plans otherwise)."""
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    flags = subprocess.run([sys.executable, "-m", "omniscale.tools.launch.plane_args",
                            "--world", "2", CONFIG, *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=TIMEOUT, check=True).stdout.split("\n")
    flags[flags.index("--state-dir") + 1] = str(state)
    plane = Proc([sys.executable, "-m", "omniscale", "plane", "serve", *filter(None, flags),
                  "--port", str(port)])
    return plane, plane.wait_for(r"serving (\S+) \(step")[1]


def test_plane_killed_mid_run_restarts_and_nothing_is_lost_or_repeated(demo, tmp_path):
    state, run, port = tmp_path / "plane", tmp_path / "run", free_port()
    procs = []
    try:
        sets = run_sets(demo / "mix.yaml", run)
        plane, url = serve(sets, state, port)
        procs.append(plane)
        trainer = Proc([sys.executable, "-m", "omniscale", "train", CONFIG,
                        "--nproc", "2", "--plane", url, "--no-progress",
                        *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]])
        procs.append(trainer)
        trainer.wait_for(r"^step 2/6")
        plane.kill()  # kill -9 while the ranks train on
        plane, url_again = serve(sets, state, port)
        procs.append(plane)
        assert url_again == url
        trainer.finish(TIMEOUT * 3)
    finally:
        for proc in procs:
            proc.kill()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    done = subprocess.run([sys.executable, "-m", "omniscale", "plane", "audit", str(state),
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["duplicated"] == 0 and report["missing"] == 0, report
    assert report["fingerprint_mismatches"] == [] and report["next_step"] == 6
    # every sample the trainer trained is a committed sample of the audit
    trained = sum(sum(r["mix_samples"].values()) for r in rows)
    assert sum(r["committed"] for r in report["rows"]) == trained > 0


def test_external_plane_for_another_dp_is_one_line(demo, tmp_path, capsys):
    from omniscale.tools.cli import main

    state, port = tmp_path / "plane", free_port()
    plane, url = serve(run_sets(demo / "mix.yaml", tmp_path / "run"), state, port)
    try:
        rc = main(["train", "configs/demo_omni.yaml", "--plane", url, "--no-progress",
                   "--set", f"data.spec={demo / 'mix.yaml'}", "--set", "eval.enabled=false",
                   "--set",
                   f"output_dir={tmp_path / 'run'}"])
    finally:
        plane.kill()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"omniscale: error: --plane {url}: the plane plans for --dp 2, "
                               f"this run for 1 (--nproc / (tp·pp))"), err


@pytest.mark.parametrize("flag,value,says", [
    ("--global-batch-tokens", "65536", "the plane's --global-batch-tokens is 65536, this run's "
                                       "is 4096 (data.global_batch_tokens)"),
    ("--window", "2", "the plane's --window is 2, this run's is 4 (data.window)"),
])
def test_external_plane_planning_otherwise_is_one_line_naming_both(demo, tmp_path, capsys,
                                                                    flag, value, says):
    """The multi-node recipe once started its plane with 65,536-token batches for a run of
    8,192: a trainer that checked only dp, sp and policy let the plane's settings win."""
    from omniscale.tools.cli import main

    sets = run_sets(demo / "mix.yaml", tmp_path / "run")
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    flags = subprocess.run([sys.executable, "-m", "omniscale.tools.launch.plane_args",
                            "--world", "2", CONFIG, *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=TIMEOUT, check=True).stdout.split()
    flags[flags.index("--state-dir") + 1] = str(tmp_path / "plane")
    flags[flags.index(flag) + 1] = value
    plane = Proc([sys.executable, "-m", "omniscale", "plane", "serve", *flags,
                  "--port", str(free_port())])
    url = plane.wait_for(r"serving (\S+) \(step")[1]
    try:
        rc = main(["train", CONFIG, "--nproc", "2", "--plane", url, "--no-progress", *args])
    finally:
        plane.kill()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"omniscale: error: --plane {url}: {says}; start the "
                                      "plane with the flags"), err
    assert "\n" not in err
