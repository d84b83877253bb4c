"""Smoke test of the benchmarks: the fastest path runs and its JSON has the keys others read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_quick_checkpoint_benchmark_writes_its_keys(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "BENCH_RESULTS_DIR": str(tmp_path / "results"),
        "BENCH_RUNS_DIR": str(tmp_path / "runs"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run_all", "--quick", "--only", "checkpoint"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results" / "checkpoint.json").read_text())
    for key in ("nvrx_async_blocking_s", "torch_async_blocking_s", "sync_blocking_s"):
        assert result[key] > 0, key
    assert result["all_committed"], result["problems"]
    assert {t["verdict"] for t in result["targets"]} <= {"PASS", "MISS", "n/a"}
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert summary["failed"] == []
    assert "checkpoint.nvrx_async_blocking_s" in summary["headlines"]
    assert "=== summary" in proc.stdout
