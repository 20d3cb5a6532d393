"""The plane's status as Prometheus metrics (``omniscale plane serve --metrics-port P``).

A custom collector calls ``status()`` on every scrape, so the numbers are exactly what
``omniscale plane status`` prints and there is no second set of counters to keep in step. It
is registered in a registry of its own (never prometheus_client's global one), so several
planes -- or tests -- in one process do not collide.

The endpoint is plain, unauthenticated HTTP, as Prometheus scrapes expect; it serves counts
and shares only, and binds the host it is given: ``--metrics-host``, 127.0.0.1 by default, not
the plane's ``--host`` -- a plane served to the network with a token and TLS does not put its
metrics there too unless told to (bind them where only the scraper reaches).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

PREFIX = "omniscale_plane_"


class HasStatus(Protocol):
    def status(self) -> dict: ...


class PlaneCollector:
    """Reads ``plane.status()`` (a DataPlane, or a PlaneClient of a remote plane) per scrape."""

    def __init__(self, plane: HasStatus):
        self.plane = plane

    def describe(self):
        return []  # metrics depend on the sources; nothing to check at registration

    def collect(self):
        s = self.plane.status()
        yield _gauge("next_step", "the next step to train (steps before it are committed)",
                     s["next_step"])
        yield _gauge("planned_through_step", "the last step planned so far", s["planned_through"])
        yield _gauge("plans_ahead_steps", "steps planned beyond the next step",
                     s["plans_ahead"])
        yield _gauge("dp", "data-parallel ranks of the next step", s["dp"])
        yield _gauge("clients", f"ranks that fetched a plan in the last "
                                f"{s['client_window_s']:g} s", len(s["clients"]))
        yield _gauge("last_snapshot_step", "step of the latest snapshot (-1: none)",
                     s["snapshot"]["last_step"])
        yield _gauge("exhausted", "1 when the mixture has run out of data",
                     int(s["exhausted_at"] is not None))
        yield from _sources(s)
        yield from _steps(s)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _sources(s: dict):
    mixture = {
        "weight": "the schedule's current weight (renormalised over active sources)",
        "target_share": "cumulative target share of the mixture",
        "realized_share": "cumulative realized share of the mixture",
        "deviation": "realized share minus target share"}
    families = {key: GaugeMetricFamily(PREFIX + key, f"per source: {doc}", labels=["source"])
                for key, doc in mixture.items()}
    for row in s["mixture"]:
        for key, family in families.items():
            family.add_metric([row["source"]], row[key])
    yield from families.values()
    samples = CounterMetricFamily(PREFIX + "served_samples", "per source: samples drawn into "
                                  "plans", labels=["source"])
    tokens = CounterMetricFamily(PREFIX + "served_tokens", "per source: LLM tokens drawn into "
                                 "plans", labels=["source"])
    skipped = CounterMetricFamily(PREFIX + "skipped_samples", "per source: samples skipped, "
                                  "by reason", labels=["source", "reason"])
    epoch = GaugeMetricFamily(PREFIX + "source_epoch", "per source: current epoch",
                              labels=["source"])
    for row in s["sources"]:
        name = row["source"]
        samples.add_metric([name], row["served_samples"])
        tokens.add_metric([name], row["served_tokens"])
        epoch.add_metric([name], row["epoch"])
        for reason in ("corrupt", "quarantined", "too_long"):
            skipped.add_metric([name, reason], row[f"skipped_{reason}"])
    yield from (samples, tokens, skipped, epoch)


def _steps(s: dict):
    """Balance of the last committed and the next step (labels ``step="last"|"next"``) -- a
    label per step number would grow without bound -- plus the worst step in memory."""
    by_step = {row["step"]: row for row in s["recent_steps"]}
    which = {"last": by_step.get(s["next_step"] - 1), "next": by_step.get(s["next_step"])}
    for key, doc in (("imbalance", "max/mean predicted rank cost"),
                     ("max_cost", "predicted cost of the busiest rank"),
                     ("lower_bound", "no assignment can have a smaller max rank cost")):
        family = GaugeMetricFamily(PREFIX + f"step_{key}", doc, labels=["step"])
        for label, row in which.items():
            if row is not None:
                family.add_metric([label], row[key])
        yield family
    worst = max((row["imbalance"] for row in s["recent_steps"]), default=1.0)
    yield _gauge("recent_imbalance_max", "worst imbalance over the steps in memory", worst)
    cost = GaugeMetricFamily(PREFIX + "rank_cost", "predicted cost of each rank at the next "
                             "step", labels=["rank"])
    for rank, value in enumerate(s["next_step_rank_cost"]):
        cost.add_metric([str(rank)], value)
    yield cost


@dataclass
class MetricsServer:
    """A running metrics endpoint; ``shutdown()`` stops it and frees the port."""

    httpd: object
    thread: threading.Thread
    host: str

    @property
    def port(self) -> int:
        return self.httpd.server_port

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}/metrics"

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def serve_metrics(plane: HasStatus, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve ``plane``'s status as Prometheus metrics on ``host:port`` (0: any free port) from
    a daemon thread."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PlaneCollector(plane))
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd, thread, host)
