"""The job's Ray cluster: joined once per process, and decoding pools that fit in it.

One cluster per job: the launcher starts a local Ray instance once (or the job joins
``data.ray_address``; ``auto`` finds a running one), and every rank process connects to the
same one, in the job's own namespace, so two jobs on one cluster never see each other's
actors. Pools are planned within the CPUs the cluster has (:func:`plan_pools`), and actors
that the cluster still cannot place within a bounded time end the run with one line naming
what was asked and what the cluster offers (:func:`wait_placed`): Ray itself would wait
forever, silently. On a cluster with an autoscaler the pools are planned for the CPUs the job
may ask it for, and asked for through Ray's resource requests (:func:`request_room`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from omniscale.errors import UserError

PLACEMENT_TIMEOUT_S = 60.0  # how long actors may wait for CPUs before the run gives up
CPU_GRAIN = 0.01  # actors' fractional CPUs are multiples of this


def job_namespace(run_dir: str | Path) -> str:
    """The Ray namespace of the job writing to ``run_dir``: its actors' names are unique
    within it, whatever else runs on the cluster."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return f"omniscale-{digest}"


def start_local(namespace: str, num_cpus: int | None = None) -> str:
    """Start a Ray instance on this machine (the job's, for its whole life: the caller
    shuts it down) and return its address for the rank processes to join."""
    import ray

    ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, namespace=namespace,
             include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    return ray.get_runtime_context().gcs_address


def connect(address: str, namespace: str) -> None:
    """Join the job's cluster at ``address`` (``auto``: the one running here), once per
    process; a process already connected stays as it is."""
    import ray

    if ray.is_initialized():
        return
    reachable(address)
    _token_auth_if_at_hand(address)
    # A rank is stopped with SIGTERM when a peer fails (by torch's launcher or torchrun);
    # Ray's handler, installed inside ray.init, then prints a native stack dump beside the one
    # line that says why. The default action ends the rank as quietly as one that never joined
    # Ray (the cluster drops a driver's actors when it goes). SIGTERM is held back while
    # ray.init runs, so one that arrives then meets the default action, not Ray's handler.
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    joined = False
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
        joined = True
    except ConnectionError as e:
        raise UserError(f"data.ray_address {address!r}: no Ray cluster to join "
                        f"({str(e).splitlines()[0]}; a cluster with token auth needs its "
                        "token: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
                        ) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if joined or before is None else before)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _token_auth_if_at_hand(address: str) -> None:
    """Token auth as the cluster at ``address`` has it (``RAY_AUTH_MODE``, when set, rules).
    Ray guesses: on for ``auto`` whenever a token is at hand (its variables,
    ``~/.ray/auth_token``), off for an explicit address. Each guess is wrong for some cluster:
    one with token auth refuses a rank without the token (a sibling rank's instance, a `ray
    start` head), and on one without it a rank that turned token auth on has its actors
    cancelled before they start -- silently. So ask: one call to the cluster's GCS without a
    token, refused only where token auth is on."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token auth
        return
    gcs = _gcs_address(address)
    if gcs is None or _wants_token(gcs):
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _gcs_address(address: str) -> str | None:
    """``HOST:PORT`` of the GCS behind ``address`` (``auto``: the cluster running here), or
    None where it cannot be told (a Ray Client ``ray://`` address)."""
    if address.startswith("ray://"):
        return None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 -- ray.init will say what is wrong with it
        return None


def _wants_token(gcs: str) -> bool:
    """Whether the GCS at ``gcs`` refuses a call without a token (an unreachable or otherwise
    failing one: True, leaving the choice to Ray's own rule)."""
    from ray._raylet import GcsClient

    with _native_stderr_muted():  # the GCS client logs its refusal there: not the user's news
        try:
            GcsClient(address=gcs).internal_kv_get(b"omniscale-auth-probe", None, timeout=5)
        except Exception:  # noqa: BLE001 -- AuthenticationError, or Ray's own rule decides
            return True
    return False


@contextlib.contextmanager
def _native_stderr_muted():
    """File descriptor 2 on /dev/null for the block (native code writes there directly)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def reachable(address: str, timeout: float = 5.0, what: str = "data.ray_address") -> None:
    """One line when nothing listens at a ``HOST:PORT`` address: ``ray.init`` itself would
    retry for minutes, silently."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local": Ray resolves those itself, quickly
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise UserError(f"{what} {address!r}: no Ray cluster to join ({e})") from None


def node_cpus() -> list[float]:
    """CPUs of each live node of the cluster this process is connected to."""
    import ray

    return [float(n["Resources"].get("CPU", 0.0)) for n in ray.nodes() if n["Alive"]]


def cluster_cpus() -> float:
    return sum(node_cpus())


@dataclass(frozen=True)
class PoolPlan:
    """Actors per source and the CPUs each reserves."""

    replicas: dict[str, int]
    actor_cpus: float

    @property
    def cpus(self) -> float:
        return sum(self.replicas.values()) * self.actor_cpus


def size_pools(costs: dict[str, float], shares: dict[str, float], total: int,
               min_replicas: int = 1, max_replicas: int = 8) -> dict[str, int]:
    """Replicas per source: ``total`` split by cost × share, each clamped to
    ``[min_replicas, max_replicas]`` (a source out of the mix still gets ``min_replicas``,
    ready for when the schedule brings it in)."""
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"replicas: need 1 <= min ({min_replicas}) <= max ({max_replicas})")
    load = {n: costs[n] * max(shares.get(n, 0.0), 0.0) for n in costs}
    whole = sum(load.values())
    if whole <= 0:
        load, whole = {n: 1.0 for n in costs}, float(len(costs))
    return {n: max(min_replicas, min(max_replicas, round(total * load[n] / whole)))
            for n in costs}


