"""Pod start-up check, run before rendezvous: does this machine fit the job?

Run: ``python -m training.startup_check [--expect-device cuda|cpu|auto]``. Reads ``NPROC_PER_NODE``
(ranks this node will start; default 1) and ``EXPECT_DEVICE`` (default ``cuda``; the flag wins).
Prints one JSON line (torch, CUDA, driver, NCCL versions, GPU count, libfabric EFA provider) and
exits 0, or prints one ``startup_check: <field>: <problem>; <fix>`` line per misfit to stderr and
exits ``training.exits.ENVIRONMENT`` (the pod failure policy fails the Job: a new pod on the same
node type would meet the same misfit).

Checks on ``cuda``: CUDA available, ``torch.cuda.device_count() >= NPROC_PER_NODE``, NCCL built
in, and the CUDA driver at least the torch build's CUDA major (CUDA 13 needs an R580+ driver:
NVIDIA's CUDA toolkit release notes, table 3). The EFA provider is reported, and required only
when ``REQUIRE_EFA=1`` (set by the EKS launch script; absent on a single-node or local run).
On ``cpu``: only that torch imports and ``NPROC_PER_NODE`` is a positive integer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from training import exits

# Minimum NVIDIA driver major per CUDA major (CUDA release notes, "CUDA Toolkit and Minimum
# Required Driver Version"): 12.x needs >= 525, 13.x needs >= 580.
MIN_DRIVER_FOR_CUDA: dict[int, int] = {12: 525, 13: 580}


@dataclass
class Report:
    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def efa_provider() -> str | None:
    """``fi_info -p efa`` output's first provider line, or None without fi_info / EFA."""
    fi_info = shutil.which("fi_info") or (
        "/opt/amazon/efa/bin/fi_info" if os.path.exists("/opt/amazon/efa/bin/fi_info") else None
    )
    if fi_info is None:
        return None
    try:
        out = subprocess.run(
            [fi_info, "-p", "efa"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        if line.strip().startswith("provider:"):
            return line.split(":", 1)[1].strip()
    return None


def driver_version() -> str | None:
    """NVIDIA driver version from ``nvidia-smi`` (None without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def check(
    *,
    expect_device: str,
    nproc_per_node: str,
    require_efa: bool,
    cuda_available: bool,
    device_count: int,
    torch_version: str,
    cuda_version: str | None,
    nccl_version: str | None,
    driver: str | None,
    efa: str | None,
) -> Report:
    """Pure decision over the facts gathered by :func:`gather` (tested on CPU with real values)."""
    report = Report(
        facts={
            "expect_device": expect_device,
            "torch": torch_version,
            "cuda": cuda_version,
            "driver": driver,
            "nccl": nccl_version,
            "gpus": device_count,
            "nproc_per_node": nproc_per_node,
            "efa_provider": efa,
        }
    )
    problems = report.problems
    try:
        nproc = int(nproc_per_node)
        if nproc < 1:
            raise ValueError
    except ValueError:
        problems.append(
            f"NPROC_PER_NODE: must be a positive integer, got {nproc_per_node!r}; "
            "set it to the number of ranks per node"
        )
        return report
    if expect_device == "cpu":
        return report
    if not cuda_available or cuda_version is None:
        problems.append(
            f"cuda: torch {torch_version} sees no usable CUDA (build CUDA {cuda_version}); "
            "use the image's CUDA torch on a GPU node with the NVIDIA device plugin"
        )
        return report
    if device_count < nproc:
        problems.append(
            f"NPROC_PER_NODE: {nproc} ranks but {device_count} GPUs visible; "
            "request nvidia.com/gpu equal to NPROC_PER_NODE"
        )
    if nccl_version is None:
        problems.append("nccl: torch was built without NCCL; use the CUDA torch wheel")
    cuda_major = int(cuda_version.split(".")[0])
    need = MIN_DRIVER_FOR_CUDA.get(cuda_major)
    if driver is not None and need is not None and int(driver.split(".")[0]) < need:
        problems.append(
            f"driver: {driver} is older than CUDA {cuda_version} needs (>= {need}); "
            "use a node AMI with a newer NVIDIA driver"
        )
    if require_efa and efa != "efa":
        problems.append(
            "efa: libfabric has no EFA provider (fi_info -p efa); request vpc.amazonaws.com/efa "
            "and use the image with the EFA installer"
        )
    return report


def gather(*, expect_device: str, nproc_per_node: str, require_efa: bool) -> Report:
    import torch

    cuda_available = torch.cuda.is_available()
    nccl = None
    if torch.distributed.is_nccl_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    return check(
        expect_device=expect_device,
        nproc_per_node=nproc_per_node,
        require_efa=require_efa,
        cuda_available=cuda_available,
        device_count=torch.cuda.device_count() if cuda_available else 0,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        nccl_version=nccl,
        driver=driver_version() if expect_device == "cuda" else None,
        efa=efa_provider(),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.startup_check")
    parser.add_argument(
        "--expect-device",
        choices=("cuda", "cpu", "auto"),
        default=os.environ.get("EXPECT_DEVICE", "cuda"),
        help="auto (the run's parallel.device default): cuda when torch sees a GPU, else cpu",
    )
    args = parser.parse_args(argv)
    expect = args.expect_device
    if expect == "auto":
        import torch

        expect = "cuda" if torch.cuda.is_available() else "cpu"
    report = gather(
        expect_device=expect,
        nproc_per_node=os.environ.get("NPROC_PER_NODE", "1"),
        require_efa=os.environ.get("REQUIRE_EFA", "0") == "1",
    )
    print(json.dumps({"startup_check": report.facts}, separators=(",", ":")), flush=True)
    for problem in report.problems:
        print(f"startup_check: {problem}", file=sys.stderr, flush=True)
    return exits.ENVIRONMENT if report.problems else exits.OK


if __name__ == "__main__":
    sys.exit(main())
