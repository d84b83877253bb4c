"""A real Prometheus (Debian's `prometheus`) scrapes the metrics exporter of an emulated trainer pod
(podsim/cluster.py: the EKS Job's exact container command, in its own network namespace)
through the pod's IP and the container's named port, as the stack's scraper does.

Run: sudo .venv/bin/pytest tests/pods/test_pods_metrics.py -q    (root; about 1 minute)

Emulated, because they cannot exist here: the API server (the target is the pod's IP, given
statically, instead of pod discovery: tests/infra/test_infra_observability.py runs the
scraper's relabeling), AMP's managed scraper (a plain Prometheus), the GPU and EFA.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from support import free_port, missing_tools

from podsim import cluster as emulator
from podsim.jobs import ONE_POD, STEPS, logs, run
from training.observe.catalog import METRICS_PORT, METRICS_PORT_NAME

reason = emulator.can_run() or missing_tools("prometheus")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.requires(reason=reason),
    pytest.mark.timeout(400),
]


def _query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]["result"]


def test_prometheus_scrapes_the_pod_and_reads_its_final_state(tmp_path: Path) -> None:
    pod_ip = f"{emulator.SUBNET}.10"  # completion index 0 (emulator.add_pod_slot)
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "trainer", "static_configs": [{"targets": [f"{pod_ip}:{METRICS_PORT}"]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        root = tmp_path / "cluster"
        result, job = run(root, "smoke", restart="injob", env=ONE_POD, nodes=1)
        assert result.status == "Complete", logs(root)
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT} in container["ports"]
        time.sleep(2)  # the newest samples reach the query engine
        steps = _query(port, 'max_over_time(training_steps_total{job="trainer"}[10m])')
        assert steps, f"prometheus never scraped the pod:\n{logs(root)}"
        assert float(steps[0]["value"][1]) == STEPS
        # The pod's exporter waited for one more scrape after the run ended: the run's final
        # state (not active, every step) reached Prometheus before the pod went away.
        active = _query(port, 'last_over_time(training_run_active{job="trainer"}[10m])')
        assert float(active[0]["value"][1]) == 0
        job_label = _query(port, "last_over_time(training_info[10m])")[0]["metric"]
        assert job_label["training_job"] == job["metadata"]["name"]
    finally:
        server.terminate()
        server.wait(timeout=10)
