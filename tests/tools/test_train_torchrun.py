"""``omniscale train`` under ``torchrun``: each process is one rank (env:// rendezvous), rank 0
prepares the data and embeds the plane on one node; several nodes need ``--plane``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniscale.errors import UserError
from omniscale.tools.train.launch import train
from omniscale.tools.train.metrics import read_metrics
from omniscale.tools.train.torchrun import torchrun_layout
from tests.procs import free_port
from tests.tools.train_runs import few_sources

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mix(demo, tmp_path_factory):
    """Three of the demo's sources: on Ray, three decoding actors to start, not six."""
    return few_sources(demo, tmp_path_factory.mktemp("spec") / "mix.yaml")


def _sets(mix, out) -> dict:
    return {"data.spec": mix, "data.workers": 0, "eval.enabled": False,
            "data.global_batch_tokens": 8192, "data.micro_batch_tokens": 4096,
            "optim.warmup_steps": 1, "steps": 2, "output_dir": out}


@pytest.fixture(scope="module")
def spawned(mix, tmp_path_factory):
    """Two spawned ranks decoding in worker processes: the rows the other launches match."""
    out = tmp_path_factory.mktemp("spawned") / "run"
    train("configs/demo_omni.yaml", nproc=2, progress=False,
          sets=[f"{k}={v}" for k, v in _sets(mix, out).items()])
    return read_metrics(out / "metrics.jsonl")


def test_spawned_ranks_on_ray_defaults_train_what_worker_processes_do(mix, spawned, tmp_path):
    """Two ranks with the Ray defaults on this 2-core machine (once a silent hang): the
    launcher starts the job's Ray instance, rank 0 plans pools that fit in it, rank 1 uses
    them. Same plans, decoding by reference either way: the losses must be identical."""
    out = tmp_path / "ray"
    train("configs/demo_omni.yaml", nproc=2, progress=False,
          sets=[f"{k}={v}" for k, v in {**_sets(mix, out), "data.loader": "ray"}.items()])
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["loss"] for r in rows] == [r["loss"] for r in spawned]
    pools = rows[-1]["data_pools"]  # what the metrics say of the pools
    assert set(pools["actors"]) == set(pools["in_flight"]) and min(pools["actors"].values()) >= 1
    assert "data_pools" not in spawned[-1]


def test_torchrun_script_s_two_ranks_train_what_spawned_ranks_do(mix, spawned, tmp_path):
    """Also on Ray pools, with no address: rank 0 starts the job's Ray instance, rank 1 joins
    it (the batches are those of the spawned ranks' worker processes)."""
    out = tmp_path / "torchrun"
    args = [a for k, v in {**_sets(mix, out), "data.loader": "ray"}.items()
            for a in ("--set", f"{k}={v}")]
    # through the launch script a user copies (tools/launch/torchrun.sh: torchrun's c10d
    # rendezvous on this node, the plane embedded by rank 0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PLANE_"))}
    done = subprocess.run([str(ROOT / "tools" / "launch" / "torchrun.sh"),
                           "configs/demo_omni.yaml", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**env, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable,
                               "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 2/2" in done.stdout and (out / "result.json").is_file()
    assert (out / "plane" / "wal.jsonl").is_file()  # rank 0 embedded the plane
    got = read_metrics(out / "metrics.jsonl")
    assert [len(r["rank_compute_s"]) for r in got] == [2, 2]
    assert min(got[-1]["data_pools"]["actors"].values()) >= 1
    for a, b in zip(got, spawned, strict=True):
        assert a["mix_samples"] == b["mix_samples"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6)
    assert json.loads((out / "result.json").read_text())["steps"] == 2


def test_several_nodes_without_an_external_plane_is_one_line(monkeypatch):
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UserError, match=r"4 ranks on 2 nodes: give --plane URL"):
        torchrun_layout(1, None)
    assert torchrun_layout(1, "grpc+tcp://node0:8815") == (3, 4)
    with pytest.raises(UserError, match="--nproc 2: under torchrun"):
        torchrun_layout(2, "grpc+tcp://node0:8815")


@pytest.mark.timeout(240)
def test_unplaceable_actors_end_the_run_with_one_line(mix, tmp_path):
    """The README's command asking 64 CPUs per decoding actor: rank 0 refuses at once (no node
    has 64), the launcher stops rank 1, and what the user sees is the one line that says why
    -- no traceback, no stack dump from Ray's signal handler in the rank that was stopped."""
    args = [a for k, v in {**_sets(mix, tmp_path / "run"), "data.loader": "ray",
                           "data.ray_actor_cpus": 64}.items() for a in ("--set", f"{k}={v}")]
    done = subprocess.run([sys.executable, "-m", "omniscale", "train", "configs/demo_omni.yaml",
                           "--nproc", "2", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [line for line in errors if line.startswith("omniscale: error: ")], \
        done.stderr[-3000:]
    assert len(errors) == 1 and "64 CPU each" in errors[0] and "no node has 64 CPUs" in errors[0]
    assert "Traceback" not in done.stderr and "SIGTERM" not in done.stderr, done.stderr[-3000:]
