"""A slow node, emulated: a pod's processes frozen for most of every period (the slow-node test).

Why a duty cycle and not a CFS quota: CFS bandwidth control (``cpu.max``, ``cpu.cfs_quota_us``;
kernel docs, scheduler/sched-bwc.rst) lets a group that was idle spend its quota, and each
CPU's leftover slice, at full speed. On a CPU rank the straggler detector scores one rank-local
section, AdamW's ~1.3 ms ``optimizer`` step between two collective waits, so under a quota of
1 ms per 10 ms the rank's forward and backward ran 10x slower while its optimizer step mostly
did not: of 60 such 1.6 ms sections after an idle wait, 57 ran unthrottled; the detector then
missed the node in one report of two. A node that runs only ``on_us`` of every
``on_us + off_us`` slows every section alike, as a slow GPU slows every kernel: of 60 sections
after an idle wait, 58 took ~11 ms. (A one-off measurement on the development machine, kernel
6.18: docs/stragglers.md says how; no benchmark here repeats it.)

The freezer cgroup stops the processes without a signal they or their parents could see
(kernel docs, admin-guide/cgroup-v1/freezer-subsystem.rst; cgroup v2 ``cgroup.freeze``), and
every process they start later is born in it. The cycle runs in its own process at a real-time
priority, so neither this process's GIL nor a loaded machine stretches the windows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from podsim.machine import root_reason

V1_FREEZER = Path("/sys/fs/cgroup/freezer")
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
"""The unified hierarchy: at the cgroup root on a v2 host, under ``unified`` on a hybrid one."""


def _freezer_root() -> Path | None:
    if (V1_FREEZER / "tasks").exists():
        return V1_FREEZER
    for root in V2_ROOTS:
        if (root / "cgroup.controllers").is_file():
            return root
    return None


def slow_node_reason() -> str | None:
    """None when `SlowNode` can work here, else why not (one line, with the fix)."""
    if _freezer_root() is None:
        return (
            "no freezer cgroup here (no v1 /sys/fs/cgroup/freezer, no cgroup v2 hierarchy): "
            "run on a host or VM with one (mount -t cgroup2 none /sys/fs/cgroup)"
        )
    return root_reason("a freezer cgroup")


class SlowNode:
    """`pids`, and every process they start later, run ``on_us`` of every
    ``on_us + off_us`` microseconds and are frozen for the rest. ``close`` thaws them, moves
    what is left back to the hierarchy's root and removes the group."""

    def __init__(
        self, pids: list[int], *, name: str, on_us: int = 1000, off_us: int = 9000
    ) -> None:
        root = _freezer_root()
        if root is None:
            raise RuntimeError(slow_node_reason())
        self.root = root
        self.group = root / name
        self.group.mkdir()
        self._state = self.group / ("freezer.state" if root == V1_FREEZER else "cgroup.freeze")
        self._cycler: subprocess.Popen[str] | None = None
        self.periods = 0
        try:
            for pid in pids:
                self._move(pid, self.group)
            self._cycler = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "podsim.slow_node",
                    f"--state-file={self._state}",
                    f"--on-us={on_us}",
                    f"--off-us={off_us}",
                ],
                stdout=subprocess.PIPE,
                text=True,
                cwd=Path(__file__).resolve().parent.parent,
            )
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _move(pid: int, group: Path) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has exited
            (group / "cgroup.procs").write_text(str(pid))

    @property
    def cycler_pid(self) -> int | None:
        return None if self._cycler is None else self._cycler.pid

    def pids(self) -> list[int]:
        return [int(p) for p in (self.group / "cgroup.procs").read_text().split()]

    def close(self) -> None:
        """Stops the cycle (its process thaws the group on SIGTERM) and removes the group;
        ``periods`` is then how many periods the group was frozen in."""
        if self._cycler is not None:
            self._cycler.send_signal(signal.SIGTERM)
            out, _ = self._cycler.communicate(timeout=30)
            self.periods = int(out.strip() or 0)
            self._cycler = None
        _thaw(self._state)
        for pid in self.pids():
            self._move(pid, self.root)
        self.group.rmdir()


def _freeze(state: Path) -> None:
    state.write_text("FROZEN" if state.name == "freezer.state" else "1")


def _thaw(state: Path) -> None:
    state.write_text("THAWED" if state.name == "freezer.state" else "0")


def _cycle(*, state: Path, on_s: float, off_s: float) -> int:
    """Freezes and thaws until SIGTERM, or until the process that started it is gone (a test
    killed without its ``finally``): then the group is left thawed, never frozen for good."""
    owner = os.getppid()
    stopped = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    # Real-time, so that the windows hold on a loaded machine (sched(7): SCHED_FIFO runs
    # before every normal thread); it sleeps for all but a few microseconds of each period.
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    periods = 0
    try:
        while not stopped and os.getppid() == owner:
            _freeze(state)
            time.sleep(off_s)
            _thaw(state)
            periods += 1
            time.sleep(on_s)
    finally:
        _thaw(state)
    return periods


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-file", type=Path, required=True)
    parser.add_argument("--on-us", type=int, required=True)
    parser.add_argument("--off-us", type=int, required=True)
    args = parser.parse_args(argv)
    periods = _cycle(state=args.state_file, on_s=args.on_us / 1e6, off_s=args.off_us / 1e6)
    try:
        print(periods, flush=True)
    except BrokenPipeError:  # the owner is gone, and its end of the pipe with it
        os._exit(0)


if __name__ == "__main__":
    main()
