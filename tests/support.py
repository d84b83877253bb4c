"""Helpers shared by the test modules (imported as ``support``; fixtures live in conftest.py).

Not a test module: it only builds corpora, starts real training jobs and reads their output.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The model small enough that a 2-rank CPU step takes tens of milliseconds: one owner, shared
# with the benchmarks.
from bench.common import TINY_MODEL  # noqa: F401  (re-exported to the tests)

REPO_ROOT = Path(__file__).resolve().parents[1]

VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port free right now on this host (for a test's own store)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_learnable_text(path: Path, *, lines: int = 1500, seed: int = 0) -> None:
    """Eight words in cyclic order, starting at a random word: easy to learn, not trivial."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    text = []
    for _ in range(lines):
        k = rng.randrange(len(words))
        text.append(" ".join(words[(k + j) % len(words)] for j in range(len(words))) + ".")
    path.write_text("\n".join(text) + "\n")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # torch's import of pynvml warns on stderr; keep CLI stderr to our own messages.
        PYTHONWARNINGS="ignore::FutureWarning",
        CI="1",  # plain log lines, never a progress bar
        # No TensorBoard tailer in the many short local runs (1-2 s of CPU each on 2 cores);
        # tests/training/runlog/test_tensorboard.py and the emulated pods run it.
        TRAINING_TENSORBOARD="0",
    )
    env.update(extra)
    return env


@dataclass(frozen=True)
class RunResult:
    returncode: int
    output: str  # stdout and stderr together
    run_dir: Path


def run_torchrun(
    *, nproc: int, run_dir: Path, args: list[str] | tuple[str, ...], timeout: float = 150
) -> RunResult:
    """``torchrun --standalone --nproc-per-node N -m training train --run-dir DIR ARGS``."""
    command = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "training",
        "train",
        "--run-dir",
        str(run_dir),
        *args,
    ]
    proc = run_in_repo(command, timeout=timeout)
    return RunResult(returncode=proc.returncode, output=proc.stdout, run_dir=run_dir)


