"""Real replica-group jobs for the fault tests: 2 groups x 2 CPU ranks (gloo) through
``python -m training.launch.local --restart replica``, and what their run directories say.

Shared by ``test_replica_fault.py`` and ``test_replica_faults.py`` (the fault-free reference
run is computed once per session: ``conftest.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO_ROOT, TINY_MODEL, subprocess_env, tail

STEPS = 14
COMMON = (
    *TINY_MODEL,
    f"--train.steps={STEPS}",
    "--train.log_every=1",
    "--checkpoint.interval=8",
    "--restart=replica",
    "--resilience.replica_groups=2",
    "--resilience.replica_semantics=wait",  # bit-identical: the failed step is redone by all
    "--resilience.heartbeat_timeout_s=20",
    # A survivor that saw the failed all-reduce waits for the group inside its step section.
    "--resilience.step_section_timeout_s=240",
    "--resilience.replica_wait_s=240",
    "--parallel.pg_timeout_s=60",
)


def start(run_dir: Path, corpus: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    command = [
        sys.executable,
        "-m",
        "training.launch.local",
        "--nproc=4",
        "--metrics-port=0",
        "--no-report",
        "--run-dir",
        str(run_dir),
        f"--data.path={corpus}",
        *COMMON,
        *extra,
    ]
    log = run_dir.parent / f"{run_dir.name}.log"
    handle = open(log, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, env=subprocess_env(), stdout=handle, stderr=subprocess.STDOUT
    )
    return proc, log


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def committed_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


def pids_of(run_dir: Path, rank: int) -> list[int]:
    """Every process rank ``rank`` of a group had, in order (each writes its pid with its
    ``replica_*`` events, the first at its first quorum)."""
    found: list[int] = []
    for e in events(run_dir):
        if e["kind"].startswith("replica_") and e["rank"] == rank and e["pid"] not in found:
            found.append(e["pid"])
    return found


def wait_for_step(
    proc: subprocess.Popen, log: Path, group_dir: Path, step: int, *, timeout: float = 300
) -> None:
    """Until the group has committed ``step`` and each of its ranks has written its pid."""
    deadline = time.monotonic() + timeout
    while committed_steps(group_dir) < step or not (
        pids_of(group_dir, 0) and pids_of(group_dir, 1)
    ):
        assert proc.poll() is None, tail(log, 120)
        assert time.monotonic() < deadline, f"{group_dir.name} never reached step {step}"
        time.sleep(0.1)


def signal_group(group_dir: Path, sig: signal.Signals, *, ranks: tuple[int, ...]) -> list[int]:
    """Send ``sig`` to the current process of each of the group's ``ranks``; their pids."""
    victims = [pids_of(group_dir, rank)[-1] for rank in ranks]
    for pid in victims:
        os.kill(pid, sig)
    return victims


def wait(proc: subprocess.Popen, log: Path, *, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"run timed out after {timeout}s; log tail:\n{tail(log)}")
    assert proc.returncode == 0, tail(log, 120)
