"""Done means: plan -> workers -> PackedBatch on the tiny demo, checked against decoding each
planned sample on its own, for every modality; plus the loader's own promises (prefetch,
commit with the plan fingerprint, data-wait timing, end of data)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from omniscale.dataplane.client import PlaneClient
from omniscale.dataplane.embedded import start_embedded
from omniscale.loaders.collate import media_tensor
from omniscale.loaders.pipeline import RankLoader
from omniscale.tools.train.plane_session import loader_for
from tests.loaders.decode_fixtures import demo_decoder
from tests.loaders.pipeline_fixtures import (
    CONFIG,
    assert_same_batch,
    expected_batches,
    loader_args,
    modalities,
    spec_of,
)

STEPS = 6


@pytest.fixture(scope="module")
def demo(pipeline_demo):
    return spec_of(pipeline_demo / "all.yaml")


class _MemoDecoder:
    """Per-sample decoding (the oracle), each ref decoded once per spec in the session: an
    encoder item's sample is also a micro-batch's, and tests on one spec draw the same first
    steps (the oracle's decoding was a third of a Ray test's time)."""

    _decoded: dict = {}  # (spec file, ref) -> DecodedSample

    def __init__(self, spec) -> None:
        self.spec, self.decoder = spec, None

    def decode(self, ref):
        key = (str(self.spec.path), ref)
        if key not in self._decoded:
            if self.decoder is None:
                self.decoder = demo_decoder(self.spec)
            if len(self._decoded) > 2048:  # bounded: decoded media are megabytes
                self._decoded.clear()
            self._decoded[key] = self.decoder.decode(ref)
        return self._decoded[key]


def check_full_path(spec, state_dir, make_loader, after_step=None, steps: int = STEPS,
                    config=CONFIG) -> set[str]:
    """Two ranks through ``make_loader(url, rank)`` for ``steps`` steps of a plane with
    ``config``; every micro-batch and encoder item equal to per-sample decoding; every step
    committed by both; the audit exactly-once. ``after_step(step, loaders)`` runs after each
    step's commits (to break something)."""
    seen: set[str] = set()
    decoder = _MemoDecoder(spec)
    with start_embedded(spec.path, state_dir, config) as plane, \
            PlaneClient(plane.url) as client:
        loaders = [make_loader(plane.url, r) for r in range(2)]
        try:
            for step in range(steps):
                for rank, loader in enumerate(loaders):
                    batch = next(loader)
                    table = client.get_plan(step, rank)
                    assert batch.step == step and batch.data_wait_s >= 0
                    assert batch.metadata["num_micro_batches"] == len(batch.micro_batches)
                    assert not batch.skipped
                    want = expected_batches(table, decoder, spec.media)
                    for got, expected in zip(batch.micro_batches, want, strict=True):
                        assert_same_batch(got, expected)
                        seen |= modalities(got)
                    for item in batch.encode_items:
                        sample = decoder.decode(item.ref)
                        media = [m for m in sample.media if m.kind == item.kind][item.index]
                        assert torch.equal(item.tensor, media_tensor(media))
                        assert (item.grid_thw, item.frames) == (media.grid_thw, media.frames)
                    n_encode = sum(r == "encode" for r in table.column("role").to_pylist())
                    assert len(batch.encode_items) == n_encode
                for loader in loaders:
                    loader.commit(step)
                if after_step is not None:
                    after_step(step, loaders)
            for loader in loaders:
                loader.wait_commits()  # commits are sent in the background
            assert client.status()["next_step"] == steps
        finally:
            for loader in loaders:
                loader.close()
        report = plane.plane.audit()
    assert (report["duplicated"], report["missing"], report["fingerprint_mismatches"]) == \
        (0, 0, [])
    return seen


@pytest.mark.timeout(90)
def test_full_path_matches_per_sample_decoding(demo, tmp_path):
    def make(url, rank):
        return loader_for(url, rank, RankLoader, **loader_args(demo), num_workers=2,
                          prefetch_steps=2)
    seen = check_full_path(demo, tmp_path, make)
    assert seen == {"text", "image", "video", "audio"}


