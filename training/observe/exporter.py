"""The run's Prometheus exporter: ``python -m training.observe.exporter --run-dir DIR ...``.

One process per pod (started by the pod supervisor, ``training/launch/pod.py``) or per local run
(``training/launch/local.py``), never per rank. It reads what the ranks already write to the run
directory (``metrics.jsonl``, ``events.jsonl``) when Prometheus scrapes it, so:

- it adds nothing to the training step (no call, no lock, no socket in the ranks);
- it survives every restart inside the pod (in-process and in-job restarts replace ranks, not
  this process), and a new exporter (a replaced pod) serves the same totals, read from the logs;
- what it serves is what the report and TensorBoard show: the same files, the same accounting.

Serves ``/metrics`` (Prometheus text format) on ``--addr:--port`` until SIGTERM/SIGINT. Families
and labels: ``training/observe/catalog.py``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from training.observe.catalog import JOB_LABEL, METRICS
from training.observe.view import RunView

FINAL_RESPONSE_GRACE_S = 1.0
"""How long the exporter keeps running after the final scrape's samples are made, so that the
response reaches the scraper (seen: a refused connection when the process left at once)."""


class RunCollector(Collector):
    """A prometheus_client collector over a `RunView`: one refresh per scrape."""

    def __init__(self, view: RunView) -> None:
        self.view = view
        self._lock = threading.Lock()  # scrapes may overlap; the view reads files in order
        self._scraped = threading.Condition()
        self.scrapes = 0

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            samples = self.view.samples()
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for sample in samples:
            spec = METRICS[sample.name]
            names = (JOB_LABEL, *spec.labels)
            family = families.get(sample.name)
            if family is None:
                cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
                family = families[sample.name] = cls(sample.name, spec.help, labels=names)
            family.add_metric([sample.labels[name] for name in names], sample.value)
        yield from families.values()
        # Counted once the registry has every family, not before: the final scrape's wait
        # must not end while its samples are still being made.
        with self._scraped:
            self.scrapes += 1
            self._scraped.notify_all()

    def wait_for_next_scrape(self, *, timeout_s: float) -> None:
        """Return after the next scrape, or `timeout_s`; at once when nothing ever scraped
        this exporter (no scraper: a laptop run, a test), so that it never waits in vain."""
        with self._scraped:
            if self.scrapes == 0:
                return
            seen = self.scrapes
            if self._scraped.wait_for(lambda: self.scrapes > seen, timeout=timeout_s):
                # The scrape's response is written by the server's (daemon) handler thread
                # after collect() returns; leave it time to go out before the process ends.
                time.sleep(FINAL_RESPONSE_GRACE_S)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.observe.exporter")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--job", required=True, help="the training_job label")
    parser.add_argument("--node", type=int, default=0, help="this pod's node index")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument(
        "--reporter",
        action="store_true",
        help="serve the job's figures too (one exporter per job: node 0, or the local run)",
    )
    parser.add_argument("--stall-factor", type=float, required=True)
    parser.add_argument("--stall-floor-s", type=float, required=True)
    parser.add_argument("--checkpoint-interval", type=int, default=0)
    parser.add_argument("--recipe", default="")
    parser.add_argument("--restart-mode", default="")
    parser.add_argument("--addr", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--final-scrape-wait-s",
        type=float,
        default=0.0,
        help="on SIGTERM, keep serving until one more scrape (at most this long), so the "
        "scraper reads the run's final state; no wait if nothing ever scraped",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    view = RunView(
        run_dir=args.run_dir,
        job=args.job,
        node=args.node,
        nproc_per_node=args.nproc_per_node,
        reporter=args.reporter,
        stall_factor=args.stall_factor,
        stall_floor_s=args.stall_floor_s,
        checkpoint_interval=args.checkpoint_interval,
        info={"recipe": args.recipe, "restart_mode": args.restart_mode},
    )
    registry = CollectorRegistry()
    collector = RunCollector(view)
    registry.register(collector)
    # The exporter's own CPU and memory (process_cpu_seconds_total, ...): what it costs the node.
    ProcessCollector(registry=registry)
    try:
        server, thread = start_http_server(args.port, addr=args.addr, registry=registry)
    except OSError as err:
        message = (
            f"warning: no metrics: the exporter cannot listen on {args.addr}:{args.port} ({err}); "
            "training goes on without it"
        )
        print(message, file=sys.stderr, flush=True)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    print(f"metrics: http://{args.addr}:{args.port}/metrics", flush=True)
    stop.wait()
    if args.final_scrape_wait_s > 0:
        collector.wait_for_next_scrape(timeout_s=args.final_scrape_wait_s)
    server.shutdown()
    thread.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
