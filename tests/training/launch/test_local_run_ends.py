"""No process outlives a local run: the launcher of ``make train`` SIGKILLed (as a closed terminal's
shell or the OOM killer does) takes every process of its run with it, in every restart mode.

Run: ``.venv/bin/pytest tests/training/launch/test_local_run_ends.py`` (~30 s a mode on 2 cores).
The test runs ``make train`` itself, waits until the ranks train and (in the modes that keep
snapshots in the pod's memory) have written one to ``/dev/shm``, SIGKILLs the process running
``training/launch/local.py``, then looks for any process that inherited the test's own
environment mark, and for the run's ``/dev/shm`` files. Before the fix every process of the run
(ft_launcher or torchrun, both ranks, NVRx's monitors, the exporter) kept training.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from support import REPO_ROOT, requires_tool, subprocess_env, tail

from training.command import LAUNCHERS
from training.modes import spec

MARK = "PYTEST_LOCAL_RUN_ENDS"
"""The test's own mark: every process the run starts inherits it from ``make``."""
START_TIMEOUT_S = 240
END_TIMEOUT_S = 60


def _marked(token: str) -> list[int]:
    needle = f"{MARK}={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _shm_files(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files the processes map (the snapshots, multiprocessing's semaphores)."""
    files = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        files |= {line.split()[-1] for line in maps.splitlines() if " /dev/shm/" in line}
    return files


def _steps(run_dir: Path) -> int:
    """Steps logged so far: in the run directory, or in each replica group's own
    (training.replica.launch.group_dir), the fewest of them."""
    paths = sorted(run_dir.glob("group-*/metrics.jsonl")) or [run_dir / "metrics.jsonl"]
    return min(p.read_text().count('"step"') if p.exists() else 0 for p in paths)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(START_TIMEOUT_S + END_TIMEOUT_S + 60)
@requires_tool("make")
@pytest.mark.parametrize("restart", sorted(LAUNCHERS))
def test_a_killed_launcher_leaves_no_process_and_no_shm(restart: str, tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    run = f"pytest-ends-{restart}-{token[:8]}"
    run_dir = REPO_ROOT / "runs" / run
    shm = Path("/dev/shm") / f"pytest-ends-{token[:8]}"
    log = tmp_path / "make.log"
    args = f"--checkpoint.pod_memory_dir={shm} --checkpoint.memory_interval=2"
    command = ["make", "train", "NPROC=2", "STEPS=100000", f"RESTART={restart}", f"RUN={run}"]
    make = subprocess.Popen(
        [*command, f"ARGS={args}"],
        cwd=REPO_ROOT,
        env=subprocess_env(**{MARK: token}),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _steps(run_dir) < 3 or (
            spec(restart).keeps_pod and not (shm.exists() and any(shm.iterdir()))
        ):
            assert make.poll() is None, f"make train ended early:\n{tail(log)}"
            assert time.monotonic() < deadline, (
                f"no training within {START_TIMEOUT_S}s:\n{tail(log)}"
            )
            time.sleep(0.5)
        pids = _marked(token)
        launchers = [pid for pid in pids if "training.launch.local" in _cmdline(pid)]
        assert len(launchers) == 1, [_cmdline(pid) for pid in pids]
        mapped = _shm_files(pids)
        os.kill(launchers[0], signal.SIGKILL)
        make.wait(timeout=30)
        deadline = time.monotonic() + END_TIMEOUT_S
        while (left := _marked(token)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, "outlived the launcher:\n" + "\n".join(
            f"{pid}: {_cmdline(pid)[:160]}" for pid in left
        )
        assert not (shm.exists() and any(shm.iterdir())), sorted(map(str, shm.iterdir()))
        assert not [path for path in mapped if Path(path).exists()], mapped
    finally:
        for pid in _marked(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
