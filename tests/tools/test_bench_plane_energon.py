"""The plane bench's measured peer (tools/bench/plane_energon.py): Energon's loader really runs
with the workers asked, draws every source, and its worker memory does not grow with the
samples per shard -- the premise that lets the bench write 10 samples per shard, not 1,000."""

from __future__ import annotations

import pytest

from omniscale.tools.bench.plane import _fit
from omniscale.tools.bench.plane_energon import energon_memory


@pytest.mark.slow
def test_energon_workers_are_measured_over_every_source(tmp_path):
    out = energon_memory(tmp_path, sources=3, shards=2, procs=(1, 2), fit=_fit,
                         processes=256, check_per_shard=50)
    assert set(out["workers"]["measured"]) == {"1", "2"}
    # what a worker adds: the slope of the rank's total, counted for 256 workers
    slope = out["workers"]["measured"]["2"] - out["workers"]["measured"]["1"]
    assert out["workers"]["workers_bytes"] == pytest.approx(256 * slope)
    assert out["workers"]["bytes_per_process"] > 10 * 2 ** 20  # a worker is a process
    check = out["per_shard_check"]
    assert set(check["bytes_per_worker"]) == {"10", "50"}
    assert abs(check["growth"]) < 0.05, check  # 5x the samples per shard: same worker memory
    assert out["sources_drawn"] == 3  # in every run, before it was measured
