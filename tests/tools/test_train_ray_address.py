"""``omniscale train --ray-address`` with no cluster behind the address is one line, not a
hang (joining a cluster that is there: tests/tools/test_train_ray_cluster.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.timeout(120)
def test_an_address_without_a_cluster_is_one_line(demo, tmp_path):
    done = subprocess.run([*TRAIN, "--ray-address", "127.0.0.1:9", *_sets(demo, tmp_path / "x")],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("omniscale: error: data.ray_address '127.0.0.1:9': no Ray cluster "
                           "to join"), done.stderr[-2000:]
