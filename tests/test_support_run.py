"""tests/support.py's ``run_in_repo``: a command that outlives its timeout takes its whole
process group with it (a launcher's ranks must never outlive the test that started them)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO_ROOT, run_in_repo, subprocess_env

PYTEST = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose: it holds no CPU and no file.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.timeout(60)
def test_a_timeout_kills_the_commands_children_too(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    command = ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; wait"]
    with pytest.raises(pytest.fail.Exception, match="timed out after 2"):
        run_in_repo(command, timeout=2)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), f"the command's child {child} outlived the timeout"


def test_a_command_that_ends_returns_its_output_and_code() -> None:
    proc = run_in_repo(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout=30)
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == ["out", "err"]


LEAVES_A_PROCESS = """
import subprocess


def test_leaves_a_rank_behind():
    # A launcher that ends and leaves a rank in a session of its own (torch elastic's
    # workers): orphaned, out of reach of any process group.
    subprocess.run(["bash", "-c", "setsid sleep 300 & echo $! > {pid_file}"], check=True)
"""


@pytest.mark.timeout(120)
def test_the_suite_ends_what_a_tests_call_left_running(tmp_path: Path) -> None:
    """tests/conftest.py's teardown: a process the test's call started and orphaned, in a
    session of its own (out of reach of its process group), is SIGKILLed after the test and
    named in the summary."""
    pid_file = tmp_path / "child.pid"
    test = tmp_path / "test_leaky.py"
    test.write_text(LEAVES_A_PROCESS.replace("{pid_file}", str(pid_file)))
    inner = subprocess_env(PYTHONPATH=f"{REPO_ROOT / 'tests'}:{REPO_ROOT}")
    proc = subprocess.run(
        [*PYTEST, "--rootdir", str(tmp_path), "-c", "/dev/null", str(test)],
        cwd=tmp_path,
        env=inner,
        capture_output=True,
        text=True,
        timeout=100,
    )
    child = int(pid_file.read_text())
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert not _alive(child), "the test's child outlived its test"
        assert "killed 1 process(es) its call left running" in proc.stdout, proc.stdout
        assert "sleep 300" in proc.stdout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
