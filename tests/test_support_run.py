"""tests/support.py's ``run_in_repo``: a command that outlives its timeout takes its whole
process group with it (a launcher's ranks must never outlive the test that started them)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support import run_in_repo


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
