"""The data side of one job on a local three-node Ray cluster (``ray.cluster_utils.Cluster``,
one CPU a node): the plane as a Ray actor on the head node (its CPU taken by the actor), the
decoding pools of two trainer processes on the two other nodes, one of those removed after
step 1 -- training finishes, the plane's audit is clean, and every step's loss and mix equal
the run that decodes in worker processes with an embedded plane (the same plans: decoding
by reference either way)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import ray
from ray.cluster_utils import Cluster

from omniscale.dataplane.client import PlaneClient
from omniscale.dataplane.ray_actor import start_on_ray
from omniscale.dataplane.spec import load_spec
from omniscale.tools.train.build import model_config
from omniscale.tools.train.config import load_config
from omniscale.tools.train.launch import train
from omniscale.tools.train.loop import plane_config
from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import few_sources

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")

CONFIG = "configs/demo_omni.yaml"
STEPS = 4


def _sets(mix, out, **extra) -> dict:
    return {"data.spec": mix, "data.workers": 1, "steps": STEPS, "checkpoint_every": STEPS,
            "output_dir": out, "eval.enabled": False, "optim.warmup_steps": 1,
            "data.global_batch_tokens": 4096, "data.micro_batch_tokens": 4096, **extra}


def _remove_after(cluster, node, url: str, step: int, done: threading.Event, removed: list):
    """Remove ``node`` once the plane has seen ``step`` committed (its status, polled)."""
    with PlaneClient(url) as client:
        while not done.wait(0.2):
            if client.status()["next_step"] > step:
                cluster.remove_node(node)
                removed.append(step)
                return


@pytest.mark.timeout(420)
def test_plane_actor_and_two_trainers_on_three_nodes_lose_one_and_train_alike(demo, tmp_path):
    mix = few_sources(demo, tmp_path / "mix.yaml")
    reference = tmp_path / "workers"
    train(CONFIG, nproc=2, progress=False,
          sets=[f"{k}={v}" for k, v in _sets(mix, reference).items()])

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    done, removed = threading.Event(), []
    try:
        ray.init(address=cluster.address, namespace="one-job", include_dashboard=False,
                 log_to_driver=False)
        cluster.wait_for_nodes()
        # the plane the trainers would embed, as an actor pinned to this (the head) node
        cfg, _ = load_config(CONFIG, [f"{k}={v}" for k, v in _sets(mix, tmp_path).items()])
        spec = load_spec(mix)
        cost = model_config(cfg, spec.media, spec.tokenizer).cost_coefficients()
        actor, url = start_on_ray(mix, tmp_path / "plane", plane_config(cfg, 2, cost),
                                  name="plane")
        watcher = threading.Thread(target=_remove_after,
                                   args=(cluster, workers[0], url, 1, done, removed))
        watcher.start()
        run = tmp_path / "ray"
        args = [a for k, v in _sets(mix, run, **{"data.loader": "ray",
                                                 "data.ray_actor_cpus": 0.25}).items()
                for a in ("--set", f"{k}={v}")]
        trained = subprocess.run(
            [sys.executable, "-m", "omniscale", "train", CONFIG, "--nproc", "2", "--no-progress",
             "--plane", url, "--ray-address", cluster.address, *args],
            capture_output=True, text=True, timeout=360,
            # the ranks' token auth as the cluster's, said outright: its nodes inherited this
            # process's RAY_AUTH_MODE ("token" once an earlier Ray test here started a local
            # instance). Unset, the ranks would ask the cluster (tests/loaders/test_ray_auth.py)
            env={**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")})
        done.set()
        watcher.join()
        assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
        with PlaneClient(url) as client:
            audit = client.audit()
            assert client.status()["next_step"] == STEPS
        ray.get(actor.stop.remote(), timeout=60)
    finally:
        done.set()
        ray.shutdown()
        cluster.shutdown()
    assert "Started a local Ray instance" not in trained.stderr  # the ranks joined ours
    assert removed == [1]  # the node went while the run was on its third step or later
    assert (audit["duplicated"], audit["missing"]) == (0, 0), audit
    rows, want = read_metrics(run / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [(r["loss"], r["mix_samples"]) for r in rows] == \
        [(r["loss"], r["mix_samples"]) for r in want]
    pools = rows[-1]["data_pools"]
    # the lost node's actors were replaced, or, where the node left (its one CPU; the head's
    # is the plane's) had no room, their pools went on without them (counted for the job,
    # whichever rank met the death). Not asserted: that rank 0's layout fits the CPU left --
    # it is the layout rank 0 last took, and a death met by rank 1, or in a pool no sample
    # used after the loss, shows there only at the next window, after this run's last step
    # (it failed so once); tests/loaders/test_ray_resize.py checks that no lost actor is left
    # in the pools once a window has passed. Nor that the death is in the last row: the
    # loaders decode ahead of training, past the run's last step too (the plane plans on),
    # and when the first flight to reach a dead actor is one of those, the death is met and
    # decided after the last row was written (CI met it so once: the row's counts 0, with
    # image_caption samples of the read-ahead in flight) -- then the rank's warning says it.
    counted = pools["actor_restarts"] + pools["actors_retired"]
    decided = re.search(r"a decoding actor of source '\w+' died \(\w+\); (replaced|not replaced)",
                        trained.stderr)
    assert counted >= 1 or decided, (pools, trained.stderr[-3000:])
