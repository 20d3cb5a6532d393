"""``omniscale train`` against faults, with real processes: the plane killed with ``kill -9``
mid-run and restarted from its state dir (the ranks ride it out on the client's retry), and the
audit then finds no sample lost or repeated.

The test synchronises on the processes' output lines (the plane's "serving" line, the
trainer's "step N/M" lines), never by sleeping.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180  # seconds any one wait may take before the test fails (never a pacing delay)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from loaders.index import index_paths
    from tools.demo import generate

    root = tmp_path_factory.mktemp("faults") / "demo"
    generate(root, scale="tiny", progress=False)
    index_paths([root / "mix.yaml", root / "eval.yaml"], progress=False)
    return root


class Proc:
    """A child whose output lines a thread queues, so the test blocks on the next line."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.popen = subprocess.Popen(args, cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str) -> re.Match:
        while True:
            try:
                line = self.lines.get(timeout=TIMEOUT)
            except queue.Empty:
                pytest.fail(f"no {pattern!r} within {TIMEOUT} s:\n{''.join(self.output)}")
            if line is None:
                pytest.fail(f"exited before {pattern!r}:\n{''.join(self.output)}")
            if match := re.search(pattern, line):
                return match

    def finish(self) -> None:
        rc = self.popen.wait(timeout=TIMEOUT * 3)
        self.lines.put(None)
        assert rc == 0, "".join(self.output[-60:])

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=TIMEOUT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(spec: Path, state: Path, port: int) -> tuple[Proc, str]:
    plane = Proc([sys.executable, "-m", "tools.cli", "plane", "serve", "--spec", str(spec),
                  "--state-dir", str(state), "--dp", "2", "--port", str(port), "--sp-max", "1",
                  "--window", "4", "--global-batch-tokens", "4096",
                  "--micro-batch-tokens", "4096", "--snapshot-every", "2"])
    return plane, plane.wait_for(r"serving (\S+) \(step")[1]


def test_plane_killed_mid_run_restarts_and_nothing_is_lost_or_repeated(demo, tmp_path):
    state, run, port = tmp_path / "plane", tmp_path / "run", free_port()
    procs = []
    try:
        plane, url = serve(demo / "mix.yaml", state, port)
        procs.append(plane)
        sets = {"data.spec": demo / "mix.yaml", "data.workers": 0, "eval.enabled": False,
                "data.global_batch_tokens": 4096, "data.micro_batch_tokens": 4096,
                "optim.warmup_steps": 1, "steps": 10, "checkpoint_every": 5,
                "output_dir": run}
        trainer = Proc([sys.executable, "-m", "tools.cli", "train", "configs/demo_omni.yaml",
                        "--nproc", "2", "--plane", url, "--no-progress",
                        *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]])
        procs.append(trainer)
        trainer.wait_for(r"^step 3/10")
        plane.kill()  # kill -9 while the ranks train on
        plane, url_again = serve(demo / "mix.yaml", state, port)
        procs.append(plane)
        assert url_again == url
        trainer.finish()
    finally:
        for proc in procs:
            proc.kill()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10))
    done = subprocess.run([sys.executable, "-m", "tools.cli", "plane", "audit", str(state),
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["duplicated"] == 0 and report["missing"] == 0, report
    assert report["fingerprint_mismatches"] == [] and report["next_step"] == 10
    # every sample the trainer trained is a committed sample of the audit
    trained = sum(sum(r["mix_samples"].values()) for r in rows)
    assert sum(r["committed"] for r in report["rows"]) == trained > 0


def test_external_plane_for_another_dp_is_one_line(demo, tmp_path, capsys):
    from tools.cli import main

    state, port = tmp_path / "plane", free_port()
    plane, url = serve(demo / "mix.yaml", state, port)
    try:
        rc = main(["train", "configs/demo_omni.yaml", "--plane", url, "--no-progress",
                   "--set", f"data.spec={demo / 'mix.yaml'}", "--set",
                   f"output_dir={tmp_path / 'run'}"])
    finally:
        plane.kill()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"omniscale: error: --plane {url}: the plane plans for --dp 2, "
                               f"this run has --nproc 1"), err
