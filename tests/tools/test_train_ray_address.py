"""``omniscale train --ray-address`` joins an existing Ray cluster for its decoding pools
(the launcher starts none), and an address with no cluster behind it is one line, not a
hang."""

from __future__ import annotations

import subprocess
import sys

import pytest
import ray

from omniscale.tools.train.metrics import read_metrics
from tests.tools.train_runs import few_sources

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")

TRAIN = [sys.executable, "-m", "omniscale", "train", "configs/demo_omni.yaml", "--no-progress"]


def _sets(demo, out) -> list[str]:
    # three of the demo's sources: three decoding actors to start, not six
    spec = few_sources(demo, out.parent / f"{out.name}-mix.yaml")
    sets = {"data.spec": spec, "data.workers": 1, "steps": 2,
            "checkpoint_every": 3, "output_dir": out, "eval.enabled": False,
            "data.global_batch_tokens": 4096, "data.micro_batch_tokens": 4096}
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


@pytest.mark.timeout(300)
def test_train_joins_the_cluster_it_is_given(demo, tmp_path):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        done = subprocess.run([*TRAIN, "--ray-address", address, *_sets(demo, tmp_path / "r")],
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Started a local Ray instance" not in done.stderr  # it joined ours
        cpus = ray.cluster_resources()["CPU"]
    finally:
        ray.shutdown()
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and "data_pools" in rows[-1]
    assert min(rows[-1]["data_pools"]["actors"].values()) >= 1 and cpus == 2


@pytest.mark.timeout(120)
def test_an_address_without_a_cluster_is_one_line(demo, tmp_path):
    done = subprocess.run([*TRAIN, "--ray-address", "127.0.0.1:9", *_sets(demo, tmp_path / "x")],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("omniscale: error: data.ray_address '127.0.0.1:9': no Ray cluster "
                           "to join"), done.stderr[-2000:]
