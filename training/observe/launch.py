"""Start and stop the run's exporter process (``training/observe/exporter.py``) beside a
launcher: the pod supervisor starts one per pod, the local launcher one per run.

Standard library only: the pod supervisor imports this and must start in a second. The
exporter is a separate process so that it outlives every rank restart, and a failure to start
it (the port is taken) costs the run a warning, never the run itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from training.config import JobConfig
from training.observe.catalog import SCRAPE_INTERVAL_S

FINAL_SCRAPE_WAIT_S = 2 * SCRAPE_INTERVAL_S
"""At most this long, a pod's exporter keeps serving after the run completed, until the scraper
has read the run's final state (``training_run_active`` 0); no wait where nothing scrapes it."""


def exporter_command(
    *,
    config: JobConfig,
    job: str,
    node: int,
    nproc_per_node: int,
    reporter: bool,
    addr: str,
    port: int,
    final_scrape_wait_s: float = 0.0,
) -> list[str]:
    """The exporter's command line for `config`'s run: the thresholds come from its sections."""
    command = [
        sys.executable,
        "-m",
        "training.observe.exporter",
        f"--run-dir={config.run_dir}",
        f"--job={job}",
        f"--node={node}",
        f"--nproc-per-node={nproc_per_node}",
        f"--stall-factor={config.observe.stall_factor:g}",
        f"--stall-floor-s={config.observe.stall_floor_s:g}",
        f"--checkpoint-interval={config.checkpoint.interval}",
        f"--recipe={config.recipe}",
        f"--restart-mode={config.resilience.restart}",
        f"--addr={addr}",
        f"--port={port}",
        f"--final-scrape-wait-s={final_scrape_wait_s:g}",
    ]
    if reporter:
        command.append("--reporter")
    return command


def start_exporter(command: list[str]) -> subprocess.Popen | None:
    """Start the exporter without waiting for it (it prints its address, or why it cannot
    listen, and training goes on either way); None when the process cannot be started."""
    Path(_flag(command, "run-dir")).mkdir(parents=True, exist_ok=True)
    try:
        return subprocess.Popen(command)
    except OSError as err:
        print(f"warning: no metrics exporter: {err}", file=sys.stderr, flush=True)
        return None


def stop_exporter(process: subprocess.Popen | None, *, final_scrape: bool) -> None:
    """SIGTERM the exporter, then SIGKILL: at once, or, with `final_scrape` (the run is over),
    once it served its final scrape (its ``--final-scrape-wait-s``) plus a margin."""
    if process is None:
        return
    process.terminate()
    try:
        process.wait(timeout=FINAL_SCRAPE_WAIT_S + 5 if final_scrape else 2)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _flag(command: list[str], name: str) -> str:
    prefix = f"--{name}="
    return next(arg[len(prefix) :] for arg in command if arg.startswith(prefix))
