"""A rank joins the job's cluster with token auth as the cluster has it
(``ray_cluster.connect``): a token at hand (``~/.ray/auth_token``) turns token auth on only
where the cluster asks for one. Two ``ray start`` heads, one without token auth and one with;
each rank is a fresh process without ``RAY_AUTH_MODE``, with a token in a HOME of its own,
and starts an actor (on a cluster without token auth, a rank that turned it on had its
actors cancelled before they started)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")

RAY = str(Path(sys.executable).with_name("ray"))
RANK = """
import os, sys
import ray
from omniscale.loaders.ray_cluster import connect

connect(sys.argv[1], "auth-test")

@ray.remote(num_cpus=0)
class Probe:
    def ping(self):
        return "ran"

print(os.environ.get("RAY_AUTH_MODE"), ray.get(Probe.remote().ping.remote(), timeout=60))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(port: int) -> None:
    """Every process of the head at ``port`` (``ray stop`` would stop every cluster here)."""
    mine = [p for p in psutil.process_iter(["cmdline"])
            if any(f":{port}" in arg and ("gcs" in arg or "port" in arg)
                   for arg in p.info["cmdline"] or [])]
    for p in mine:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(mine, timeout=30)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["disabled", "token"])
def test_a_rank_takes_the_cluster_s_token_auth_mode(mode, tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_AUTH") and k not in ("RAY_ADDRESS",)}
    env["HOME"] = str(home)
    port = _free_port()
    # a temp dir of its own (short: Ray's socket paths): `ray start` leaves the head's address
    # in TEMP_DIR/ray_current_cluster, where a later ray.init() of any test would find it
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    started = subprocess.run(
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp}"], env={**env, "RAY_AUTH_MODE": mode},
        capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        rank = subprocess.run([sys.executable, "-c", RANK, f"127.0.0.1:{port}"], env=env,
                              capture_output=True, text=True, timeout=180)
    finally:
        _stop(port)
        shutil.rmtree(temp, ignore_errors=True)
    assert rank.returncode == 0, rank.stdout[-1000:] + rank.stderr[-3000:]
    want = "token" if mode == "token" else "None"
    assert rank.stdout.split()[-2:] == [want, "ran"], rank.stdout
    assert "gcs_client" not in rank.stderr  # the probe's refusal is not printed
