"""The replica groups of one job on this machine: the Lighthouse, then one launcher per group.

Each group is an ordinary in-job launch of its own (``training.command``: the same
``ft_launcher`` command line a node of the EKS Job runs, its own rendezvous), so a fault inside
a group is restarted by that group's launcher alone; the groups meet only at torchft's
Lighthouse. Each group writes its own run directory (``<run_dir>/group-<g>``: events, metrics,
checkpoints), since its ranks are numbered from 0 inside it.

Standard library only.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from training.config import JobConfig
from training.replica.topology import GROUP_ENV, LIGHTHOUSE_ENV, group_sizes, lighthouse_command

LIGHTHOUSE_START_S = 120.0
"""How long the Lighthouse gets to accept connections before the launch fails. Its console
script imports the ``torchft`` package, and with it torch (``torchft/__init__.py``): seconds,
tens of seconds on a loaded machine."""


def group_dir(run_dir: str | Path, group: int) -> Path:
    return Path(run_dir) / f"group-{group}"


def group_args(*, config: JobConfig, train_args: Sequence[str], group: int) -> list[str]:
    """The trainer arguments of one group: the job's, with the group's own run directory (and
    checkpoint directory, when one is set apart from it). Later flags win (``build_config``)."""
    args = [*train_args, f"--run-dir={group_dir(config.run_dir, group)}"]
    if config.checkpoint.dir:
        args.append(f"--checkpoint.dir={group_dir(config.checkpoint.dir, group)}")
    return args


@dataclass(frozen=True, kw_only=True)
class GroupLaunch:
    group: int
    command: list[str]
    env: dict[str, str]


def group_launches(
    *,
    config: JobConfig,
    train_args: Sequence[str],
    nproc: int,
    lighthouse: str,
    command_of: Callable[[list[str], int, int], list[str]],
    env: dict[str, str],
) -> list[GroupLaunch]:
    """One launch per group; ``command_of(trainer_args, nproc_per_group, group)`` is the
    launcher command of one group (its own rendezvous)."""
    groups = config.resilience.replica_groups
    per_group = group_sizes(world_size=nproc, groups=groups)
    return [
        GroupLaunch(
            group=g,
            command=command_of(
                group_args(config=config, train_args=train_args, group=g), per_group, g
            ),
            env={**env, GROUP_ENV: str(g), LIGHTHOUSE_ENV: lighthouse},
        )
        for g in range(groups)
    ]


def start_lighthouse(
    *, min_replicas: int, port: int, bin_path: str, log_path: Path
) -> subprocess.Popen[bytes]:
    """The Lighthouse, up and accepting connections (a clear error if it is not).
    ``min_replicas``: ``ResilienceConfig.replica_min_groups``. Its log goes to ``log_path``: it
    logs every quorum tick's status, and a pipe nobody reads fills up (64 KiB) and blocks it in
    the middle of a run (seen: every group stuck at a quorum after ~30 steps)."""
    command = lighthouse_command(min_replicas=min_replicas, port=port)
    command[0] = bin_path
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"the torchft Lighthouse exited at start ({process.returncode}): {err}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(
        f"the torchft Lighthouse did not listen on port {port} in {LIGHTHOUSE_START_S} s"
    )


def stop(process: subprocess.Popen[bytes], *, timeout_s: float = 5.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_groups(launches: Sequence[GroupLaunch], *, log: Callable[[str], None]) -> int:
    """Start every group's launcher and wait for all; the job's exit code is the first failed
    group's (0 when every group finished). A failed group's launcher has used up its own
    restarts: the other groups then wait at the quorum until their timeout, so they are
    stopped instead."""
    processes = []
    for launch in launches:
        log(f"+ [group {launch.group}] " + " ".join(launch.command))
        processes.append(subprocess.Popen(launch.command, env=launch.env))
    code = 0
    try:
        while any(p.poll() is None for p in processes):
            failed = [p.returncode for p in processes if p.returncode not in (None, 0)]
            if failed:
                code = failed[0]
                break
            time.sleep(0.2)
        else:
            code = next((p.returncode for p in processes if p.returncode), 0)
    finally:
        for p in processes:
            stop(p, timeout_s=30.0)
    return code
