"""Local Ray clusters for the Ray tests (never one the environment points at): a two-node
cluster (both nodes processes on this machine, each with its own CPUs as Ray counts them), and
`ray start` heads of their own (one with Ray's autoscaler, its nodes from Ray's fake
multi-node provider), stopped without `ray stop`, which would stop every cluster here."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import ray
from ray.cluster_utils import Cluster

RAY = str(Path(sys.executable).with_name("ray"))


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def head_processes(port: int, temp: str) -> list[psutil.Process]:
    """Every process of the head at ``port`` started in ``temp``: those naming its temp dir
    (the nodes an autoscaler added too), and those naming its port (the GCS server as
    ``--gcs_server_port=PORT``, the client server as ``--address=HOST:PORT``)."""
    return [p for p in psutil.process_iter(["cmdline"]) if p.pid != os.getpid() and any(
        temp in a or a.endswith((f":{port}", f"={port}")) for a in p.info["cmdline"] or [])]


def stop_head(port: int, temp: str) -> None:
    """Stop the head's processes (``ray stop`` would stop every cluster here)."""
    mine = head_processes(port, temp)
    for p in mine:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(mine, timeout=30)


def ray_env(**extra: str) -> dict:
    """This environment without a Ray address or auth settings of its own."""
    return {**{k: v for k, v in os.environ.items()
               if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}, **extra}


@contextlib.contextmanager
def ray_start_head(env: dict, *args: str, port: int | None = None):
    """A ``ray start`` head (``args``: more of its flags) in a temp dir of its own -- short,
    for Ray's socket paths; `ray start` leaves the head's address in TEMP_DIR, where a later
    ``ray.init()`` of any test would find it -- stopped on exit, none of its processes (the
    nodes an autoscaler added too) left running; yields its address."""
    port, temp = port or free_port(), tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        started = subprocess.run(
            [RAY, "start", "--head", f"--port={port}", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={temp}", *args],
            env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        stop_head(port, temp)
        shutil.rmtree(temp, ignore_errors=True)
    left = [p.pid for p in head_processes(port, temp)]
    assert not left, f"processes of the head left running: {left}"


@contextlib.contextmanager
def autoscaling_head(head_cpus: int, node_cpus: int, max_nodes: int):
    """A ``ray start`` head of ``head_cpus`` CPUs with Ray's autoscaler, whose node provider
    (Ray's fake multi-node one) starts nodes of ``node_cpus`` CPUs on this machine, up to
    ``max_nodes``; yields its address."""
    port = free_port()
    config = {
        "cluster_name": "omniscale-test", "max_workers": max_nodes, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5, "head_node_type": "ray.head.default", "auth": {}, "docker": {},
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": f"127.0.0.1:{port}"},
        "available_node_types": {
            # the provider's name for the head's type: any other, and the autoscaler
            # launches "head" nodes it then terminates (over that type's max_workers, 0)
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {},
                                 "max_workers": 0},
            "ray.worker.cpu": {"resources": {"CPU": node_cpus}, "node_config": {},
                               "min_workers": 0, "max_workers": max_nodes}},
        **{k: [] for k in ("initialization_commands", "setup_commands", "head_setup_commands",
                           "worker_setup_commands", "head_start_ray_commands",
                           "worker_start_ray_commands", "cluster_synced_files",
                           "rsync_exclude", "rsync_filter")},
        "file_mounts": {}, "file_mounts_sync_continuously": False}
    # Token auth where a token is at hand, as a driver here has it: a Ray session's mode is
    # fixed for its process (Ray's local instances turn it on when a token is at hand), and
    # on a head of the other mode this process's actors would be cancelled before starting.
    mode = "token" if token_at_hand() else "disabled"
    env = ray_env(RAY_AUTH_MODE=mode, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(config, f)
        f.flush()
        with ray_start_head(env, f"--num-cpus={head_cpus}", f"--autoscaling-config={f.name}",
                            port=port) as address:
            yield address


def token_at_hand() -> bool:
    """Whether Ray finds an auth token here (its variables, or ``~/.ray/auth_token``)."""
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")) \
        or (Path.home() / ".ray" / "auth_token").is_file()


def standing_request() -> list[dict]:
    """The resource request standing in the cluster's GCS, where Ray's autoscaler reads it."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []
