"""The ``pytest_gpu`` check: gpu-marked tests in a child pytest, one result per test case."""

from __future__ import annotations

import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

from gpu_checks.core import CheckResult, Context, run_child, tail


def parse_junit(xml_text: str) -> list[CheckResult]:
    """One result per test case of pytest's JUnit XML (skips kept, marked skipped)."""
    results = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped") is not None
        detail: dict[str, Any] = {}
        if failure is not None:
            detail["message"] = (failure.get("message") or "")[:2000]
        if skipped:
            detail["reason"] = case.find("skipped").get("message", "")
        results.append(
            CheckResult(
                name=f"pytest:{name}",
                ok=failure is None,
                seconds=round(float(case.get("time", "0") or 0), 1),
                detail=detail,
                skipped=skipped and failure is None,
            )
        )
    return results


# --- shared helpers ------------------------------------------------------------------------------


def run_gpu_tests(ctx: Context, *, tests: tuple[str, ...]) -> list[CheckResult]:
    """``tests`` (node ids from the repository root), in a child pytest."""
    started = time.perf_counter()
    junit = ctx.work / "junit.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *tests,
    ]
    log = ctx.work / "pytest_gpu.log"
    try:
        proc = run_child(ctx, command, log=log, cap_s=ctx.left_s())
    except TimeoutError as err:
        return [
            CheckResult(
                name="pytest_gpu",
                ok=False,
                seconds=round(time.perf_counter() - started, 1),
                detail={"message": str(err)},
            )
        ]
    if not junit.exists():
        return [
            CheckResult(
                name="pytest_gpu",
                ok=False,
                seconds=round(time.perf_counter() - started, 1),
                detail={"returncode": proc.returncode, "tail": tail(log)},
            )
        ]
    results = parse_junit(junit.read_text())
    return results or [
        CheckResult(name="pytest_gpu", ok=False, seconds=0.0, detail={"tail": "no test"})
    ]
