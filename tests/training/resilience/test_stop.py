"""SIGTERM to a rank blocked in a collective ends it within seconds; a healthy rank keeps its
final checkpoint. Real processes, a real gloo process group and real signals.

Run: .venv/bin/pytest tests/training/resilience/test_stop.py
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO_ROOT, free_port, subprocess_env

from training import exits

PROBE = Path(__file__).parents[1] / "probes" / "stop_probe.py"


def _start(role: str, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(PROBE), role, str(port)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_ready(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sigterm_ends_a_rank_blocked_in_a_collective_within_its_grace() -> None:
    port = free_port()
    blocked = _start("blocked", port)
    frozen = _start("frozen", port)
    try:
        _wait_ready(blocked)
        time.sleep(0.5)  # inside the all-reduce now
        sent = time.monotonic()
        blocked.send_signal(signal.SIGTERM)
        code = blocked.wait(timeout=30)
        took = time.monotonic() - sent
        stderr = blocked.stderr.read() if blocked.stderr else ""
        assert code == exits.PREEMPTED, stderr
        assert "no step boundary within 2.0 s" in stderr
        # Without the watcher, the rank would sit in the all-reduce for its 120 s timeout.
        assert took < 20, took
    finally:
        for proc in (blocked, frozen):
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_a_healthy_rank_keeps_its_final_checkpoint_past_the_grace() -> None:
    healthy = _start("healthy", free_port())
    _wait_ready(healthy)
    healthy.send_signal(signal.SIGTERM)
    assert healthy.wait(timeout=30) == 0, healthy.stderr.read() if healthy.stderr else ""


@pytest.mark.timeout(60)
def test_progress_restarts_the_grace_and_a_rank_that_stops_progressing_still_exits() -> None:
    """Progress (a checkpoint wait's passes) keeps a rank past its 2 s grace; once it shows
    none, it exits 143 within the grace of its last progress, not later."""
    proc = _start("progressing", free_port())
    try:
        _wait_ready(proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - sent
        stdout, stderr = proc.communicate()
        assert code == exits.PREEMPTED, stderr
        assert "blocked" in stdout, "ended before its progress stopped"
        assert "no step boundary within 2.0 s of the signal or of the rank's last progress" in (
            stderr
        )
        assert 6.5 <= took < 20, took  # its last progress ~5 s in, then the 2 s grace
    finally:
        proc.kill()
        proc.wait()
