"""The slow node's duty cycle (podsim/slow_node.py) never outlives the test that started it.

Real: the freezer cgroup, the real-time cycler process, SIGKILL. Needs root (cgroups)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from podsim.slow_node import _freezer_root, _thaw, slow_node_reason

pytestmark = [pytest.mark.requires(reason=slow_node_reason()), pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]


def _state_file(group: Path) -> Path:
    v1 = group / "freezer.state"
    return v1 if v1.exists() else group / "cgroup.freeze"


def _state(group: Path) -> str:
    text = _state_file(group).read_text().strip()
    return {"1": "FROZEN", "0": "THAWED"}.get(text, text)


def test_a_killed_owner_leaves_the_pod_thawed_and_the_cycle_stopped(tmp_path: Path) -> None:
    """The test process that starts a slow node dies without its ``finally`` (SIGKILL, as
    pytest-timeout's thread method ends a test): the cycler sees its owner gone, thaws the
    group and exits, so the pod's processes are not left frozen for good."""
    name = f"slow-node-orphan-{os.getpid()}"
    sleeper = subprocess.Popen(["sleep", "120"])
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from podsim.slow_node import SlowNode
                node = SlowNode([{sleeper.pid}], name={name!r})
                print(node.cycler_pid, flush=True)
                time.sleep(120)
                """
            ),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    group = _freezer_root() / name
    try:
        cycler = int(owner.stdout.readline())
        deadline = time.monotonic() + 10
        while _state(group) != "FROZEN":  # the cycle runs: frozen 9 ms of every 10
            assert time.monotonic() < deadline, "the slow node never froze its pod"
            time.sleep(0.001)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while _cycler_alive(cycler):
            assert time.monotonic() < deadline, "the cycler outlived its owner"
            time.sleep(0.05)
        assert _state(group) == "THAWED"
        assert sleeper.pid in [int(p) for p in (group / "cgroup.procs").read_text().split()]
    finally:
        sleeper.kill()
        sleeper.wait()
        owner.kill()
        owner.wait()
        if group.exists():
            _thaw(_state_file(group))
            group.rmdir()


def _cycler_alive(pid: int) -> bool:
    """Alive and not a zombie (its parent, the killed owner, is gone: init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
