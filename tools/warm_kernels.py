"""Compile the planner's and the mixer's numba kernels into numba's on-disk cache, ahead of the
first run that needs them.

Every kernel is ``@njit(cache=True)``: compiled on its first call with a new signature, then
loaded from ``__pycache__`` beside its source by every later process. On a fresh clone nothing is
cached, and the first processes to plan (a run's plane, every test worker, every bench) each
compile the same kernels at once: about 40 s of CPU apiece on this project's CPU machines,
against 1-2 s to load them. ``tools/setup.sh`` runs this once after installing, and the test
suite's controller runs it before its workers start (a cached kernel costs it only the load).

It plans small windows the way a run does -- the planner and every baseline policy, with and
without the long-short split, rank speeds and media items of every kind -- and draws batches from
a mixture of synthetic sources in each accounting, so each kernel meets the argument types a run
gives it. A kernel a run later calls with other types compiles then, as before: this only moves
work earlier, it changes no result.

    python -m omniscale.tools.warm_kernels
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path


def _plan_windows() -> None:
    import dataclasses

    import numpy as np

    from omniscale.balancer.cost import CostModel, Costs
    from omniscale.balancer.distributions import generate
    from omniscale.balancer.types import PlannerConfig
    from omniscale.dataplane.plane_config import POLICIES
    from omniscale.dataplane.windows import plan_policy

    costs = Costs(llm=CostModel(1.0, 1e-3), encoders=(CostModel(1.0, 1e-4, 1.0),) * 3,
                  sp_comm_per_token=0.1, reshard_per_token=0.1, micro_batch=50.0)
    for dist in ("omni", "bimodal"):
        samples = generate(dist, 64, seed=0)  # two global batches of 32 samples
        samples = dataclasses.replace(samples, batch_N=np.arange(64, dtype=np.int32) // 32)
        longest = int(samples.tokens_N.max())
        for sp_max, budget in ((2, (longest + 1) // 2), (1, longest)):  # split, and none
            for speeds in (None, (1.0, 0.5)):
                config = PlannerConfig(dp=2, micro_batch_tokens=budget, window=2,
                                       sp_max=sp_max, rank_speed=speeds)
                for policy in POLICIES:
                    plan_policy(samples, costs, config, policy)


def _draw_batches() -> None:
    from omniscale.dataplane.catalog import Catalog
    from omniscale.dataplane.mixer import Mixer
    from omniscale.dataplane.schedule import Schedule, Segment
    from omniscale.dataplane.spec import load_spec
    from omniscale.tools.bench.plane_data import write_sources, write_spec

    with tempfile.TemporaryDirectory(prefix="omniscale-warm-") as tmp:
        root = Path(tmp)
        spec_path = write_spec(root / "mix.yaml", write_sources(root, 3, 2, 8, max_tokens=64))
        spec = load_spec(spec_path)
        names = spec.schedule.sources
        w0, w1 = {n: 1.0 for n in names}, {n: float(i + 1) for i, n in enumerate(names)}
        ramp = Schedule(names, (Segment("linear", 0, 10**6, w0, w1),
                                Segment("const", 10**6, None, w1, w1)), "tokens")
        for schedule in (spec.schedule, ramp):  # a ramp over tokens: the kernel's ramp_row
            for accounting in ("samples", "tokens", "target_tokens"):
                for batch in ({"global_batch_samples": 6}, {"global_batch_tokens": 256}):
                    mixer = Mixer(Catalog.from_spec(spec), schedule, accounting, **batch)
                    for step in range(3):
                        mixer.next_batch(step)


def warm(progress=print) -> float:
    """Compile (or load) every kernel a run calls; the seconds it took."""
    started = time.perf_counter()
    _plan_windows()
    _draw_batches()
    seconds = time.perf_counter() - started
    progress(f"numba kernels compiled or loaded from their cache in {seconds:.1f} s")
    return seconds


def main() -> int:
    warm()
    return 0


if __name__ == "__main__":
    sys.exit(main())
