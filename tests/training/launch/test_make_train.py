"""Smoke test of the documented entry point: ``make train`` (2 CPU ranks, 20 steps).

Run: ``.venv/bin/pytest tests/training/launch/test_make_train.py`` (~35 s on 2 cores). Uses the
repo's ``data/stdlib`` corpus (``make`` builds it if missing) and writes ``runs/<unique>``,
removed afterwards.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import uuid

import pytest
from support import REPO_ROOT, committed_checkpoints, read_metrics, requires_tool, subprocess_env


@pytest.mark.distributed
@pytest.mark.timeout(300)
@requires_tool("make")
def test_make_train_smoke() -> None:
    run = f"pytest-make-{uuid.uuid4().hex[:8]}"
    run_dir = REPO_ROOT / "runs" / run
    try:
        proc = subprocess.run(
            ["make", "train", "NPROC=2", "STEPS=20", f"RUN={run}", "ARGS=--checkpoint.interval=10"],
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=280,
        )
        assert proc.returncode == 0, proc.stdout[-4000:]
        records = read_metrics(run_dir)
        assert [r["step"] for r in records] == list(range(1, 21))
        losses = [r["loss"] for r in records]
        first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
        assert last < first - 0.5, f"loss did not fall: first5={first:.3f} last5={last:.3f}"
        steps = [int(p.name.removeprefix("step_")) for p in committed_checkpoints(run_dir)]
        assert 20 in steps and 10 in steps, steps
        commit = json.loads((run_dir / "checkpoints" / "step_00000020" / "commit.json").read_text())
        assert commit["step"] == 20 and commit["world_size"] == 2
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert summary["final_step"] == 20
        assert "steps completed" in proc.stdout and "completed" in proc.stdout
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
