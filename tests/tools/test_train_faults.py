"""``omniscale train`` against an external plane that does not plan this run, with real
processes: another dp, or any planning setting otherwise, is refused in one line naming both.

The plane killed with ``kill -9`` mid-run and restarted from its state dir while the trainers
ride it out is tested where the operator's guide does it (docs/guides/operate-plane.md, run by
tests/test_guides.py, which checks that the kill lands mid-run).

The tests synchronise on the processes' output lines (the plane's "serving" line), never by
sleeping.
"""

from __future__ import annotations

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
