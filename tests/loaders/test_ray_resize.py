"""Pools follow the schedule: when the mixture moves from images to clips, the job's pools
are shared out anew (the video pool grows, the image pool shrinks, on every rank alike) and
the batches stay exactly per-sample decoding, samples in flight on retired actors included --
while a node is lost mid-run. On a local two-node Ray cluster of two CPUs a node."""

from __future__ import annotations

import pytest
import ray
import yaml

from omniscale.tools.train.plane_session import ray_loader_for
from tests.loaders.pipeline_fixtures import loader_args, spec_of
from tests.loaders.ray_fixtures import two_node_cluster
from tests.loaders.test_pipeline import check_full_path

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")

SOURCES = ("text", "image_caption", "video_caption")
IMAGES = {"text": 0.01, "image_caption": 1.0, "video_caption": 0.01}
CLIPS = {"text": 0.01, "image_caption": 0.01, "video_caption": 1.0}


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster(2) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def demo(pipeline_demo):
    """Three sources: images for steps 0-3, then clips."""
    spec = yaml.safe_load((pipeline_demo / "mix.yaml").read_text())
    spec["sources"] = [s for s in spec["sources"] if s["name"] in SOURCES]
    spec["schedule"] = {"unit": "steps", "segments": [
        {"kind": "const", "start": 0, "end": 4, "weights": IMAGES},
        {"kind": "const", "start": 4, "end": None, "weights": CLIPS}]}
    path = pipeline_demo / "images-then-clips.yaml"
    path.write_text(yaml.safe_dump(spec))
    return spec_of(path)


@pytest.mark.timeout(240)
def test_pools_follow_the_schedule_and_survive_a_lost_node(cluster, demo, tmp_path):
    """Images for steps 0-3, then clips, on two ranks; the worker node (and every decoding
    actor on it) is removed after step 1. The pools are shared out anew for the clips on both
    ranks alike, the lost actors start again on the node left (or are retired by the
    resize), their samples are decoded again, and the batches stay exactly per-sample
    decoding throughout. (One run for both cases: a Ray run costs seconds to start. The
    cluster keeps one node after it.)"""
    loaders, first, on_worker = [], {}, []

    def make(url, rank):
        loader = ray_loader_for(url, rank, **loader_args(demo), resize_every=2, actor_cpus=0.25,
                               shares=IMAGES if rank == 0 else None)
        loaders.append(loader)
        first[rank] = dict(loader.replicas)
        return loader

    def lose_node(step, running):
        if step == 1:
            worker = next(iter(cluster.worker_nodes))
            names = [n for pool in running[0].actor_names.values() for n in pool]
            actors = [a for pool in running[0].pools.values() for a in pool]
            nodes = ray.get([a.ready.remote() for a in actors])
            on_worker.extend(name for name, n in zip(names, nodes) if n == worker.node_id)
            cluster.remove_node(worker)

    check_full_path(demo, tmp_path, make, after_step=lose_node)
    assert first[0] == first[1]
    assert first[0]["image_caption"] > first[0]["video_caption"]  # planned for images
    for loader in loaders:  # both ranks now hold the plan for clips
        assert loader.replicas["video_caption"] > loader.replicas["image_caption"]
        assert loader.plan == loaders[0].plan
        assert loader.pool_stats()["actors"] == loader.replicas
    assert loaders[0].resizes >= 1 and loaders[1].resizes >= 1
    assert on_worker  # the pools were spread: some actors were on the lost node
    # each lost actor was replaced (the node left has room for all: 2 CPUs) -- met by a
    # sample, or by the planner's ping once a window (text's, drawn at 1%, may meet no
    # sample) -- or retired by the resize for the clips: none is left in the job's pools
    assert sum(loader.actor_restarts for loader in loaders) >= 1
    assert sum(loader.actors_retired for loader in loaders) == 0
    planner = loaders[0]
    assert not set(on_worker) & {n for pool in planner.actor_names.values() for n in pool}
