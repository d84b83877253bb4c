"""Ends every process of a local run when its launcher ends, however it ends.

The local launcher (``training/launch/local.py``) starts this watcher first, in a session of
its own (a closed terminal's SIGHUP and a Ctrl-C reach the launcher's process group, not it),
with a pipe on its stdin whose only write end the launcher holds, and marks its own environment
with ``RUN_MARK_ENV=<token>`` so that every process the run starts inherits the mark: torchrun
or ft_launcher, the ranks, their helpers, the exporter. When the launcher ends (returns, exits,
is SIGKILLed or OOM-killed) the kernel closes the pipe; the watcher reads EOF, SIGKILLs every
process whose environment carries the token, again until none is left, and removes the pod
memory directories (``/dev/shm``) the launcher named on the pipe.

Why not the parent-death signal (``PR_SET_PDEATHSIG``) or the process group: the ranks run in
sessions of their own (torch elastic starts each worker with ``start_new_session``), NVRx's
in-process layer double-forks a monitor per rank that its parent never waits for, and the
parent-death signal is set per child by whoever forks it, clears on fork, and fires when the
forking *thread* ends (prctl(2)), so it would have to be set inside torch's and NVRx's
spawners. The environment is inherited through every fork and exec of all of them.

Standard library only; Linux only (``/proc/<pid>/environ``, proc(5)).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

RUN_MARK_ENV = "TRAINING_LOCAL_RUN"
"""The environment variable that marks every process of one local run."""
SWEEP_ROUNDS = 100
SWEEP_PAUSE_S = 0.1
"""A process may fork between two sweeps (ft_launcher respawning a worker): sweep until one
finds nothing, up to ``SWEEP_ROUNDS`` rounds this far apart."""
TRACKER_GRACE_S = 3.0


def _carries(environ: Path, token: str) -> bool:
    try:
        return f"{RUN_MARK_ENV}={token}".encode() in environ.read_bytes().split(b"\0")
    except OSError:  # gone meanwhile, or not ours
        return False


def marked_pids(token: str, *, proc: Path = Path("/proc")) -> list[int]:
    """The live processes whose environment carries ``RUN_MARK_ENV=token`` (zombies have an
    empty environ, and processes of other users cannot be read: neither is listed)."""
    return [
        int(entry.name)
        for entry in proc.iterdir()
        if entry.name.isdigit()
        and int(entry.name) != os.getpid()
        and _carries(entry / "environ", token)
    ]


def kill_if_marked(pid: int, token: str) -> bool:
    """SIGKILL `pid` if it still carries the mark; whether it was signalled.

    The PID may have been reused since the scan. A pidfd pins the process that holds the PID
    when it is opened: if that process is still alive when the signal is sent through the pidfd,
    it was alive at the check too, so the environment checked was its own; if it has ended, the
    signal fails with ESRCH and reaches no one (pidfd_open(2), pidfd_send_signal(2))."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if not _carries(Path(f"/proc/{pid}/environ"), token):
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def sweep(token: str) -> tuple[int, list[int]]:
    """SIGKILL every process marked with `token` until none is left, up to ``SWEEP_ROUNDS``
    rounds; how many were killed, and the PIDs still marked after the last round.

    Python's multiprocessing resource trackers go last: once every process that used one is
    gone, a tracker unlinks the named semaphores they left in ``/dev/shm`` (``sem.mp-*``) and
    exits by itself; one still there after ``TRACKER_GRACE_S`` is killed as well."""
    killed: set[int] = set()
    trackers_since: float | None = None
    for _ in range(SWEEP_ROUNDS):
        pids = marked_pids(token)
        if not pids:
            break
        workers = [pid for pid in pids if not _is_resource_tracker(pid)]
        if not workers:
            trackers_since = trackers_since or time.monotonic()
            if time.monotonic() - trackers_since < TRACKER_GRACE_S:
                time.sleep(SWEEP_PAUSE_S)
                continue
        killed.update(pid for pid in workers or pids if kill_if_marked(pid, token))
        time.sleep(SWEEP_PAUSE_S)
    else:
        return len(killed), marked_pids(token)
    return len(killed), []


def left_message(pids: list[int]) -> str:
    listed = " ".join(map(str, pids))
    return (
        f"local run ended: {len(pids)} process(es) it left are still running after "
        f"{SWEEP_ROUNDS} rounds of SIGKILL: PID {listed} (kill -9 {listed})"
    )


def watch(token: str) -> None:
    """Block until stdin reaches EOF (the launcher ended), collecting the directories it names,
    then sweep the run's processes and remove those directories."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    remove: list[str] = []
    for line in sys.stdin:
        if line.startswith("rmtree "):
            remove.append(line.removeprefix("rmtree ").rstrip("\n"))
    killed, left = sweep(token)
    if left:
        print(left_message(left), file=sys.stderr, flush=True)
    for path in remove:
        shutil.rmtree(path, ignore_errors=True)
    if killed:
        print(
            f"local run ended: its launcher is gone; killed {killed} process(es) it left",
            file=sys.stderr,
            flush=True,
        )


class Reaper:
    """The launcher's side: start the watcher and mark this process's environment."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if k != RUN_MARK_ENV}
        read_end, write_end = os.pipe()  # non-inheritable (PEP 446): only this process writes
        self._process = subprocess.Popen(
            [sys.executable, "-m", "training.launch.reaper", self.token],
            stdin=read_end,
            env=env,
            start_new_session=True,
        )
        os.close(read_end)
        self._pipe = os.fdopen(write_end, "w", buffering=1)
        os.environ[RUN_MARK_ENV] = self.token

    def remove_at_end(self, path: str | Path) -> None:
        """Remove `path` (a run's ``/dev/shm`` directory) once every process is gone."""
        self._pipe.write(f"rmtree {path}\n")

    def close(self) -> None:
        """The normal end: let the watcher sweep now and wait for it."""
        os.environ.pop(RUN_MARK_ENV, None)
        self._pipe.close()
        self._process.wait()


if __name__ == "__main__":
    watch(sys.argv[1])