def plan_pools(costs: dict[str, float], shares: dict[str, float], nodes: list[float],
               max_replicas: int = 4, actor_cpus: float | None = None) -> PoolPlan:
    """The job's pools on nodes with these CPUs: as many actors as whole CPUs (at least one
    per source), split by decode cost x mixture share (:func:`size_pools`, at most
    ``max_replicas`` a source). Each actor reserves ``actor_cpus`` when given; otherwise the
    most (up to one CPU, in steps of ``CPU_GRAIN``) at which every actor finds room on some
    node -- fractional when the actors outnumber the CPUs."""
    budget = sum(nodes)
    if budget <= 0:
        raise UserError("the Ray cluster has no CPUs: nothing to place decoding actors on")
    replicas = size_pools(costs, shares, max(len(costs), math.floor(budget)), 1,
                          max(1, max_replicas))
    actors = sum(replicas.values())
    if actor_cpus is None:
        grains = math.floor(min(1.0, budget / actors) / CPU_GRAIN + 1e-9)
        while grains > 1 and sum(math.floor(c / (grains * CPU_GRAIN) + 1e-9)
                                 for c in nodes) < actors:
            grains -= 1  # a node's leftover below one actor's share is lost to packing
        actor_cpus = round(max(1, grains) * CPU_GRAIN, 4)
    return PoolPlan(replicas, actor_cpus)


def request_room(plan: PoolPlan | None) -> None:
    """Ask the cluster's autoscaler for room for ``plan``'s actors (one bundle each), through
    Ray's resource requests: a standing request, which the autoscaler keeps the cluster at
    (a lost node is replaced) until the next call; None withdraws it. On a cluster without
    an autoscaler the request is recorded and nothing else happens."""
    from ray.autoscaler.sdk import request_resources

    actors = 0 if plan is None else sum(plan.replicas.values())
    request_resources(bundles=[{"CPU": plan.actor_cpus}] * actors if actors else [])


def replan(plan: PoolPlan, costs: dict[str, float], shares: dict[str, float],
           nodes: list[float], max_replicas: int = 4) -> PoolPlan:
    """``plan``'s actors shared out anew for new mixture shares: as many actors, of the same
    size (a live actor's reservation cannot change), split by decode cost x share
    (:func:`size_pools`), then trimmed from the largest pools to what the nodes hold."""
    replicas = size_pools(costs, shares, sum(plan.replicas.values()), 1, max(1, max_replicas))
    room = sum(math.floor(c / plan.actor_cpus + 1e-9) for c in nodes)
    while sum(replicas.values()) > max(room, len(replicas)):
        largest = max(replicas, key=lambda n: (replicas[n], n))
        if replicas[largest] == 1:
            break
        replicas[largest] -= 1
    return PoolPlan(replicas, plan.actor_cpus)


def wait_placed(actors: list, plan: PoolPlan, timeout: float = PLACEMENT_TIMEOUT_S,
                autoscaling: bool = False) -> None:
    """Return once every actor of ``plan`` has started (each answers ``ready``). Actors
    larger than any node refuse at once (unless ``autoscaling``: the autoscaler may add
    larger nodes); otherwise each must start within ``timeout`` seconds of the one before
    (a cluster short of CPUs, or an autoscaler that never comes, stalls; a busy one that
    starts worker processes one at a time does not). On a refusal or a stall every actor is
    killed and one line says what was asked and what the cluster offers. An actor that dies
    before it answers is passed over (the pools replace it as they replace any death); one
    whose ``__init__`` raised raises that error."""
    import ray

    check_fits(plan, autoscaling, actors)
    pending = [a.ready.remote() for a in actors]
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            _refuse(actors, plan, len(actors) - len(pending), f"none more started within "
                    f"{timeout:g} s", autoscaling)
        try:
            ray.get(done)
        except ray.exceptions.RayActorError as e:
            if getattr(e, "actor_init_failed", True):
                raise  # its own error, from its __init__ (every new one would fail alike)
            # Died before it answered, its node lost (an autoscaler's node taken back) or its
            # process killed: the pools meet it as a death, like any other, and replace it.


def check_fits(plan: PoolPlan, autoscaling: bool = False, actors: list = ()) -> None:
    """Refuse, with the line :func:`wait_placed` gives, a plan whose actors are larger than
    any node (unless ``autoscaling``): checked before a pool is named or started, so that no
    rank meets actors another rank's refusal killed."""
    import ray

    largest = max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]),
                  default=0.0)
    if plan.actor_cpus > largest and not autoscaling:
        _refuse(list(actors), plan, 0, f"no node has {plan.actor_cpus:g} CPUs (the largest "
                f"has {largest:g})")


def _refuse(actors: list, plan: PoolPlan, placed: int, why: str,
            autoscaling: bool = False) -> None:
    import ray

    available = float(ray.available_resources().get("CPU", 0.0))
    for actor in actors:
        ray.kill(actor)
    hint = ("the autoscaler was asked for them and did not add the nodes; lower "
            "data.ray_autoscale_cpus or check the autoscaler's node types" if autoscaling else
            "lower data.ray_actor_cpus (unset, the pools fit the cluster) or add nodes")
    raise UserError(
        f"Ray started {placed} of {len(actors)} decoding actors ({plan.actor_cpus:g} CPU each, "
        f"{plan.cpus:g} CPUs in all): {why}; the cluster has {cluster_cpus():g} CPUs, "
        f"{available:g} free; {hint}")
