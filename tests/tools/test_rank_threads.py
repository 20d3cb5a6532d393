"""A rank's torch threads (``loop.rank_threads``): its share of the cores, capped by the CPUs it
may run on and by ``OMP_NUM_THREADS`` when set -- checked against hand-counted cases."""

from __future__ import annotations

import pytest

from omniscale.tools.train import loop


@pytest.mark.parametrize("cpus, allowed, world, omp, want", [
    (16, 16, 2, None, 8),   # a share of the cores
    (16, 16, 3, None, 5),   # rounded down
    (16, 16, 32, None, 1),  # more ranks than cores: one each, never 0
    (16, 2, 2, None, 2),    # pinned to two CPUs (taskset, OMNISCALE_CPU_BIND)
    (16, 16, 2, "3", 3),    # OMP_NUM_THREADS caps it
    (16, 16, 2, "12", 8),   # ... but never raises it above the share
    (16, 16, 2, "0", 8),    # not a thread count: ignored
    (16, 16, 2, "two", 8),
])
def test_threads_are_the_share_capped_by_affinity_and_omp(monkeypatch, cpus, allowed, world,
                                                           omp, want):
    monkeypatch.setattr(loop.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(loop.os, "sched_getaffinity", lambda pid: set(range(allowed)))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert loop.rank_threads(world) == want
