"""The local run's watcher (training/launch/reaper.py) on its own, with real processes: a stand-in
launcher starts it, then a child that double-forks a process into a session of its own (as
NVRx's in-process monitor and torch elastic's workers are), and writes a /dev/shm directory.
Whichever way the launcher ends, nothing it started is left. The whole run, in every restart
mode: test_local_run_ends.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REPO_ROOT, subprocess_env

from training.launch import reaper

LAUNCHER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from pathlib import Path
    from training.launch.reaper import Reaper

    # A terminal's session: SIGHUP ends the process. A suite started under nohup would hand
    # its children SIGHUP ignored (signal(7): an ignored disposition survives fork and exec).
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

    shm = Path(sys.argv[1])
    reaper = Reaper()
    shm.mkdir()
    (shm / "snapshot").write_bytes(b"x" * 4096)
    reaper.remove_at_end(shm)
    # A child that leaves a grandchild in its own session, parented to init, then exits.
    subprocess.run([sys.executable, "-c",
        "import os, subprocess, sys, time\\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
        " start_new_session=True)\\n"])
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("ready", flush=True)
    if sys.argv[2] == "return":
        sys.stdin.readline()  # the test has counted the sleepers
        reaper.close()
        print("closed", flush=True)
    else:
        worker.wait()
    """
)


def _sleepers(token_dir: Path) -> list[int]:
    """The stand-in's sleeping processes: found by their command line, not by the mark."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        sleeper = cmdline.endswith(b"-c\0import time; time.sleep(600)\0")
        if sleeper and str(token_dir).encode() in environ:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["SIGKILL", "SIGHUP-to-the-group", "return"])
def test_nothing_outlives_the_launcher(end: str, tmp_path: Path) -> None:
    shm = Path("/dev/shm") / f"pytest-reaper-{tmp_path.name}-{os.getpid()}"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(shm), end],
        cwd=REPO_ROOT,
        env=subprocess_env(PYTEST_REAPER_CASE=str(tmp_path)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert launcher.stdout is not None
        assert launcher.stdout.readline() == "ready\n"
        started = time.monotonic() + 20  # a forked sleeper shows its command line once it execs
        while len(_sleepers(tmp_path)) < 2 and time.monotonic() < started:
            time.sleep(0.05)
        assert len(_sleepers(tmp_path)) == 2, "the stand-in did not start its two sleepers"
        assert shm.is_dir()
        if end == "SIGKILL":
            os.kill(launcher.pid, signal.SIGKILL)
        elif end == "SIGHUP-to-the-group":  # a closed terminal: its process group gets SIGHUP
            os.killpg(launcher.pid, signal.SIGHUP)
        else:
            assert launcher.stdin is not None
            launcher.stdin.write("\n")
            launcher.stdin.flush()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 20
        while (_sleepers(tmp_path) or shm.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _sleepers(tmp_path) == []
        assert not shm.exists()
    finally:
        for pid in _sleepers(tmp_path):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        subprocess.run(["rm", "-rf", str(shm)], check=False)


@pytest.fixture
def unrelated_sleeper() -> Iterator[subprocess.Popen]:
    """A process that is not part of any run (no mark in its environment)."""
    env = {k: v for k, v in subprocess_env().items() if k != reaper.RUN_MARK_ENV}
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
    try:
        yield sleeper
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.timeout(60)
def test_a_pid_reused_after_the_scan_is_not_killed(
    unrelated_sleeper: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the /proc scan and the signal a marked process may exit and its PID go to an
    unrelated process: emulated by a scan that names the unrelated sleeper's PID once. The
    watcher checks the mark again on a pidfd of that PID, which pins the process it checked."""
    scans = iter([[unrelated_sleeper.pid]])
    monkeypatch.setattr(reaper, "marked_pids", lambda token: next(scans, []))
    monkeypatch.setattr(reaper, "SWEEP_PAUSE_S", 0.0)
    assert reaper.sweep("token-of-another-run") == (0, [])
    time.sleep(0.2)
    assert unrelated_sleeper.poll() is None, "an unrelated process was killed"


@pytest.mark.timeout(60)
def test_processes_left_after_every_round_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process SIGKILL does not end in time (uninterruptible sleep on a hung mount, emulated
    by a signal that is not delivered) is named, PID by PID, instead of given up silently."""
    token = f"pytest-{tmp_path.name}"
    env = subprocess_env(**{reaper.RUN_MARK_ENV: token})
    marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
    try:
        deadline = time.monotonic() + 20  # its environ is readable once it has exec'd
        while reaper.marked_pids(token) != [marked.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        monkeypatch.setattr(reaper, "SWEEP_ROUNDS", 3)
        monkeypatch.setattr(reaper, "SWEEP_PAUSE_S", 0.0)
        monkeypatch.setattr(reaper.signal, "pidfd_send_signal", lambda fd, sig: None)
        assert reaper.sweep(token)[1] == [marked.pid]
        assert reaper.left_message([marked.pid]) == (
            f"local run ended: 1 process(es) it left are still running after "
            f"{reaper.SWEEP_ROUNDS} rounds of SIGKILL: PID {marked.pid} (kill -9 {marked.pid})"
        )
    finally:
        marked.kill()
        marked.wait()
