"""The Ray path passes the same full-path test as the DataLoader path, on a local two-CPU Ray
instance; pools are sized by measured decode cost times mixture share."""

from __future__ import annotations

import pytest
import ray

from omniscale.loaders.ray_loaders import RayRankLoader, measure_costs, size_pools
from omniscale.loaders.worker import decoder_spec
from tests.loaders.pipeline_fixtures import loader_args, spec_of
from tests.loaders.test_pipeline import check_full_path


@pytest.fixture(scope="module")
def cluster():
    """A fresh local Ray instance (never one the environment points at)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def demo(pipeline_demo):
    return spec_of(pipeline_demo / "all.yaml")


def test_pools_follow_cost_times_share():
    costs = {"text": 0.001, "image": 0.004, "video": 0.05}
    shares = {"text": 0.5, "image": 0.3, "video": 0.2}
    assert size_pools(costs, shares, total=12, min_replicas=1, max_replicas=8) == \
        {"text": 1, "image": 1, "video": 8}
    assert size_pools(costs, {"text": 1.0}, total=4, min_replicas=1, max_replicas=3) == \
        {"text": 3, "image": 1, "video": 1}  # out of the mix: the minimum, ready for later
    with pytest.raises(ValueError, match="min"):
        size_pools(costs, shares, total=4, min_replicas=3, max_replicas=2)


def test_measured_costs_are_mean_seconds_per_sample(demo, monkeypatch):
    """Every source's probe samples really decode; the cost is the mean time per sample, timed
    on a fake clock that each decode advances by its source's made-up cost (real decode
    times would make any ordering between sources a race)."""
    from omniscale.loaders.worker import TimedDecoder

    made_up = {s.name: 0.001 * (i + 1) for i, s in enumerate(demo.sources)}
    now, decoded = [0.0], []
    real = TimedDecoder.decode

    def decode(self, ref):
        out = real(self, ref)
        decoded.append(ref.source)
        now[0] += made_up[ref.source]
        return out
    monkeypatch.setattr(TimedDecoder, "decode", decode)
    costs = measure_costs(decoder_spec(loader_args(demo)["sources"], demo.tokenizer,
                                       demo.media), clock=lambda: now[0])
    assert set(decoded) == set(made_up) and len(decoded) <= 3 * len(made_up)
    assert costs == pytest.approx(made_up, rel=1e-9)


@pytest.mark.timeout(120)
def test_ray_full_path_matches_per_sample_decoding(cluster, demo, tmp_path):
    first = []

    def make(url, rank):  # rank 1 feeds from rank 0's pools, as ranks of one node would
        loader = RayRankLoader(url, rank, **loader_args(demo), total_replicas=6,
                               max_replicas=1, actor_cpus=0.2,
                               pools=first[0].pools if first else None)
        first.append(loader)
        return loader
    seen = check_full_path(demo, tmp_path, make)
    assert seen == {"text", "image", "video", "audio"}
