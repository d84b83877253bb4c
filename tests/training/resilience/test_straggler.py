"""A slow node during the run: detected, named and, with the policy on, evicted with a final
checkpoint; a fault-free run with the policy on evicts nothing.

Run: ``.venv/bin/pytest tests/training/resilience/test_straggler.py -q`` (about 1 min, two runs).

The rest of the story runs in the pod emulation (tests/pods/test_pods.py,
``test_a_slow_node_is_cordoned_and_moved_to_a_spare``): the Job's exact command in nested mode,
the evicted pod replaced on a spare and the run ending bit-identical.

Each rank is started as the Job starts a pod's rank (``python -m training train``, env://
rendezvous) with its own ``NODE_NAME`` (the downward API's ``spec.nodeName`` on EKS), so two
ranks stand for two one-GPU nodes. What cannot run here: the GPU (CUPTI kernel timings; CPU runs
time the optimizer section), and the Job's replacement of the exited pod on a spare (the resumed
pod emulation's test covers that).

The slow node: `support.DutyCycle` stops and continues the rank's process (SIGSTOP/SIGCONT),
9 ms of every 10 ms, the shape of a CPU quota at a short period.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import (
    REPO_ROOT,
    TINY_MODEL,
    DutyCycle,
    free_port,
    subprocess_env,
)

from training import exits
from training.checkpoint.layout import committed_steps

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(420)]

NODES = ("node-a", "node-b")
REPORT_EVERY = 10
REPORTS = 3
STEPS = REPORT_EVERY * (REPORTS + 2)  # room for a late first slow report, and steps after


def start_ranks(run_dir: Path, corpus: Path, *, run_id: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank, node in enumerate(NODES):
        env = subprocess_env(
            RANK=str(rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(len(NODES)),
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NODE_NAME=node,
            TORCHELASTIC_RUN_ID=run_id,
        )
        command = [
            sys.executable,
            "-m",
            "training",
            "train",
            f"--run-dir={run_dir}",
            f"--data.path={corpus}",
            *TINY_MODEL,
            f"--train.steps={STEPS}",
            "--train.log_every=10",
            "--checkpoint.interval=0",
            f"--straggler.report_every={REPORT_EVERY}",
            f"--straggler.reports={REPORTS}",
            "--straggler.evict=true",
        ]
        log = (run_dir.parent / f"{run_dir.name}.rank{rank}.log").open("w")
        procs.append(
            subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        )
    return procs


def wait_all(procs: list[subprocess.Popen], *, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def show_reports(label: str, run_dir: Path) -> None:
    """The scores, in the test's output (pytest -s, or on a failure)."""
    for e in events(run_dir, "straggler_report"):
        print(label, e["step"], e["nodes"], e["slow_streaks"])


def test_a_slow_node_is_named_and_evicted_with_a_final_checkpoint_and_no_other_is(
    corpus: Path, tmp_path: Path
) -> None:
    # Fault-free, policy on: nothing is evicted; every report names both nodes.
    reference = tmp_path / "reference"
    codes = wait_all(start_ranks(reference, corpus, run_id="reference"), timeout=180)
    show_reports("fault-free", reference)
    assert codes == [exits.OK, exits.OK]
    reports = events(reference, "straggler_report")
    assert [e["step"] for e in reports] == list(range(REPORT_EVERY, STEPS + 1, REPORT_EVERY))
    assert all(set(e["nodes"]) == set(NODES) for e in reports)
    assert events(reference, "straggler_eviction") == []

    # node-b slowed from the start: named, evicted; its rank exits NODE_UNFIT after the final
    # checkpoint, which every rank took at the same step; the other rank stops as on SIGTERM.
    slowed = tmp_path / "slowed"
    procs = start_ranks(slowed, corpus, run_id="slowed")
    throttle = DutyCycle([procs[1].pid])
    try:
        codes = wait_all(procs, timeout=240)
    finally:
        throttle.close()
    show_reports("slowed", slowed)
    assert codes == [exits.PREEMPTED, exits.NODE_UNFIT]
    (eviction,) = events(slowed, "straggler_eviction")
    assert eviction["node"] == "node-b" and eviction["ranks"] == [1]
    slow_reports = [e for e in events(slowed, "straggler_report") if e["step"] <= eviction["step"]]
    assert all(e["nodes"]["node-b"] < e["threshold"] for e in slow_reports[-REPORTS:])
    assert committed_steps(slowed / "checkpoints") == [eviction["step"]]
    verdict = json.loads((slowed / "verdict.json").read_text())
    assert verdict["code"] == exits.NODE_UNFIT and verdict["node"] == "node-b"
    assert "node-b" in verdict["cause"]
    ends = {e["rank"]: e["status"] for e in events(slowed, "run_end")}
    assert ends == {0: "evicted", 1: "evicted"}
