"""The CPU side of the device check (tests/gpu_check.py): argument handling, the JUnit parsing
and report building, a clean refusal without CUDA, the private-torch-name gate, the list of
gpu-marked tests it runs, and its in-process checks run through the same entry point with CUDA
faked at the device boundary (``GPU_CHECK_FAKE_CUDA=1``: CPU ranks, gloo, fp32). The whole
check, offline, in a clean environment with only the carried wheels:
test_gpu_check_offline.py.

Run: ``.venv/bin/pytest tests/training/test_gpu_check.py`` (~30 s, CPU only).
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import gpu_check
import pytest
import torch
from gpu_checks import checkpoints, environment

from training import exits

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.training.test_gpu_resilience" name="test_local" time="12.5"/>
<testcase classname="tests.training.test_gpu_resilience" name="test_restart" time="40.1">
  <failure message="assert 1 == 2">traceback</failure></testcase>
<testcase classname="tests.training.test_parallel" name="test_cpu_only" time="0.0">
  <skipped message="needs a CUDA GPU"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit_keeps_passes_failures_and_skips() -> None:
    local, restart, skipped = gpu_check.parse_junit(JUNIT)
    assert local.ok and local.seconds == 12.5 and not local.skipped
    assert local.name == "pytest:tests.training.test_gpu_resilience::test_local"
    assert not restart.ok and restart.detail["message"] == "assert 1 == 2"
    assert skipped.ok and skipped.skipped and "CUDA" in skipped.detail["reason"]


def test_report_is_ok_only_when_something_ran_and_nothing_failed() -> None:
    ok = gpu_check.CheckResult(name="a", ok=True, seconds=1.0)
    bad = gpu_check.CheckResult(name="b", ok=False, seconds=2.0)
    skip = gpu_check.CheckResult(name="c", ok=True, seconds=0.0, skipped=True)
    report = gpu_check.build_report([ok, skip], device={}, budget_s=480)
    assert report["ok"] and report["seconds"] == 1.0 and len(report["checks"]) == 2
    assert not gpu_check.build_report([ok, bad], device={}, budget_s=480)["ok"]
    assert not gpu_check.build_report([skip], device={}, budget_s=480)["ok"]
    assert not gpu_check.build_report([ok], device={}, budget_s=480, error="x")["ok"]
    json.dumps(report)  # serialisable as is


def test_arguments() -> None:
    args = gpu_check.parse_args(["--only", "fsdp_step", "--layers", "2"])
    assert args.only == ["fsdp_step"] and args.layers == 2 and args.budget_s == 480
    assert args.model == "8b_slice" and args.wheels is None
    for bad in (["--budget-s", "0"], ["--layers", "0"], ["--only", "nope"], ["--model", "x"]):
        with pytest.raises(SystemExit) as info:
            gpu_check.parse_args(bad)
        assert info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_cleanly_without_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(gpu_check.FAKE_ENV, raising=False)
    out = tmp_path / "report.json"
    code = gpu_check.main(["--out", str(out)])
    assert code == exits.ENVIRONMENT
    report = json.loads(out.read_text())
    assert report["ok"] is False and "no CUDA device" in report["error"]
    assert report["checks"] == [] and report["device"]["torch"] == torch.__version__
    assert json.loads(capsys.readouterr().out) == report


def test_wheel_options_are_dropped_from_the_rerun() -> None:
    argv = ["--wheels", ".whl", "--site=/tmp/s", "--only", "fsdp_step", "--out", "r.json"]
    rest = [a for i, a in enumerate(argv) if not gpu_check._is_wheel_option(argv, i)]
    assert rest == ["--only", "fsdp_step", "--out", "r.json"]


def test_a_missing_private_torch_name_skips_the_checks_that_need_it_naming_it() -> None:
    """On a torch without one of the trainer's private names the checks that use it are skipped
    with that name as the reason; the others run. Every name is present in this torch."""
    assert environment.missing_private_names() == {}
    missing = {"torch.cuda._sleep": "absent in torch"}
    assert environment.blocked_by_missing_names("inprocess_restart", missing) == [
        "torch.cuda._sleep"
    ]
    assert environment.blocked_by_missing_names("fsdp_step", missing) == []
    (result,) = gpu_check.run_check("inprocess_restart", None, missing)  # skipped before ctx
    assert result.skipped and "torch.cuda._sleep" in result.detail["reason"]


def test_every_gpu_marked_test_is_run_by_the_check() -> None:
    """A new gpu-marked test is in exactly one row's ``tests``: ``pytest_gpu`` runs it, or the
    row's check runs its subject, so none is forgotten on the GPU machine."""
    marked = set()
    for path in (gpu_check.REPO_ROOT / "tests").rglob("test_*.py"):
        text = path.read_text()
        for match in re.finditer(r"@pytest\.mark\.gpu\n(?:@.*\n)*def (test_\w+)", text):
            marked.add(f"{path.relative_to(gpu_check.REPO_ROOT)}::{match.group(1)}")
    listed = [node for check in gpu_check.CHECKS for node in check.tests]
    assert marked, "no gpu-marked test found"
    assert len(listed) == len(set(listed)), "a test in two rows"
    assert marked == set(listed), marked ^ set(listed)
    assert gpu_check.BY_NAME["pytest_gpu"].tests == gpu_check.GPU_TESTS


