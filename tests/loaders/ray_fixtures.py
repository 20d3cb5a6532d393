"""A local two-node Ray cluster for the Ray loader tests (never one the environment points
at): both nodes are processes on this machine, each with its own CPUs as Ray counts them."""

from __future__ import annotations

import contextlib

import ray
from ray.cluster_utils import Cluster


@contextlib.contextmanager
def two_node_cluster(cpus_per_node: int):
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node})
    nodes.add_node(num_cpus=cpus_per_node)
    ray.init(address=nodes.address, include_dashboard=False, log_to_driver=False)
    nodes.wait_for_nodes()
    try:
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
