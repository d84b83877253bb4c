"""The device check end to end as the lent GPU machine runs it: ``make gpu-check`` with no
network, a Python that holds only what that machine's image holds, the wheels ``make
gpu-wheels`` fetched, and CUDA faked only at the device boundary (``GPU_CHECK_FAKE_CUDA=1``).

The stand-in for the machine (.library/device/KINDS.md: Python 3.12, torch 2.11.0+cu130 and the
packages its list names, nothing else; offline): a fresh virtual environment with no site
packages of its own but the distributions of ``MACHINE_PACKAGES``, linked from this checkout's
.venv. Its torch is the CPU torch 2.13.0 wheel on this machine's disk, standing in for the
machine's CUDA torch 2.11 (a CUDA build cannot run here; the private-name lookup the check does
is what covers 2.11, whose sources were read for it). Python is 3.11 here, so the wheels are the
cp311 builds of the same versions. The check runs in a new network namespace with only the
loopback up (``unshare -n``, as root): PyPI unreachable, torchrun's local rendezvous working,
as on the machine. The wheels are fetched before, as on the dev machine.

Run: ``.venv/bin/pytest tests/training/test_gpu_check_offline.py`` (slow: ~3 min, CPU only;
needs root for ``unshare -n`` and PyPI for ``make gpu-wheels``).
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import shlex
import subprocess
import sys
from pathlib import Path

import gpu_check
import pytest
from support import requires_root

REPO_ROOT = Path(__file__).resolve().parents[2]

# What the lent machine's image has (KINDS.md's package list) and the check needs; the check
# must get everything else (NVRx, ISA-L, defusedxml) from the carried wheels.
MACHINE_PACKAGES = (
    "torch",
    "typing_extensions",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "MarkupSafe",
    "filelock",
    "fsspec",
    "numpy",
    "PyYAML",
    "psutil",
    "nvidia-ml-py",
    "packaging",
    "pip",
    "pytest",
    "pluggy",
    "iniconfig",
    "Pygments",
    "pytest-timeout",
    "tqdm",
)
NOT_ON_THE_MACHINE = ("nvidia_resiliency_ext", "isal", "defusedxml", "training")


def make_machine(root: Path) -> Path:
    """A Python that sees only ``MACHINE_PACKAGES`` (and torch's console script ``torchrun``,
    which the machine's torch install has); returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    packages = root / "machine-packages"
    packages.mkdir()
    for name in MACHINE_PACKAGES:
        dist = metadata.distribution(name)
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            if top.startswith("..") or top == "__pycache__" or (packages / top).exists():
                continue
            (packages / top).symlink_to(base / top)
    (site,) = root.glob("lib/python*/site-packages")
    (site / "machine.pth").write_text(f"{packages}\n")
    python = root / "bin" / "python"
    torchrun = root / "bin" / "torchrun"
    torchrun.write_text(
        f"#!{python}\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n"
    )
    torchrun.chmod(0o755)
    return python


def offline(command: str, *, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``command`` in a new network namespace with only the loopback up."""
    return subprocess.run(
        ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {command}"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_make_gpu_check_runs_offline_with_only_the_carried_wheels(tmp_path: Path) -> None:
    wheels = tmp_path / "whl"
    fetch = subprocess.run(
        ["make", "--no-print-directory", "gpu-wheels", "GPU_PYVER=3.11", f"WHEEL_DIR={wheels}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fetch.returncode == 0, fetch.stdout + fetch.stderr
    fetched = sorted(p.name for p in wheels.glob("*.whl"))
    assert [n.split("-")[0] for n in fetched] == ["defusedxml", "isal", "nvidia_resiliency_ext"]
    assert sum(p.stat().st_size for p in wheels.iterdir()) < 8 << 20, "carry limit is 64 MiB"

    python = make_machine(tmp_path / "machine")
    env = {
        "PATH": f"{python.parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "GPU_CHECK_FAKE_CUDA": "1",
        "OMP_NUM_THREADS": "1",
    }
    for name in NOT_ON_THE_MACHINE:  # the stand-in leaks nothing from the dev .venv
        probe = subprocess.run(
            [str(python), "-c", f"import {name}"], cwd="/", env=env, capture_output=True
        )
        assert probe.returncode != 0, f"{name} is importable on the stand-in machine"

    site = tmp_path / "site"
    out = tmp_path / "report.json"
    args = f"--model tiny --seq-len 32 --steps 1 --layers 1 --ac-layers 1 --out {out}"
    make = (
        f"make --no-print-directory gpu-check GPU_PYTHON={python} WHEEL_DIR={wheels} "
        f"GPU_SITE={site} ARGS={shlex.quote(args)}"
    )
    proc = offline(make, env=env, timeout=800)
    assert out.is_file(), proc.stdout[-6000:]
    report = json.loads(out.read_text())
    failed = [c for c in report["checks"] if not c["ok"]]
    assert proc.returncode == 0 and report["ok"], json.dumps(failed)[:6000] + proc.stdout[-3000:]

    assert report["device"]["fake_cuda"] is True
    checks = {c["name"]: c for c in report["checks"] if not c["name"].startswith("pytest:")}
    assert list(checks) == [c for c in gpu_check.CHECK_NAMES if c != "pytest_gpu"]
    environment = checks["environment"]["detail"]
    assert environment["packages"] == {
        "nvidia-resiliency-ext": "0.4.1",
        "isal": metadata.version("isal"),
        "defusedxml": metadata.version("defusedxml"),
    }
    assert environment["import_problems"] == [] and environment["torch"] == "2.13.0+cpu"
    assert all(path.startswith(str(site)) for path in environment["package_paths"].values())
    assert checks["local_checkpoint"]["skipped"]
    assert "CUDA tensors only" in checks["local_checkpoint"]["detail"]["reason"]
    ran = [name for name, c in checks.items() if not c["skipped"]]
    assert ran == [
        "environment",
        "fsdp_step",
        "ac_compile",
        "memory_snapshot",
        "pod_memory_snapshot",
        "peer_exchange",
        "nvrx_snapshot",
        "torch_async",
        "inprocess_restart",
    ]
    restart = checks["inprocess_restart"]["detail"]
    assert restart["restarts"] == [1, 2] and restart["hang_detection_s"] < 5
    for snapshot in ("nvrx_snapshot", "torch_async"):
        assert checks[snapshot]["detail"]["problems"] == []
    gpu_tests = [c for c in report["checks"] if c["name"].startswith("pytest:")]
    assert len(gpu_tests) == len(gpu_check.GPU_TESTS) and all(c["skipped"] for c in gpu_tests)


pytestmark = requires_root("unshare -n (a network namespace without PyPI)")
