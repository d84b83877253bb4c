"""The fencer's state as Prometheus metrics on ``GET /metrics``, for the stack's managed scraper
(infra/observability.py, job ``node-fencer``) and the ``FencingHalted`` alert
(observability/alerts.yaml).

Written by hand in the text exposition format (prometheus.io "Exposition formats", text format
0.0.4: ``# HELP``, ``# TYPE``, ``name{labels} value`` lines): five series do not justify a
client library in the fencer's image, which holds only ``kubernetes`` and ``awscrt``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
"""Name -> (type, help): every series the fencer serves (tests/observability reads the names)."""
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class FencerMetrics:
    halted: int = 0
    bad: int = 0
    nodes: int = 0
    in_flight: int = 0
    terminations: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("fenced", "replaced", "unjoined"), 0)
    )
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, *, nodes: int, bad: int, in_flight: int, halted: bool) -> None:
        with self.lock:
            self.nodes, self.bad, self.in_flight, self.halted = nodes, bad, in_flight, int(halted)

    def ended(self, *, kind: str) -> None:
        with self.lock:
            self.terminations[kind] += 1

    def render(self) -> str:
        with self.lock:
            values = {
                HALTED: [("", self.halted)],
                BAD_NODES: [("", self.bad)],
                NODES: [("", self.nodes)],
                IN_FLIGHT: [("", self.in_flight)],
                TERMINATIONS: [(f'{{kind="{k}"}}', v) for k, v in self.terminations.items()],
            }
        lines = []
        for name, (kind, text) in METRICS.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{labels} {value}" for labels, value in values[name]]
        return "\n".join(lines) + "\n"


def serve(metrics: FencerMetrics, *, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve `metrics` on ``http://host:port/metrics`` from a daemon thread; the server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            data = metrics.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
