"""tools/warm_kernels.py: after it, a data plane planning a real mixture with every policy, the
long-short split and rank speeds loads every numba kernel it calls from the cache and compiles
none (numba's own per-kernel cache counters say so, in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from omniscale.tools.warm_kernels import warm
from tests.demo_data import copy_demo

PLANE_RUN = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    from pathlib import Path

    from numba.core.registry import CPUDispatcher

    import omniscale.balancer, omniscale.dataplane
    from omniscale.dataplane.plane import DataPlane, PlaneConfig
    from omniscale.dataplane.plane_config import POLICIES

    spec, state = Path(sys.argv[1]), Path(sys.argv[2])
    for policy in POLICIES:
        plane = DataPlane(spec, state / policy, PlaneConfig(
            dp=2, micro_batch_tokens=1024, window=2, global_batch_tokens=4096, sp_max=2,
            balance=policy))
        for step in range(4):
            for rank in range(2):
                plane.get_plan(step, rank)
        if policy == "omniscale":
            plane.set_speeds(3, [1.0, 0.5])
            for rank in range(2):
                plane.get_plan(4, rank)
    misses, kernels = {}, 0
    for package in (omniscale.balancer, omniscale.dataplane):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if isinstance(value, CPUDispatcher) and value.__module__ == info.name:
                    kernels += 1
                    missed = sum(value.stats.cache_misses.values())
                    if missed:
                        misses[f"{info.name}.{name}"] = missed
    print(json.dumps({"kernels": kernels, "misses": misses}))
""")


def test_a_plane_after_the_warm_compiles_no_kernel(demo_root, tmp_path):
    warm(progress=lambda line: None)  # a load only when the suite's controller warmed them
    demo = copy_demo(demo_root, tmp_path / "demo")
    run = subprocess.run([sys.executable, "-c", PLANE_RUN, str(demo / "mix.yaml"),
                          str(tmp_path / "state")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["kernels"] >= 30, result  # the planner's, the baselines' and the mixer's
    assert result["misses"] == {}, result