@pytest.mark.timeout(120)
def test_workers_do_not_wait_past_what_the_plane_plans(demo, tmp_path):
    """A plane that plans only the step not yet committed (window 1, nothing ahead) while
    the DataLoader asks for 2 items per worker: the loader must hand out what is planned and
    wait for plans only when it holds nothing (it used to wait inside torch's index request,
    for a plan that needed the commit of the item in hand, and hung)."""
    def make(url, rank):
        return loader_for(url, rank, RankLoader, **loader_args(demo), num_workers=2,
                          prefetch_steps=2)
    check_full_path(demo, tmp_path, make, steps=4,
                    config=dataclasses.replace(CONFIG, window=1, plan_ahead=0))


@pytest.mark.timeout(60)
def test_in_process_decoding_and_steps_in_order(demo, tmp_path):
    """num_workers=0 decodes on the assembly thread; step(s) passes earlier steps over."""
    decoder = demo_decoder(demo)
    with start_embedded(demo.path, tmp_path, CONFIG) as plane, PlaneClient(plane.url) as c:
        loader = loader_for(plane.url, 1, RankLoader, **loader_args(demo), num_workers=0)
        with loader:
            batch = loader.step(2)  # steps 0 and 1 are passed over
            for got, want in zip(batch.micro_batches,
                                 expected_batches(c.get_plan(2, 1), decoder, demo.media)):
                assert_same_batch(got, want)
            with pytest.raises(ValueError, match="this loader is at step 3"):
                loader.step(1)


def _served_through(client, step: int, deadline_s: float = 30.0) -> None:
    """Wait until the plane has served ``step`` (the loaders' read-ahead fetched it)."""
    end = time.monotonic() + deadline_s
    while client.status()["served_max_step"] < step:
        assert time.monotonic() < end, f"step {step} was never fetched ahead"
        time.sleep(0.01)  # polling the plane's own count, not a sleep standing in for one


@pytest.mark.timeout(120)
def test_steps_replanned_after_the_loaders_fetched_them_are_fetched_again(demo, tmp_path):
    """Speeds that apply from the next step no rank has started (``set_speeds`` with
    ``from_step``), after both loaders fetched and decoded steps past it: each loader drops
    what it holds of those steps and hands out the new plans -- every batch equal to
    per-sample decoding of the plan the plane now has, every commit's fingerprint accepted,
    the audit exactly-once -- and rank 1, at half speed, gets the smaller share at once."""
    told = {}

    def slow_rank_1(step, loaders):
        if step != 1:
            return
        with PlaneClient(loaders[0].session.url) as client:
            _served_through(client, step + 3)  # read ahead: the queue, decoding, plans
            told["before"] = [_share(client.get_plan(s, 0), client.get_plan(s, 1))
                              for s in range(step + 1, STEPS)]
            told.update(client.set_speeds(step, [1.0, 0.5], from_step=step + 1))
            for loader in loaders:
                loader.replan_from(step + 1)
            told["shares"] = [_share(client.get_plan(s, 0), client.get_plan(s, 1))
                              for s in range(step + 1, STEPS)]

    def make(url, rank):
        return loader_for(url, rank, RankLoader, **loader_args(demo), num_workers=2,
                          prefetch_steps=2)
    check_full_path(demo, tmp_path, make, after_step=slow_rank_1)
    assert told["applies_at_step"] == 2 and told["speeds"] == [1.0, 0.5]
    print(told)
    assert told["shares"][0] < 0.4 < told["before"][0], told  # the very next step
    assert sum(told["shares"]) < sum(told["before"]) - 0.3, told


def _share(table_0, table_1) -> float:
    from omniscale.plan import plan_metadata

    costs = [plan_metadata(t)["predicted_cost"] for t in (table_0, table_1)]
    return costs[1] / sum(costs)
