"""A killed loader worker is replaced: ``kill -9`` of a DataLoader worker mid-run leaves the
StepBatches exactly those of a run without the kill; a sample that kills its decoder every
time ends the loader with a clear error instead of looping."""

from __future__ import annotations

import os
import signal

import pytest

from omniscale.dataplane.embedded import start_embedded
from omniscale.loaders import pipeline
from omniscale.loaders.chunk_worker import RefDataset
from omniscale.loaders.pipeline import RankLoader
from omniscale.plan import fingerprint
from omniscale.tools.train.plane_session import loader_for
from tests.loaders.pipeline_fixtures import CONFIG, assert_same_batch, loader_args, spec_of

STEPS = 8  # enough that steps after the kill need items the killed worker was sent
KILL_AFTER = 2
RANK = 1


@pytest.fixture(scope="module")
def demo(pipeline_demo):
    return spec_of(pipeline_demo / "all.yaml")


def run(spec, state_dir, kill: bool):
    """STEPS batches of RANK's loader (2 workers), each committed; with ``kill``, one worker
    is sent SIGKILL after KILL_AFTER of them. Returns the batches, the loader, the killed
    pid and the worker pids after the last step."""
    batches, killed = [], None
    with start_embedded(spec.path, state_dir, CONFIG) as plane:
        loader = loader_for(plane.url, RANK, RankLoader, **loader_args(spec), num_workers=2,
                            prefetch_steps=2)
        with loader:
            for step in range(STEPS):
                if kill and step == KILL_AFTER:
                    pids = loader.worker_pids()
                    assert len(pids) == 2
                    killed = pids[0]
                    os.kill(killed, signal.SIGKILL)
                batch = next(loader)
                assert batch.step == step
                batches.append(batch)
                loader.commit(step)
                # the other rank commits too, so the plane keeps planning ahead
                other = plane.plane.get_plan(step, 1 - RANK)
                plane.plane.commit(step, 1 - RANK, fingerprint(other))
            pids = loader.worker_pids()
    return batches, loader, killed, pids


@pytest.mark.timeout(120)
def test_killed_worker_is_replaced_and_batches_unchanged(demo, tmp_path):
    want, loader, _, _ = run(demo, tmp_path / "reference", kill=False)
    assert loader.worker_restarts == 0
    with pytest.warns(RuntimeWarning, match=r"new workers decode again from step") as record:
        got, loader, killed, pids_after = run(demo, tmp_path / "killed", kill=True)
    assert loader.worker_restarts == 1
    assert len(pids_after) == 2 and killed not in pids_after
    lines = [str(w.message) for w in record if "new workers" in str(w.message)]
    assert len(lines) == 1 and lines[0].startswith(f"rank {RANK}: DataLoader worker (pid "
                                                   f"{killed}) died; new workers decode "
                                                   "again from step "), lines
    for a, b in zip(got, want, strict=True):
        assert (a.step, a.plan_fp, a.metadata) == (b.step, b.plan_fp, b.metadata)
        assert (a.skipped, a.replaced) == (b.skipped, b.replaced) == ([], [])
        for mb_got, mb_want in zip(a.micro_batches, b.micro_batches, strict=True):
            assert_same_batch(mb_got, mb_want)
        assert len(a.encode_items) == len(b.encode_items)
        for x, y in zip(a.encode_items, b.encode_items):
            assert (x.ref, x.kind, x.index, x.consume_rank, x.grid_thw, x.frames) == \
                (y.ref, y.kind, y.index, y.consume_rank, y.grid_thw, y.frames)
            assert x.tensor.dtype == y.tensor.dtype and x.tensor.equal(y.tensor)


class _KillsOnStep0(RefDataset):
    """A decoder that dies (SIGKILL to its own process) on every item of step 0."""

    def __getitem__(self, item):
        (step, _), _ = item
        if step == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(item)


@pytest.mark.timeout(90)
def test_a_step_that_kills_every_worker_gives_up(demo, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "RefDataset", _KillsOnStep0)  # forked workers inherit it
    with start_embedded(demo.path, tmp_path, CONFIG) as plane:
        loader = loader_for(plane.url, 0, RankLoader, **loader_args(demo), num_workers=2,
                            max_worker_restarts=2)
        with loader, pytest.warns(RuntimeWarning, match="died"):
            with pytest.raises(RuntimeError, match=r"rank 0: DataLoader worker .* died while "
                                                   r"on step 0, 3 times in a row; giving up"):
                next(loader)
            assert loader.worker_restarts == 2
