"""Pod start-up check (training/startup_check.py).

Run: ``.venv/bin/pytest tests/training/test_startup_check.py -q``. The CUDA branch cannot run
here (no GPU): its decisions are tested through :func:`check` with the values a p5 pod reports;
the CPU mode runs for real, as the module, the way the launch script calls it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from training import exits
from training.startup_check import check

P5 = dict(
    expect_device="cuda",
    nproc_per_node="8",
    require_efa=True,
    cuda_available=True,
    device_count=8,
    torch_version="2.13.0",
    cuda_version="13.0",
    nccl_version="2.28.9",
    driver="580.95.05",
    efa="efa",
)


def test_p5_fits() -> None:
    assert check(**P5).problems == []


def test_each_misfit_names_its_field() -> None:
    cases = {
        "NPROC_PER_NODE": {"device_count": 4},
        "driver": {"driver": "570.1"},
        "efa": {"efa": None},
        "nccl": {"nccl_version": None},
        "cuda": {"cuda_available": False},
    }
    for field, change in cases.items():
        problems = check(**{**P5, **change}).problems
        assert len(problems) == 1 and problems[0].startswith(field + ":"), (field, problems)


def test_bad_nproc() -> None:
    (problem,) = check(**{**P5, "nproc_per_node": "eight"}).problems
    assert problem.startswith("NPROC_PER_NODE:")


def _run(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "training.startup_check", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_cpu_mode_passes_here() -> None:
    out = _run({"NPROC_PER_NODE": "2"}, "--expect-device", "cpu")
    assert out.returncode == exits.OK, out.stderr
    facts = json.loads(out.stdout)["startup_check"]
    assert facts["nproc_per_node"] == "2" and facts["torch"].startswith("2.13.0")


def test_cuda_expected_on_cpu_machine_fails_with_environment_code() -> None:
    out = _run({"NPROC_PER_NODE": "8", "EXPECT_DEVICE": "cuda"})
    assert out.returncode == exits.ENVIRONMENT
    assert "startup_check: cuda:" in out.stderr
