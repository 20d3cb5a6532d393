"""A rank joins the job's cluster with token auth as the cluster has it
(``ray_cluster.connect``): a token at hand (``~/.ray/auth_token``) turns token auth on only
where the cluster asks for one. Two ``ray start`` heads, one without token auth and one with;
each rank is a fresh process without ``RAY_AUTH_MODE``, with a token in a HOME of its own,
and starts an actor (on a cluster without token auth, a rank that turned it on had its
actors cancelled before they started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.loaders.ray_fixtures import ray_env, ray_start_head

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")

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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["disabled", "token"])
def test_a_rank_takes_the_cluster_s_token_auth_mode(mode, tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = ray_env(HOME=str(home))
    with ray_start_head({**env, "RAY_AUTH_MODE": mode}, "--num-cpus=1") as address:
        rank = subprocess.run([sys.executable, "-c", RANK, address], env=env,
                              capture_output=True, text=True, timeout=180)
    assert rank.returncode == 0, rank.stdout[-1000:] + rank.stderr[-3000:]
    want = "token" if mode == "token" else "None"
    assert rank.stdout.split()[-2:] == [want, "ran"], rank.stdout
    assert "gcs_client" not in rank.stderr  # the probe's refusal is not printed
