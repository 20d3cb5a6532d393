"""The trainer tests read the suite's shared demo (tests/conftest.py); a test that damages
data makes its own copy."""

from __future__ import annotations

import pytest

from tests.run_once import once_per_run


@pytest.fixture(scope="session")
def demo(demo_root):
    return demo_root


@pytest.fixture(scope="session")
def every_source_one(demo, tmp_path_factory, worker_id):
    """One process over every demo source from step 0, the aux router loss off (z-loss on):
    (every source spec, extra settings, rows of 4 steps, step 0's gradients). The reference
    the multi-process layouts are compared with; a 3-step run's rows are its first three
    (the learning rate's schedule is fixed by ``optim.decay_steps``, not by ``steps``). Run
    once for all xdist workers."""
    from tests.tools.train_runs import TINY_MOE, every_source
    from tests.tools.train_runs import run_omni as _run

    def build(root):
        extra = {"data.spec": every_source(demo, root / "every.yaml"),
                 "model.overrides.moe": TINY_MOE + ", aux_loss_coef: 0}"}
        rows, grads = _run(demo, root / "one", 1, **extra, steps=4)
        return extra, rows, grads
    return once_per_run(tmp_path_factory, worker_id, "every-source-one", build)


@pytest.fixture(scope="session")
def omni_one(demo, tmp_path_factory, worker_id):
    """One process on the demo mix with ``run_omni``'s settings (router losses on), 4 steps:
    (rows, step 0's gradients). The reference of the 2-rank media test and the expert-parallel
    test, run once for both (and for all xdist workers); a 3-step run's rows are its first
    three (see above)."""
    from tests.tools.train_runs import run_omni as _run

    return once_per_run(tmp_path_factory, worker_id, "omni-one",
                        lambda root: _run(demo, root / "one", 1, steps=4))
