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


@pytest.mark.timeout(60)
def test_the_makes_a_test_runs_get_nothing_of_the_calling_make(tmp_path: Path) -> None:
    """``make test ARGS=...`` ran ``make -n train TARGET=eks`` in a test with pytest's ARGS
    as its own (the submit refused them). The environment a recipe of a real make sees, with
    what ``tests/conftest.py`` forgets of it: every command-line variable and MAKEFLAGS, and
    nothing else."""
    import json
    import subprocess
    import sys

    from support import forget_the_calling_make

    dump = tmp_path / "env.json"
    (tmp_path / "dump.py").write_text(
        f"import json, os\nopen({str(dump)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
    )
    (tmp_path / "Makefile").write_text(f"all:\n\t@{sys.executable} dump.py\n")
    subprocess.run(
        ["make", "-s", "-k", "all", "ARGS=-x -q tests/a.py", "TEST_WORKERS=2"],
        cwd=tmp_path,
        check=True,
    )
    seen = json.loads(dump.read_text())
    assert seen["ARGS"] == "-x -q tests/a.py" and "MAKEFLAGS" in seen  # what make hands down
    left = dict(seen)
    forget_the_calling_make(left)
    gone = set(seen) - set(left)
    assert {"ARGS", "TEST_WORKERS", "MAKEFLAGS", "MAKELEVEL"} <= gone, gone
    assert gone <= {"ARGS", "TEST_WORKERS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES"}
