"""A slow node, emulated: a cgroup CPU quota on a pod's processes (the slow-node scenario)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from podsim.machine import root_reason


def cpu_quota_reason() -> str | None:
    """None when `CpuQuota` can work here, else why not (one line, with the fix)."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.is_file() and "cpu" in v2.read_text().split():
        return root_reason("a cgroup CPU quota")
    if Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").is_file():
        return root_reason("a cgroup CPU quota")
    return (
        "no cgroup cpu controller here (v2 without cpu, no v1 cpu): run on a host or VM "
        "whose cgroup root has one (mount -t cgroup -o cpu cpu /sys/fs/cgroup/cpu)"
    )


class CpuQuota:
    """A CPU quota on `pids` and on every process they start later (children stay in their
    parent's cgroup): CFS bandwidth control, the kernel's throttling of a CPU-starved container,
    lets the group run ``quota_us`` of every ``period_us`` and stops its threads for the rest
    of the period (kernel docs, scheduler/sched-bwc.rst). cgroup v2 ``cpu.max`` where the
    unified hierarchy has the cpu controller, else cgroup v1's ``cpu.cfs_quota_us`` (this
    development machine mounts v1 ``cpu`` beside a v2 hierarchy without controllers). Needs
    root. ``close`` moves what is left back to the hierarchy's root and removes the group."""

    def __init__(
        self, pids: list[int], *, name: str, quota_us: int = 1000, period_us: int = 10000
    ) -> None:
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        v1 = Path("/sys/fs/cgroup/cpu")
        if v2.is_file() and "cpu" in v2.read_text().split():
            # The root cgroup may hold processes and enable controllers for its children; a
            # container's cgroup namespace root may not (the no-internal-process rule).
            self.parent = v2.parent
            try:
                (self.parent / "cgroup.subtree_control").write_text("+cpu")
            except OSError as err:
                raise RuntimeError(
                    f"cannot enable the cpu controller under {self.parent} ({err}): run the "
                    "slow-node test on a host or VM whose cgroup root this process owns"
                ) from err
            self.group = self.parent / name
            self.group.mkdir()
            (self.group / "cpu.max").write_text(f"{quota_us} {period_us}")
        elif (v1 / "cpu.cfs_quota_us").is_file():
            self.parent = v1
            self.group = v1 / name
            self.group.mkdir()
            (self.group / "cpu.cfs_period_us").write_text(str(period_us))
            (self.group / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            raise RuntimeError(
                "no cgroup cpu controller (v2 /sys/fs/cgroup/cgroup.controllers without cpu, "
                "no v1 /sys/fs/cgroup/cpu): mount one to run the slow-node test"
            )
        try:
            for pid in pids:
                self._move(pid, self.group)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _move(pid: int, group: Path) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has exited
            (group / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        return [int(p) for p in (self.group / "cgroup.procs").read_text().split()]

    def throttled(self) -> int:
        """How many periods the group has been stopped in so far (cpu.stat nr_throttled)."""
        stat = dict(line.split() for line in (self.group / "cpu.stat").read_text().splitlines())
        return int(stat["nr_throttled"])

    def close(self) -> None:
        for pid in self.pids():
            self._move(pid, self.parent)
        self.group.rmdir()
