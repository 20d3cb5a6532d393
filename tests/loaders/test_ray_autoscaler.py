"""The Ray pools on a cluster with Ray's own autoscaler (its monitor process, nodes from Ray's
fake multi-node provider: real ``ray start`` node processes on this machine). Pools allowed
four CPUs on a one-CPU head are planned for four, ask the autoscaler for the room through
Ray's resource request, the autoscaler adds nodes, the actors start there and decode, and
closing the loader withdraws the request."""

from __future__ import annotations

import math

import pytest
import ray

from omniscale.dataplane.embedded import start_embedded
from omniscale.loaders.ray_cluster import connect
from omniscale.tools.train.plane_session import ray_loader_for
from tests.loaders.pipeline_fixtures import CONFIG, loader_args, spec_of
from tests.loaders.ray_fixtures import autoscaling_head, standing_request

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")

MAX_NODES = 3


@pytest.fixture(scope="module")
def cluster():
    with autoscaling_head(head_cpus=1, node_cpus=1, max_nodes=MAX_NODES) as address:
        connect(address, "autoscaler-test")  # as a rank joins: the cluster's auth mode
        try:
            yield address
        finally:
            ray.shutdown()


@pytest.mark.timeout(240)
def test_the_autoscaler_adds_the_nodes_the_pools_ask_for(cluster, pipeline_demo, tmp_path):
    demo = spec_of(pipeline_demo / "all.yaml")
    head = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(head) == 1 and ray.cluster_resources()["CPU"] == 1
    with start_embedded(demo.path, tmp_path, CONFIG) as plane:
        # placement waits while the autoscaler starts nodes (seconds each)
        loader = ray_loader_for(plane.url, 0, **loader_args(demo), autoscale_cpus=4.0,
                               placement_timeout=180)
        with loader:
            actors, cpus = sum(loader.replicas.values()), loader.plan.actor_cpus
            assert actors * cpus <= 4.0 and min(loader.replicas.values()) >= 1
            assert standing_request() == [{"CPU": cpus}] * actors  # one bundle an actor
            nodes = {ray.get(a.ready.remote()) for p in loader.pools.values() for a in p}
            added = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - head
            assert nodes & added, "no actor runs on a node the autoscaler added"
            assert 1 <= len(added) <= MAX_NODES
            # the bundles did not fit the head alone: the autoscaler had to add nodes
            assert actors > math.floor(1.0 / cpus + 1e-9)
            batch = next(loader)  # the actors decode, wherever they run
            assert batch.step == 0 and batch.num_samples > 0
            loader.commit(batch.step)
        assert standing_request() == []  # closed: the request is withdrawn
