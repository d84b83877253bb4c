"""Smoke test of the peer exchange benchmark: its quick path runs through ``bench.run_all`` and
its JSON has the figures the docs quote (per mode, with spread, against the floor)."""

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
@pytest.mark.timeout(240)
def test_quick_peer_benchmark_reports_each_mode_against_its_floor(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "BENCH_RESULTS_DIR": str(tmp_path / "results"),
        "BENCH_RUNS_DIR": str(tmp_path / "runs"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run_all", "--quick", "--only", "peer", "--no-planner"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results" / "peer.json").read_text())
    assert result["floor_s"] > 0
    for mode in ("serial", "background"):
        spread = result["modes"][mode]["wall_s"]
        assert spread["min"] <= spread["median"] <= spread["max"], spread
        assert result["modes"][mode]["blocked_s_vs_floor"] > 0
    assert all(steps >= 6 for steps in result["steps_during_exchange"])
    assert result["p5_estimate"]["efa_gbits"] == 3200
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert "peer.background_blocked_s" in summary["headlines"] and summary["failed"] == []
