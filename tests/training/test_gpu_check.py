"""The CPU-side parts of the device check (tests/gpu_check.py): argument handling, the JUnit
parsing and report building, and a clean refusal without CUDA.

Run: ``.venv/bin/pytest tests/training/test_gpu_check.py`` (a few seconds, CPU only).
"""

from __future__ import annotations

import json
from pathlib import Path

import gpu_check
import pytest
import torch

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
    for bad in (["--budget-s", "0"], ["--layers", "0"], ["--only", "nope"]):
        with pytest.raises(SystemExit) as info:
            gpu_check.parse_args(bad)
        assert info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_cleanly_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.json"
    code = gpu_check.main(["--out", str(out)])
    assert code == exits.ENVIRONMENT
    report = json.loads(out.read_text())
    assert report["ok"] is False and "no CUDA device" in report["error"]
    assert report["checks"] == [] and report["device"]["torch"] == torch.__version__
    assert json.loads(capsys.readouterr().out) == report