def test_the_table_drives_the_run_the_options_and_the_documentation() -> None:
    """One row per check, in the order the run and the report keep: ``--only`` offers the rows,
    the module docstring and docs/gpu.md list them in that order, the private-name gate names
    only rows, and a row that needs a GPU is skipped on the CPU stand-in with its reason."""
    names = gpu_check.CHECK_NAMES
    assert names == (
        "environment",
        "fsdp_step",
        "ac_compile",
        "memory_snapshot",
        "pod_memory_snapshot",
        "peer_exchange",
        "nvrx_snapshot",
        "torch_async",
        "local_checkpoint",
        "inprocess_restart",
        "pytest_gpu",
    )
    assert all(check.proves and callable(check.run) for check in gpu_check.CHECKS)
    assert gpu_check.parse_args(["--only", names[-1]]).only == [names[-1]]
    documented = re.findall(r"^- ``(\w+)``: ", gpu_check.__doc__, flags=re.MULTILINE)
    assert tuple(documented) == names
    page = (gpu_check.REPO_ROOT / "docs/gpu.md").read_text()
    assert tuple(re.findall(r"^\| `(\w+)` \|", page, flags=re.MULTILINE)) == names
    for _module, _name, _where, checks in environment.PRIVATE_TORCH_NAMES:
        assert set(checks) <= set(names), checks
    (local,) = [c for c in gpu_check.CHECKS if c.needs_gpu]
    assert local.name == "local_checkpoint" and "CUDA tensors only" in local.needs_gpu


def test_the_pod_memory_and_peer_paths_are_checks_on_the_device() -> None:
    """The device check runs the pod-memory snapshot (cudaHostRegister, side stream, publish
    thread) and the peer exchange (its own thread and group, CUDA state, a restore from the
    peer) on CUDA, each a check of its own with a function behind it."""
    assert gpu_check.BY_NAME["pod_memory_snapshot"].run is checkpoints.check_pod_memory_snapshot
    assert gpu_check.BY_NAME["peer_exchange"].run is checkpoints.check_peer_exchange
    probe = gpu_check.REPO_ROOT / "tests/training/probes/peer_probe.py"
    assert probe.is_file() and str(probe.relative_to(gpu_check.REPO_ROOT)) in inspect.getsource(
        checkpoints.check_peer_exchange
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_peer_exchange_check_runs_with_cuda_faked_at_the_boundary(tmp_path: Path) -> None:
    """``peer_exchange`` as the GPU machine runs it, on CPU ranks: two ranks snapshot, exchange
    on the exchange thread while they go on, and a lost node's state comes back from its peer
    equal (the probe's own checks)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "report.json"
    command = [
        sys.executable,
        str(gpu_check.REPO_ROOT / "tests/gpu_check.py"),
        *("--only", "peer_exchange", "--out", str(out)),
    ]
    env = {**os.environ, gpu_check.FAKE_ENV: "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == exits.OK, proc.stdout[-3000:] + proc.stderr[-3000:]
    (check,) = json.loads(out.read_text())["checks"]
    assert check["name"] == "peer_exchange" and check["ok"] and not check["skipped"], check
    assert check["detail"]["problems"] == []
    assert all(seconds > 0 for seconds in check["detail"]["exchange_s"])


@pytest.mark.timeout(240)
def test_in_process_checks_run_with_cuda_faked_at_the_boundary(tmp_path: Path) -> None:
    """The entry point as the GPU machine runs it (``python tests/gpu_check.py``), its in-process
    checks on CPU with gloo and fp32 in place of CUDA, NCCL and bf16: the recipe lookups, model
    and parallel configs, timing, MFU and snapshot code all run, so a typo there fails CI. The
    subprocess checks run in test_gpu_check_offline.py."""
    import os
    import subprocess
    import sys

    out = tmp_path / "report.json"
    command = [
        sys.executable,
        str(gpu_check.REPO_ROOT / "tests/gpu_check.py"),
        *("--only", "environment", "--only", "fsdp_step"),
        *("--only", "ac_compile", "--only", "memory_snapshot"),
        *("--model", "tiny", "--seq-len", "32", "--steps", "1", "--layers", "1"),
        *("--only", "pod_memory_snapshot"),
        *("--ac-layers", "1", "--out", str(out)),
    ]
    env = {**os.environ, gpu_check.FAKE_ENV: "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == exits.OK, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == [
        "environment",
        "fsdp_step",
        "ac_compile",
        "memory_snapshot",
        "pod_memory_snapshot",
    ]
    assert report["ok"] and report["device"]["fake_cuda"] is True
    assert all(c["ok"] and not c["skipped"] for c in checks.values())
    env_detail = checks["environment"]["detail"]
    assert env_detail["torch_pin"] == "2.13.0" and env_detail["private_torch_names_missing"] == {}
    step = checks["fsdp_step"]["detail"]
    assert step["causal_mask_halved"] is False and step["parallel"]["activation_checkpointing"]
    assert step["finite"] and step["mfu"] is None  # no peak FLOP/s for a CPU
    assert "torch.compile" in checks["ac_compile"]["detail"]["skipped_part"]
    assert checks["memory_snapshot"]["detail"]["restored_equal"]
