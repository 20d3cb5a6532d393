"""The plane's Prometheus endpoint: the status numbers, scraped over loopback HTTP, in-process
and from ``omniscale plane serve --metrics-port``."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from omniscale.dataplane.client import PlaneClient
from omniscale.dataplane.metrics import serve_metrics
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from tests.dataplane.plane_steps import commit_step

ROOT = Path(__file__).resolve().parents[2]
CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=2, snapshot_every=4)
TIMEOUT = 60  # the most any one wait on the served process may take



def scrape(url: str) -> dict[str, float]:
    """Sample lines of the exposition, ``name{labels}`` -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def test_metrics_follow_the_plane(demo, tmp_path):
    plane = DataPlane(demo / "mix.yaml", tmp_path, CONFIG)
    server = serve_metrics(plane, "127.0.0.1", 0)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        before = scrape(server.url)
        for step in range(5):
            for rank in range(2):
                plane.get_plan(step, rank)
            commit_step(plane, step)
        after = scrape(server.url)
    finally:
        server.shutdown()
    status = plane.status()
    assert before["omniscale_plane_next_step"] == 0 and before["omniscale_plane_clients"] == 0
    assert after["omniscale_plane_next_step"] == 5
    assert after["omniscale_plane_dp"] == 2 and after["omniscale_plane_clients"] == 2
    assert after["omniscale_plane_plans_ahead_steps"] == status["plans_ahead"]
    assert after["omniscale_plane_last_snapshot_step"] == 4
    for row in status["mixture"]:
        label = f'{{source="{row["source"]}"}}'
        assert after["omniscale_plane_weight" + label] == pytest.approx(row["weight"])
        assert after["omniscale_plane_target_share" + label] == pytest.approx(
            row["target_share"])
        assert after["omniscale_plane_realized_share" + label] == pytest.approx(
            row["realized_share"])
    for row in status["sources"]:
        label = f'{{source="{row["source"]}"}}'
        assert after["omniscale_plane_served_samples_total" + label] == row["served_samples"]
        assert after["omniscale_plane_served_tokens_total" + label] == row["served_tokens"]
    last = next(r for r in status["recent_steps"] if r["step"] == 4)
    assert after['omniscale_plane_step_imbalance{step="last"}'] == pytest.approx(
        last["imbalance"])
    assert after['omniscale_plane_step_max_cost{step="last"}'] == pytest.approx(
        last["max_cost"])
    assert 'omniscale_plane_rank_cost{rank="1"}' in after
    with pytest.raises(OSError):  # shut down: the port no longer answers
        urllib.request.urlopen(server.url, timeout=2)


def next_line(lines: queue.Queue, pattern: str) -> re.Match:
    """Block (up to TIMEOUT) until the served process prints a line matching ``pattern``."""
    while True:
        line = lines.get(timeout=TIMEOUT)
        assert line is not None, f"the plane exited before printing {pattern!r}"
        if match := re.search(pattern, line):
            return match


def test_serve_command_with_metrics_port(demo, tmp_path):
    args = [sys.executable, "-m", "omniscale", "plane", "serve", "--spec",
            str(demo / "mix.yaml"), "--state-dir", str(tmp_path), "--dp", "2", "--window", "4",
            "--global-batch-tokens", "12288", "--micro-batch-tokens", "8192", "--sp-max", "2",
            "--metrics-port", "0"]
    proc = subprocess.Popen(args, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=read, daemon=True).start()
    try:
        # the metrics endpoint binds before the URL is announced
        metrics = next_line(lines, r"metrics at (http://127\.0\.0\.1:\d+/metrics)").group(1)
        url = next_line(lines, r"serving (grpc\+tcp://\S+)").group(1)
        with PlaneClient(url) as client:
            client.get_plan(0, 0)
            client.get_plan(0, 1)
            commit_step(client, 0)
        samples = scrape(metrics)
        assert samples["omniscale_plane_next_step"] == 1
        assert samples["omniscale_plane_clients"] == 2
        assert 'omniscale_plane_served_samples_total{source="text"}' in samples
        proc.send_signal(signal.SIGTERM)
        next_line(lines, r"stopped at step 1")
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_in_use_is_one_line_before_the_url_is_announced(demo, tmp_path, flag):
    """A script (the plane guide's, Slurm's) waits for the "serving" line and then connects:
    a port that cannot be bound must end the plane before that line, in one line."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": "0", "--metrics-port": "0", flag: str(port)}
        done = subprocess.run(
            [sys.executable, "-m", "omniscale", "plane", "serve", "--spec",
             str(demo / "mix.yaml"), "--state-dir", str(tmp_path), "--dp", "2",
             "--global-batch-tokens", "12288", "--micro-batch-tokens", "8192",
             *[a for k, v in ports.items() for a in (k, v)]],
            cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode != 0 and "serving" not in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{flag} {port}: cannot serve there" in lines[0], lines
    assert "Address already in use" in lines[0]
