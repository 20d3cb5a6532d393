"""The plane as a Ray actor on a local one-CPU Ray instance: trainers reach it by its Flight
URL, get the same plans an in-process plane computes, commit, and it stops with a snapshot;
``omniscale plane serve --ray`` joins the same instance through RAY_ADDRESS."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import ray

from omniscale.dataplane.client import PlaneClient
from omniscale.dataplane.plane import DataPlane, PlaneConfig
from omniscale.dataplane.ray_actor import start_on_ray
from omniscale.errors import UserError
from omniscale.loaders.ray_cluster import job_namespace
from omniscale.tools.train.plane_session import PlaneSession
from tests.dataplane.plane_steps import commit_step

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = PlaneConfig(dp=2, micro_batch_tokens=8192, window=4, global_batch_tokens=12288,
                     sp_max=2, snapshot_every=4)
TIMEOUT = 60  # the most any one wait on the served process may take


@pytest.fixture(scope="module")
def cluster():
    """A fresh local Ray instance (never one the environment points at)."""
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()



def test_actor_serves_the_same_plans_and_stops_with_a_snapshot(cluster, demo, tmp_path):
    actor, url = start_on_ray(demo / "mix.yaml", tmp_path / "actor", CONFIG)
    try:
        assert url.startswith("grpc+tcp://127.0.0.1:")
        local = DataPlane(demo / "mix.yaml", tmp_path / "local", CONFIG)
        with PlaneClient(url, timeout=10, retry_for=5) as client:
            for step in range(5):
                for rank in range(2):
                    assert client.get_plan(step, rank) == local.get_plan(step, rank)
                assert commit_step(client, step)["committed"]
            client.get_plan(5, 1)
            status = client.status()
        assert status["next_step"] == 5 and status["dp"] == 2
        assert [(c["rank"], c["last_step"]) for c in status["clients"]] == [(0, 4), (1, 5)]
        assert ray.get(actor.status.remote())["next_step"] == 5
        stopped = ray.get(actor.stop.remote(), timeout=TIMEOUT)
        assert stopped["next_step"] == 5
    finally:
        ray.kill(actor)
    assert (tmp_path / "actor" / "snapshots" / f"snap-{5:010d}.json").is_file()


def test_a_plane_actor_that_dies_comes_back_from_its_state_dir(cluster, demo, tmp_path):
    """The actor's process is killed after step 2 is committed and step 3 fetched: Ray starts
    it again, it resumes from its snapshot and log on the same URL, the trainers' client
    (which retries) gets the plans an uninterrupted plane gives, and the audit is clean."""
    actor, url = start_on_ray(demo / "mix.yaml", tmp_path / "actor", CONFIG)
    local = DataPlane(demo / "mix.yaml", tmp_path / "local", CONFIG)
    try:
        with PlaneClient(url, timeout=10, retry_for=TIMEOUT) as client:
            for step in range(6):
                for rank in range(2):
                    assert client.get_plan(step, rank) == local.get_plan(step, rank)
                if step == 3:
                    pid = ray.get(actor.pid.remote())
                    os.kill(pid, signal.SIGKILL)  # the process dies mid-step
                assert commit_step(client, step)["committed"]
            assert client.status()["next_step"] == 6
        assert ray.get(actor.pid.remote(), timeout=TIMEOUT) != pid  # a new process
        ray.get(actor.stop.remote(), timeout=TIMEOUT)
    finally:
        ray.kill(actor, no_restart=True)
    report = DataPlane(None, tmp_path / "actor", CONFIG).audit()
    assert (report["duplicated"], report["missing"], report["fingerprint_mismatches"]) == \
        (0, 0, [])


def test_a_plane_actor_restarted_without_its_state_refuses_to_start_fresh(cluster, demo,
                                                                          tmp_path):
    """Ray restarts a plane on a node whose disk lacks its state dir (played here by moving
    the dir aside before the process is killed): it must not start fresh, which would serve
    step 0 again, but fail and say why."""
    actor, url = start_on_ray(demo / "mix.yaml", tmp_path / "actor", CONFIG)
    try:
        with PlaneClient(url, timeout=10) as client:
            assert commit_step(client, 0)["committed"]
        pid = ray.get(actor.pid.remote())
        (tmp_path / "actor").rename(tmp_path / "elsewhere")
        os.kill(pid, signal.SIGKILL)
        for _ in range(20):  # a call that meets the dying process: unavailable, not dead
            try:
                url = ray.get(actor.url.remote(), timeout=TIMEOUT)
            except ray.exceptions.ActorUnavailableError:
                continue
            except ray.exceptions.RayActorError as e:
                assert "holds no plane state" in str(e), e
                break
            pytest.fail(f"the restarted plane serves again, from nothing, at {url}")
        else:
            pytest.fail("the plane actor stayed unavailable")
    finally:
        ray.kill(actor, no_restart=True)


def test_start_errors_are_one_line(cluster, demo, tmp_path):
    with pytest.raises(UserError, match=r"plane actor failed to start: .*nope\.yaml: file not "
                                        r"found$"):
        start_on_ray(demo / "nope.yaml", tmp_path, CONFIG)
    with pytest.raises(UserError, match="--host 10.1.2.3: binding anything but loopback "
                                        "requires --token"):
        start_on_ray(demo / "mix.yaml", tmp_path, CONFIG, host="10.1.2.3")
    actor, _ = start_on_ray(demo / "mix.yaml", tmp_path / "first", CONFIG, name="plane")
    try:
        namespace = ray.get_runtime_context().namespace
        with pytest.raises(UserError, match=f"^a plane actor named 'plane' already runs in Ray "
                                            f"namespace '{namespace}': stop it, or give another "
                                            f"--namespace$"):
            start_on_ray(demo / "mix.yaml", tmp_path / "second", CONFIG, name="plane")
    finally:
        ray.kill(actor)


def test_serve_command_joins_the_cluster(cluster, demo, tmp_path):
    args = [sys.executable, "-m", "omniscale", "plane", "serve", "--ray", "--spec",
            str(demo / "mix.yaml"), "--state-dir", str(tmp_path), "--dp", "2",
            "--global-batch-tokens", "12288", "--micro-batch-tokens", "8192", "--sp-max", "2"]
    proc = subprocess.Popen(args, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env={**os.environ, "RAY_ADDRESS": cluster})
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=read, daemon=True).start()

    def next_line(pattern: str) -> re.Match:
        while True:
            line = lines.get(timeout=TIMEOUT)
            assert line is not None, f"serve --ray exited before printing {pattern!r}"
            if match := re.search(pattern, line):
                return match
    try:
        url, namespace = next_line(r"serving (grpc\+tcp://\S+) from a Ray actor 'plane' in "
                                   r"namespace (\S+) ").groups()
        assert namespace == job_namespace(tmp_path)  # the state dir's own
        assert ray.get_actor("plane", namespace=namespace) is not None
        # trainers read it from the plane, and put their decoding pools there
        with PlaneSession(url, 0) as session:
            assert session.ray_namespace() == namespace
        with PlaneClient(url, timeout=10, retry_for=5) as client:
            client.get_plan(0, 0)
            client.get_plan(0, 1)
            commit_step(client, 0)
        proc.send_signal(signal.SIGINT)
        next_line(r"stopped at step 1")
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
