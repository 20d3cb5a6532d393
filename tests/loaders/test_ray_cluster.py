"""Pool plans fit the cluster they are made for (hand-computed cases; no Ray needed), and the
job's namespace depends only on its run directory; a rank stopped while it joins Ray ends
quietly."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from omniscale.errors import UserError
from omniscale.loaders.ray_cluster import PoolPlan, job_namespace, plan_pools, replan

COSTS = {"text": 0.001, "image": 0.004, "video": 0.05}
SHARES = {"text": 0.5, "image": 0.3, "video": 0.2}
ROOT = Path(__file__).resolve().parents[2]


def test_a_small_machine_gets_fractional_actors_that_pack_onto_its_nodes():
    # 2 CPUs -> 3 actors wanted (one per source at least); by cost x share video gets 3:
    # loads .0005 / .0012 / .01 of .0117 -> round(3 x share) = 0, 0, 3 -> floors of one.
    one_node = plan_pools(COSTS, SHARES, [2.0])
    assert one_node.replicas == {"text": 1, "image": 1, "video": 3}
    assert one_node.actor_cpus == 0.4  # 2 CPUs / 5 actors, and 5 fit on the node
    # The same 2 CPUs as two 1-CPU nodes: 0.4 packs two a node (4 < 5 actors); 0.34 still
    # two; 0.33 packs three a node.
    two_nodes = plan_pools(COSTS, SHARES, [1.0, 1.0])
    assert two_nodes.replicas == one_node.replicas and two_nodes.actor_cpus == 0.33


def test_a_large_machine_gets_whole_cpus_and_capped_pools():
    # 16 CPUs -> 16 actors split by load: 1, 2 and 14 capped at max_replicas 4.
    plan = plan_pools(COSTS, SHARES, [16.0], max_replicas=4)
    assert plan.replicas == {"text": 1, "image": 2, "video": 4}
    assert plan.actor_cpus == 1.0 and plan.cpus == 7.0


def test_asked_cpus_are_kept_and_an_empty_cluster_is_one_line():
    assert plan_pools(COSTS, SHARES, [2.0], actor_cpus=1.5).actor_cpus == 1.5
    for nodes in ([], [0.0]):
        with pytest.raises(UserError, match="no CPUs"):
            plan_pools(COSTS, SHARES, nodes)


def test_the_namespace_is_the_run_directory_s(tmp_path):
    assert job_namespace(tmp_path / "a") == job_namespace(tmp_path / "x" / ".." / "a")
    assert job_namespace(tmp_path / "a") != job_namespace(tmp_path / "b")
    assert job_namespace(tmp_path / "a").startswith("omniscale-")


def test_a_new_mixture_shares_the_same_actors_out_anew():
    before = PoolPlan({"text": 1, "image": 4, "video": 1}, 0.66)
    clips = {"text": 0.01, "image": 0.01, "video": 1.0}
    costs = {"text": 0.001, "image": 0.004, "video": 0.02}
    # six actors by load: video's share of the load is 99.7% -> 6, capped at 4; the others
    # keep their one; three 0.66-CPU actors fit on each 2-CPU node
    after = replan(before, costs, clips, [2.0, 2.0], max_replicas=4)
    assert after == PoolPlan({"text": 1, "image": 1, "video": 4}, 0.66)
    # a node gone: room for three, taken from the largest pool
    assert replan(before, costs, clips, [2.0], max_replicas=4).replicas == \
        {"text": 1, "image": 1, "video": 1}


# ray.init as Ray's runs it, seen from the signals: its handler installed first (it prints a
# stack dump), then -- as when the launcher stops this rank mid-init -- SIGTERM arrives
_STOPPED_MID_INIT = """
import os, signal, sys
import ray
from omniscale.loaders import ray_cluster

def noisy(*_):
    print("*** SIGTERM received", flush=True)

def init(**_):
    signal.signal(signal.SIGTERM, noisy)
    os.kill(os.getpid(), signal.SIGTERM)

ray.is_initialized, ray.init = (lambda: False), init
ray_cluster.reachable = ray_cluster._token_auth_if_at_hand = lambda address: None
ray_cluster.connect("auto", "job")
print("went on", flush=True)
"""


def test_a_rank_stopped_while_it_joins_ray_ends_quietly():
    """SIGTERM during ray.init waits for it and then ends the rank by the default action: no
    stack dump from Ray's handler, and the rank does not go on either."""
    done = subprocess.run([sys.executable, "-c", _STOPPED_MID_INIT], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == "" and "Traceback" not in done.stderr, (done.stdout, done.stderr)
