"""A real fault in one replica group stops that group only, and the run ends bit-identical.

Two real jobs of 2 groups x 2 CPU ranks (gloo) through ``python -m training.launch.local
--restart replica``: the real torchft Lighthouse, one real NVRx ``ft_launcher`` per group,
torchft's Manager across groups. One run is fault-free; in the other the test SIGKILLs rank 1
of group 1 from outside (a real signal) once that group has committed a few steps. Then:

- group 0's ranks keep their processes (one PID each for the whole run, one attempt);
- group 1's launcher restarts its workers (new PIDs), which heal from group 0 over torchft's
  checkpoint transport (a ``replica_heal`` event with the bytes received);
- group 0 waited for it at a quorum (the survivors' stall is in its ``replica_quorum`` event);
- both groups end with model and optimizer state bit-identical to the fault-free run's
  (waiting semantics: the failed step is discarded by ``should_commit`` and redone by all).

About 3-4 minutes on 2 loaded cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import (
    REPO_ROOT,
    TINY_MODEL,
    assert_identical,
    final_state,
    subprocess_env,
    tail,
)

from training.runlog.accounting import summarize

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 14
KILL_AFTER_STEP = 4
COMMON = (
    *TINY_MODEL,
    f"--train.steps={STEPS}",
    "--train.log_every=1",
    "--checkpoint.interval=8",
    "--restart=replica",
    "--resilience.replica_groups=2",
    "--resilience.heartbeat_timeout_s=20",
    # A survivor that saw the failed all-reduce waits for the group inside its step section.
    "--resilience.step_section_timeout_s=240",
    "--resilience.replica_wait_s=240",
    "--parallel.pg_timeout_s=60",
)


def start(run_dir: Path, corpus: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    command = [
        sys.executable,
        "-m",
        "training.launch.local",
        "--nproc=4",
        "--metrics-port=0",
        "--no-report",
        "--run-dir",
        str(run_dir),
        f"--data.path={corpus}",
        *COMMON,
        *extra,
    ]
    log = run_dir.parent / f"{run_dir.name}.log"
    handle = open(log, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, env=subprocess_env(), stdout=handle, stderr=subprocess.STDOUT
    )
    return proc, log


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def committed_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


def pids_of(run_dir: Path, rank: int) -> list[int]:
    found: list[int] = []
    for e in events(run_dir):
        if e["kind"].startswith("replica_") and e["rank"] == rank and e["pid"] not in found:
            found.append(e["pid"])
    return found


def wait(proc: subprocess.Popen, log: Path, *, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"run timed out after {timeout}s; log tail:\n{tail(log)}")
    assert proc.returncode == 0, tail(log, 120)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict:
    reference_dir = tmp_path_factory.mktemp("reference") / "run"
    proc, log = start(reference_dir, corpus)
    wait(proc, log, timeout=400)
    return final_state(reference_dir / "group-0")


def test_sigkill_in_one_group_restarts_it_alone_and_the_run_stays_bit_identical(
    tmp_path: Path, corpus: Path, reference: dict
) -> None:
    run_dir = tmp_path / "faulty"
    group0, group1 = run_dir / "group-0", run_dir / "group-1"
    proc, log = start(run_dir, corpus)
    deadline = time.monotonic() + 300
    while committed_steps(group1) < KILL_AFTER_STEP or not pids_of(group1, 1):
        assert proc.poll() is None, tail(log, 120)
        assert time.monotonic() < deadline, "group 1 never reached the step of the fault"
        time.sleep(0.1)
    victim = pids_of(group1, 1)[0]
    survivors = [pids_of(group0, 0), pids_of(group0, 1)]
    os.kill(victim, signal.SIGKILL)
    wait(proc, log, timeout=500)

    # Group 0: the same processes throughout (no restart there), one attempt per rank.
    assert [pids_of(group0, 0), pids_of(group0, 1)] == survivors
    assert all(len(p) == 1 for p in survivors), survivors
    attempts0 = [e for e in events(group0) if e["kind"] == "attempt_start"]
    assert sorted(e["rank"] for e in attempts0) == [0, 1], attempts0
    # Group 1: restarted by its own launcher (new processes), healed from group 0.
    assert len(pids_of(group1, 1)) == 2, pids_of(group1, 1)
    assert len(pids_of(group1, 0)) == 2, pids_of(group1, 0)
    heals = [e for e in events(group1) if e["kind"] == "replica_heal"]
    assert sorted(e["rank"] for e in heals) == [0, 1], heals
    assert all(e["bytes"] > 0 and e["step"] >= KILL_AFTER_STEP for e in heals), heals
    # The survivors waited for it at a quorum with both groups again.
    rejoined = [
        e for e in events(group0) if e["kind"] == "replica_quorum" and e["step"] >= KILL_AFTER_STEP
    ]
    assert rejoined and all(e["participants"] == 2 for e in rejoined), rejoined
    # What the report, TensorBoard and the exporter read of it (training/runlog/replica.py):
    # the survivors' stall for this failure, the wait that ended with the group back, the heal.
    survivor = summarize(run_dir=group0).replica
    assert survivor.steps_discarded >= 1 and survivor.stalls, survivor
    assert all(stall.stall_s > 0 for stall in survivor.stalls), survivor.stalls
    assert survivor.waiting_since is None  # every wait ended (the group came back)
    waits = [e for e in events(group0) if e["kind"] == "replica_waiting"]
    assert {e["rank"] for e in waits} >= {0, 1} and all(e["since"] < e["time"] for e in waits)
    healed = summarize(run_dir=group1).replica
    assert sum(h.bytes for h in healed.heals) == sum(e["bytes"] for e in heals)

    # Waiting semantics: both groups end exactly where the fault-free run ends.
    assert_identical(final_state(group0), reference, steps=STEPS)
    assert_identical(final_state(group1), reference, steps=STEPS)


def test_a_lost_lighthouse_is_no_worse_than_a_global_restart(
    tmp_path: Path, corpus: Path, reference: dict
) -> None:
    """With the Lighthouse gone no quorum forms: every group's ranks fail their next quorum,
    their launchers give up (``max_restarts=0``), and the job's cold restart brings up a new
    Lighthouse and every group from its checkpoints, ending bit-identical all the same."""
    run_dir = tmp_path / "lost-lighthouse"
    proc, log = start(
        run_dir,
        corpus,
        "--cold-restarts=1",
        "--resilience.max_restarts=0",
        "--checkpoint.interval=4",
        "--resilience.replica_timeout_s=10",
    )
    deadline = time.monotonic() + 300
    while committed_steps(run_dir / "group-0") < 6:
        assert proc.poll() is None, tail(log, 120)
        assert time.monotonic() < deadline, "group 0 never reached the step of the fault"
        time.sleep(0.1)
    (up,) = [e for e in events(run_dir) if e["kind"] == "replica_lighthouse"]
    os.kill(up["pid"], signal.SIGKILL)
    wait(proc, log, timeout=600)

    launcher = events(run_dir)
    assert [e["state"] for e in launcher if e["kind"] == "replica_lighthouse"] == [
        "up",
        "down",
        "up",
        "down",
    ]
    assert [e["mode"] for e in launcher if e["kind"] == "restart_begin"] == ["cold"]
    for group in ("group-0", "group-1"):
        assert_identical(final_state(run_dir / group), reference, steps=STEPS)
