"""The Ray path passes the same full-path test as the DataLoader path, on a local two-CPU Ray
instance; pools are sized by measured decode cost times mixture share."""

from __future__ import annotations

import pytest
import ray
from pipeline_fixtures import loader_args, spec_of
from test_pipeline import check_full_path

from loaders.ray_loaders import RayRankLoader, measure_costs, size_pools
from loaders.worker import decoder_spec


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


def test_measured_costs_rank_video_above_text(demo):
    costs = measure_costs(decoder_spec(loader_args(demo)["sources"], demo.tokenizer,
                                       demo.media))
    assert set(costs) == {s.name for s in demo.sources} and min(costs.values()) > 0
    assert costs["video_caption"] > costs["docs"]


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