def run_in_repo(command: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository root with the test environment, stdout and stderr
    together in ``.stdout``; a timeout fails the test with the output's tail."""
    try:
        return subprocess.run(
            command,
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as err:
        output = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        pytest.fail(f"{Path(command[0]).name} timed out after {timeout}s:\n{output[-4000:]}")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(run_dir)]


def committed_checkpoints(run_dir: Path, *, root: Path | None = None) -> list[Path]:
    """Committed checkpoints under `root` (default ``<run_dir>/checkpoints``), oldest first."""
    root = run_dir / "checkpoints" if root is None else root
    return sorted(p for p in root.glob("step_*") if (p / "commit.json").is_file())


def final_state(run_dir: Path, *, checkpoint_root: Path | None = None) -> dict[str, Any]:
    """The newest committed checkpoint as one flat dict (``trainer.model....`` keys)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoints = committed_checkpoints(run_dir, root=checkpoint_root)
    assert checkpoints, f"no committed checkpoint for {run_dir}"
    out = run_dir / "final_state.pt"
    dcp_to_torch_save(checkpoints[-1], out)
    return flatten(torch.load(out, weights_only=False))


def assert_identical(state: dict[str, Any], reference: dict[str, Any], *, steps: int) -> None:
    """Bit-identical final states: every tensor (model and optimizer) `torch.equal`."""
    import torch

    assert state.keys() == reference.keys()
    tensors = [k for k, v in reference.items() if isinstance(v, torch.Tensor)]
    assert any(".optim." in k for k in tensors), "optimizer state must be part of the check"
    different = [k for k in tensors if not torch.equal(state[k], reference[k])]
    assert different == [], f"{len(different)} tensors differ, e.g. {different[:3]}"
    assert state["trainer.step"] == reference["trainer.step"] == steps


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    if isinstance(tree, list | tuple):
        flat = {}
        for index, value in enumerate(tree):
            flat.update(flatten(value, f"{prefix}{index}."))
        return flat
    return {prefix[:-1]: tree}


# ---------------------------------------------------------------------------------------------
# local jobs through python -m training.launch.local (torchrun or ft_launcher), with a log file
# ---------------------------------------------------------------------------------------------


def launch_local(
    run_dir: Path, corpus: Path, *args: str, nproc: int = 2, timeout: float = 200
) -> subprocess.CompletedProcess:
    """``python -m training.launch.local`` with output in ``<run_dir>.log`` (``proc.log``)."""
    command = [
        sys.executable,
        "-m",
        "training.launch.local",
        f"--nproc={nproc}",
        "--run-dir",
        str(run_dir),
        f"--data.path={corpus}",
        *args,
    ]
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as handle:
        try:
            proc = subprocess.run(
                command,
                cwd=REPO_ROOT,
                env=subprocess_env(),
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"run timed out after {timeout}s; log tail:\n{tail(log)}")
    proc.log = log  # type: ignore[attr-defined]
    return proc


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


# --- what a test needs from the machine ----------------------------------------------------
# One owner for "this test needs X": a test marked with `requires_tool` / `requires_root` is
# skipped, with one line naming the install command, where X is missing; CI (.ci/run) sets
# REQUIRE_ALL_ENV so that a missing X fails there instead (tests/conftest.py applies both).
REQUIRE_ALL_ENV = "TESTS_REQUIRE_ALL"
KUBECTL_INSTALL = "install kubectl: https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/"
INSTALL = {
    "make": "apt-get install make",
    "gcc": "apt-get install gcc",
    "promtool": "apt-get install prometheus",
    "prometheus": "apt-get install prometheus",
    "amtool": "apt-get install prometheus-alertmanager",
    "kubectl": KUBECTL_INSTALL,
    "ip": "apt-get install iproute2",
    "unshare": "apt-get install util-linux",
    "node": "install Node.js >= 20: https://nodejs.org/en/download",
    "aws": "pip install awscli (or AWS CLI v2: https://aws.amazon.com/cli/)",
}
"""How to install each tool a test may need (Debian/Ubuntu package names)."""


def which(tool: str) -> str | None:
    """`tool` on PATH or beside this Python (the venv's console scripts: shellcheck, ruff)."""
    import shutil

    local = VENV_BIN / tool
    return shutil.which(tool) or (str(local) if local.exists() else None)


def missing_tools(*tools: str) -> str | None:
    """None when every tool is there, else one line naming what is missing and its install."""
    missing = [tool for tool in tools if which(tool) is None]
    if not missing:
        return None
    installs = "; ".join(dict.fromkeys(INSTALL.get(tool, f"install {tool}") for tool in missing))
    return f"{', '.join(missing)} not installed ({installs})"


def requires(reason: str | None) -> pytest.MarkDecorator:
    """Mark a test that needs something from the machine, missing when `reason` (one line,
    naming the fix) is set: skipped, or failed under ``TESTS_REQUIRE_ALL=1``."""
    return pytest.mark.requires(reason=reason)


def skip_or_fail(reason: str) -> None:
    """Inside a test or fixture: what `requires` does, for a need found only at run time."""
    if os.environ.get(REQUIRE_ALL_ENV) == "1":
        pytest.fail(f"{REQUIRE_ALL_ENV}=1 and {reason}", pytrace=False)
    pytest.skip(reason)


def cdk_cli_reason() -> str | None:
    """None when the pinned CDK CLI is installed, else one line saying how to install it."""
    if (REPO_ROOT / "node_modules" / ".bin" / "cdk").exists():
        return None
    return "the pinned CDK CLI is not installed (make setup: npm ci installs node_modules/)"


def requires_tool(*tools: str) -> pytest.MarkDecorator:
    """Mark a test (or module, as ``pytestmark``) that runs `tools`."""
    return requires(missing_tools(*tools))


def node_reason() -> str | None:
    """None when Node.js is at least package.json's ``engines`` (aws-cdk-lib's jsii runtime and
    the CDK CLI run on it), else one line saying what to install."""
    import re

    engines = json.loads((REPO_ROOT / "package.json").read_text())["engines"]["node"]
    least = int(re.search(r"\d+", engines).group())
    node = which("node")
    if node is None:
        return f"node not installed ({INSTALL['node']})"
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0] or 0) < least:
        return f"node {version} is older than package.json's {engines} ({INSTALL['node']})"
    return None


def root_reason(what: str) -> str | None:
    """None when running as root, else one line saying `what` needs root and how to run."""
    if os.geteuid() == 0:
        return None
    return f"{what} need root (run as root: sudo .venv/bin/pytest ...)"


def requires_root(what: str) -> pytest.MarkDecorator:
    """Mark a test that needs root (network namespaces, mounts)."""
    return requires(root_reason(what))
