"""A real Prometheus server (Debian's `prometheus` package) scrapes the exporter of a real
`make train`-sized local run (`python -m training.launch.local`, 2 CPU ranks), loads the
project's alert rules, and answers PromQL queries with the run's step counter; and the
exporter process itself: its text format, its final scrape on SIGTERM.

    .venv/bin/pytest tests/observability/test_prometheus_scrape.py -q    # ~40 s on 2 cores

Skipped, with the reason, where the `prometheus` binary is not installed
(`apt-get install prometheus`; .ci/run installs it). The server runs on a loopback port with
its own data directory, for at most the test's timeout; the package's own service is not used.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from promql_names import REPO_ROOT
from support import (
    TINY_MODEL,
    free_port,
    prometheus_server,
    requires_tool,
    subprocess_env,
    tail,
)

from training.observe.catalog import METRICS
from training.runlog.files import METRICS_FILE, append_jsonl

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.timeout(240)
needs_prometheus = requires_tool("prometheus")
STEPS = 40


def _get(url: str, *, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def _query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    body = json.loads(_get(url))
    assert body["status"] == "success", body
    return body["data"]["result"]


def _prometheus_config(tmp_path: Path, *, target_port: int) -> Path:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(REPO_ROOT / "observability" / "alerts.yaml")],
        "scrape_configs": [
            {"job_name": "trainer", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}
        ],
    }
    path = tmp_path / "prometheus.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@needs_prometheus
def test_prometheus_scrapes_a_local_run(tmp_path: Path, corpus: Path) -> None:
    metrics_port = free_port()
    config = _prometheus_config(tmp_path, target_port=metrics_port)
    run_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    with prometheus_server(config, data_dir=tmp_path / "prometheus") as prom_port:
        with open(log, "w") as handle:
            train = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "training.launch.local",
                    "--nproc=2",
                    f"--metrics-port={metrics_port}",
                    "--no-report",
                    "--run-dir",
                    str(run_dir),
                    f"--data.path={corpus}",
                    *TINY_MODEL,
                    f"--train.steps={STEPS}",
                    "--checkpoint.interval=20",
                ],
                cwd=REPO_ROOT,
                env=subprocess_env(),
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
            seen: list[float] = []
            while train.poll() is None:
                result = _query(prom_port, 'training_steps_total{job="trainer"}')
                if result:
                    seen.append(float(result[0]["value"][1]))
                time.sleep(0.5)
        assert train.returncode == 0, tail(log)
        # Scraped during the run: a counter that rose, never past the run's steps.
        assert seen, f"prometheus never saw the step counter:\n{tail(log)}"
        assert seen == sorted(seen) and 0 < seen[-1] <= STEPS, seen
        assert len(set(seen)) > 1, f"one sample only: {seen}"
        # The server's view after the run, through PromQL.
        stored = _query(prom_port, 'max_over_time(training_steps_total{job="trainer"}[10m])')
        assert 0 < float(stored[0]["value"][1]) <= STEPS
        # The exporter left with the run: its series are stale now, so read back in time.
        labels = _query(prom_port, "last_over_time(training_info[10m])")[0]["metric"]
        assert labels["training_job"] == "run" and labels["world_size"] == "2"
        assert labels["restart_mode"] == "none"
        tokens = _query(prom_port, 'increase(training_tokens_total{job="trainer"}[10m])')
        assert tokens and float(tokens[0]["value"][1]) > 0
        commits = _query(prom_port, "max_over_time(training_checkpoint_last_commit_step[10m])")
        assert float(commits[0]["value"][1]) >= 20
        # The alert rules loaded, and a healthy run raised none of the training alerts (the
        # nodes group's NodeFencerDown fires here by design: no node fencer runs locally).
        rules = json.loads(_get(f"http://127.0.0.1:{prom_port}/api/v1/rules"))
        groups = {g["name"]: g["rules"] for g in rules["data"]["groups"]}
        assert {"training", "gpu", "nodes"} <= set(groups), sorted(groups)
        training = groups["training"]
        assert {r["name"] for r in training} >= {"TrainingStalled", "TrainingRestartStorm"}
        assert all(r["state"] == "inactive" for r in training + groups["gpu"]), training


def _exporter(run_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "training.observe.exporter",
            f"--run-dir={run_dir}",
            "--job=demo",
            "--reporter",
            "--stall-factor=10",
            "--stall-floor-s=60",
            f"--port={port}",
            *extra,
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _scrape(port: int) -> str:
    deadline = time.monotonic() + 20
    while True:
        try:
            return _get(f"http://127.0.0.1:{port}/metrics")
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_the_exporter_serves_the_text_format_and_waits_for_a_final_scrape(
    tmp_path: Path,
) -> None:
    import prometheus_client  # noqa: F401  (pinned in the lock: missing fails, never skips)

    append_jsonl(tmp_path / METRICS_FILE, {"time": 1.0, "step": 1, "step_time_s": 0.5})
    port = free_port()
    exporter = _exporter(tmp_path, port, "--final-scrape-wait-s=30")
    try:
        text = _scrape(port)
        assert 'training_steps_total{training_job="demo"} 1.0' in text
        assert "# TYPE training_step_duration_seconds gauge" in text
        served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
        # The catalog's families (and prometheus_client's _created samples of counters), and
        # the process collector's own (the exporter's CPU and memory).
        unknown = served - set(METRICS) - {f"{n.removesuffix('_total')}_created" for n in METRICS}
        assert {n for n in unknown if not n.startswith("process_")} == set()
        assert "process_cpu_seconds_total" in served
        # Scraped once: on SIGTERM it serves one more scrape, then leaves.
        exporter.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert exporter.poll() is None, "left without its final scrape"
        append_jsonl(tmp_path / METRICS_FILE, {"time": 2.0, "step": 2, "step_time_s": 0.5})
        assert 'training_steps_total{training_job="demo"} 2.0' in _scrape(port)
        assert exporter.wait(timeout=10) == 0
    finally:
        exporter.kill()
        exporter.wait()


def test_an_exporter_nobody_scraped_leaves_at_once(tmp_path: Path) -> None:
    import prometheus_client  # noqa: F401  (pinned in the lock: missing fails, never skips)

    port = free_port()
    exporter = _exporter(tmp_path, port, "--final-scrape-wait-s=30")
    try:
        assert exporter.stdout is not None
        assert "metrics: http://127.0.0.1" in exporter.stdout.readline()
        started = time.monotonic()
        exporter.send_signal(signal.SIGTERM)
        assert exporter.wait(timeout=10) == 0
        assert time.monotonic() - started < 5
    finally:
        exporter.kill()
        exporter.wait()


def test_a_taken_port_costs_a_message_not_the_run(tmp_path: Path) -> None:
    import prometheus_client  # noqa: F401  (pinned in the lock: missing fails, never skips)

    port = free_port()
    first = _exporter(tmp_path, port)
    try:
        _scrape(port)
        second = _exporter(tmp_path, port)
        output, _ = second.communicate(timeout=20)
        assert second.returncode == 1
        assert f"cannot listen on 127.0.0.1:{port}" in output
    finally:
        first.kill()
        first.wait()
