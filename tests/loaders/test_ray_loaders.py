"""The Ray path on a local two-node Ray cluster (one CPU each): it passes the same full-path
test as the DataLoader path with the default pools (planned to fit the cluster, spread over
both nodes), keeps its batches when decoding actors are killed mid-run, and refuses actors the
cluster cannot place with one line instead of waiting forever."""

from __future__ import annotations

import math
import re
import time
from dataclasses import replace

import pytest
import ray

from omniscale.errors import UserError
from omniscale.loaders.ray_cluster import size_pools
from omniscale.loaders.ray_loaders import measure_costs
from omniscale.loaders.worker import decoder_spec
from omniscale.tools.train.plane_session import ray_loader_for
from tests.loaders.pipeline_fixtures import CONFIG, loader_args, spec_of
from tests.loaders.ray_fixtures import two_node_cluster
from tests.loaders.test_pipeline import check_full_path

# The suite runs on two xdist workers; Ray tests share one of them (`--dist loadgroup`), so
# that no two Ray clusters start at once on two cores.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster(1) as nodes:
        yield nodes


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


@pytest.mark.timeout(240)
def test_default_pools_fit_the_cluster_spread_over_its_nodes_and_survive_deaths(
        cluster, demo, tmp_path):
    """Two ranks feeding from the job's pools (rank 0 plans them within the cluster's 2 CPUs:
    at least one actor per source, fractional CPUs; rank 1 finds them by name). After step 0
    every image and video actor is killed: the batches are still exactly per-sample decoding.
    The plane plans one window of 2 steps at a time, so step 2's samples go to the pools only
    after step 1's commit, after the kill: the loaders, which run steps ahead, cannot have
    decoded them already."""
    loaders = []

    def make(url, rank):
        loader = ray_loader_for(url, rank, **loader_args(demo))
        loaders.append(loader)
        return loader

    nodes = set()

    def kill_some(step, running):
        if step == 0:
            nodes.update(ray.get([a.ready.remote() for pool in running[0].pools.values()
                                  for a in pool]))
            for source in ("image_caption", "video_caption"):
                for actor in running[0].pools[source]:
                    ray.kill(actor, no_restart=True)

    # a Ray run's steps cost seconds: no more than the replacements need
    seen = check_full_path(demo, tmp_path, make, after_step=kill_some, steps=3,
                           config=replace(CONFIG, window=2, plan_ahead=0))
    assert seen == {"text", "image", "video", "audio"}
    owner, other = loaders
    assert owner.plan == other.plan and owner.replicas == other.replicas
    actors, cpus = sum(owner.replicas.values()), owner.plan.actor_cpus
    assert min(owner.replicas.values()) >= 1 and set(owner.replicas) == \
        {s.name for s in demo.sources}
    # the largest share (in steps of 0.01) at which every actor has room on a 1-CPU node
    assert 2 * math.floor(1 / cpus + 1e-9) >= actors > 2 * math.floor(1 / (cpus + 0.01) + 1e-9)
    # step 2 met dead actors: replaced (by the rank that met one first; the other may find
    # that replacement by name)
    assert sum(loader.actor_restarts for loader in loaders) >= 1
    assert len(nodes) == 2  # the pools spread over both nodes


@pytest.mark.timeout(120)
def test_actors_the_cluster_cannot_place_end_with_one_line(cluster, demo, tmp_path):
    """Two CPUs per actor on nodes of one CPU each: refused at once, with one line -- before
    the pools are named or any actor started, so that no other rank takes up the plan or
    meets its actors killed (a rank that did ended the job with Ray's traceback instead)."""
    from omniscale.dataplane.embedded import start_embedded
    from tests.loaders.pipeline_fixtures import CONFIG

    with start_embedded(demo.path, tmp_path, CONFIG) as plane:
        started = time.monotonic()
        with pytest.raises(UserError) as e:
            ray_loader_for(plane.url, 0, **loader_args(demo), actor_cpus=2.0,
                           pools_name="refused")
        assert time.monotonic() - started < 30
    # the GCS's table holds dead actors too
    assert [a["Name"] for a in ray._private.state.actors().values()
            if a["Name"].startswith("refused")] == []
    text = str(e.value)
    assert "\n" not in text and "2 CPU each" in text and "the cluster has 2 CPUs" in text, text
    assert "no node has 2 CPUs" in text and "data.ray_actor_cpus" in text


@pytest.mark.timeout(120)
def test_a_cluster_short_of_cpus_stalls_into_one_line(cluster):
    """Fourteen actors of a quarter CPU ask for 3.5 of the cluster's 2 CPUs: the ones that
    fit start, the rest never do, and the wait ends after the timeout with one line."""
    from omniscale.loaders.ray_cluster import PoolPlan, wait_placed

    @ray.remote
    class Idle:
        def ready(self) -> None:
            return None

    plan = PoolPlan({"a": 14}, 0.25)
    actors = [Idle.options(num_cpus=0.25).remote() for _ in range(14)]
    with pytest.raises(UserError) as e:
        wait_placed(actors, plan, timeout=3.0)
    text = str(e.value)
    # at most 8 fit (2 CPUs / 0.25); a placed actor whose process starts late counts as not
    started = re.match(r"Ray started (\d+) of 14 decoding actors \(0.25 CPU each, 3.5 CPUs in "
                       r"all\): none more started within 3 s; the cluster has 2 CPUs, ", text)
    assert started and int(started.group(1)) <= 8 and "\n" not in text, text




@pytest.mark.timeout(120)
def test_an_actor_that_dies_before_it_answers_is_a_death_not_the_end(cluster):
    """Placing the pools: an actor killed before it answered (as when the autoscaler takes
    its node back) is passed over, for the pools to replace like any death; one whose
    __init__ raises ends the wait with its own error."""
    from omniscale.loaders.ray_cluster import PoolPlan, wait_placed

    @ray.remote(num_cpus=0.25)
    class Slow:
        def __init__(self, fail: bool = False) -> None:
            if fail:
                raise ValueError("no such source")

        def ready(self) -> None:
            return None

    alive, killed = Slow.remote(), Slow.remote()
    ray.kill(killed, no_restart=True)
    wait_placed([alive, killed], PoolPlan({"a": 2}, 0.25), timeout=60)
    assert ray.get(alive.ready.remote()) is None
    with pytest.raises(ray.exceptions.RayActorError, match="no such source"):
        wait_placed([Slow.remote(fail=True)], PoolPlan({"a": 1}, 0.25), timeout=60)
