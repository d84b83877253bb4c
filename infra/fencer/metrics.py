"""The fencer's state as Prometheus metrics on ``GET /metrics``, for the stack's managed scraper
(infra/observability.py, job ``node-fencer``) and the ``FencingHalted`` alert
(observability/alerts.yaml), through prometheus_client (as the trainer's exporter,
training/observe/exporter.py): a collector over the fencer's last observation, read at each
scrape.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

HALTED = "node_fencer_halted"
BAD_NODES = "node_fencer_bad_nodes"
NODES = "node_fencer_nodes"
IN_FLIGHT = "node_fencer_in_flight"
TERMINATIONS = "node_fencer_terminations_total"
METRICS: dict[str, tuple[str, str]] = {
    HALTED: (
        "gauge",
        "1 while fencing and replacing stopped themselves (too much of the group bad)",
    ),
    BAD_NODES: ("gauge", "GPU nodes not Ready, unfit or never joined, not yet ended"),
    NODES: ("gauge", "GPU nodes of the node group"),
    IN_FLIGHT: ("gauge", "Nodes ended whose Node object is still there"),
    TERMINATIONS: (
        "counter",
        "Instances terminated: fenced (silent), replaced (unfit), unjoined (never joined)",
    ),
}
"""Exposed name -> (type, help): every series the fencer serves (tests/observability reads the
names)."""


@dataclass(eq=False)  # hashed by identity: the registry keeps its collectors in a dict
class FencerMetrics:
    halted: int = 0
    bad: int = 0
    nodes: int = 0
    in_flight: int = 0
    terminations: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("fenced", "replaced", "unjoined"), 0)
    )
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    registry: CollectorRegistry = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def observe(self, *, nodes: int, bad: int, in_flight: int, halted: bool) -> None:
        with self.lock:
            self.nodes, self.bad, self.in_flight, self.halted = nodes, bad, in_flight, int(halted)

    def ended(self, *, kind: str) -> None:
        with self.lock:
            self.terminations[kind] += 1

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol: one consistent reading per scrape."""
        with self.lock:
            gauges = {
                HALTED: self.halted,
                BAD_NODES: self.bad,
                NODES: self.nodes,
                IN_FLIGHT: self.in_flight,
            }
            terminations = dict(self.terminations)
        for name, value in gauges.items():
            yield GaugeMetricFamily(name, METRICS[name][1], value=value)
        counter = CounterMetricFamily(
            TERMINATIONS.removesuffix("_total"), METRICS[TERMINATIONS][1], labels=["kind"]
        )
        for kind, value in terminations.items():
            counter.add_metric([kind], value)
        yield counter

    def render(self) -> str:
        """The text a scrape reads."""
        return generate_latest(self.registry).decode()


def serve(metrics: FencerMetrics, *, port: int, host: str = "0.0.0.0"):
    """Serve `metrics` on ``http://host:port/metrics`` from a daemon thread; the server."""
    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return server
