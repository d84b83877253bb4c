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
  (waiting semantics: a step the kill fails is discarded by ``should_commit`` and redone by
  all; a kill between steps fails none).

About 3-4 minutes on 2 loaded cores.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from replica_runs import (
    STEPS,
    committed_steps,
    events,
    pids_of,
    signal_group,
    start,
    wait,
    wait_for_step,
)
from support import assert_identical, final_state, tail

from training.runlog.accounting import summarize

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

KILL_AFTER_STEP = 4


def test_sigkill_in_one_group_restarts_it_alone_and_the_run_stays_bit_identical(
    tmp_path: Path, corpus: Path, reference: dict
) -> None:
    run_dir = tmp_path / "faulty"
    group0, group1 = run_dir / "group-0", run_dir / "group-1"
    proc, log = start(run_dir, corpus)
    wait_for_step(proc, log, group1, KILL_AFTER_STEP)
    survivors = [pids_of(group0, 0), pids_of(group0, 1)]
    signal_group(group1, signal.SIGKILL, ranks=(1,))
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
    # A kill in the middle of a step fails that step's cross-group all-reduce: the survivors
    # discard it (should_commit) and redo it. A kill between two steps (seen on a loaded
    # machine: group 1 died before joining step 5's quorum) leaves nothing to discard: the
    # survivors wait at the quorum. Either way they stall once, for this failure.
    survivor = summarize(run_dir=group0).replica
    discarded = [e["step"] for e in events(group0) if e["kind"] == "replica_step_discarded"]
    assert all(step > KILL_AFTER_STEP for step in discarded), discarded
    assert len(set(discarded)) == survivor.steps_discarded, survivor
    assert survivor.stalls, survivor
    assert all(stall.stall_s > 0 for stall in survivor.stalls), survivor.stalls
    assert survivor.waiting_since is None  # every wait ended (the group came back)
    waits = [e for e in events(group0) if e["kind"] == "replica_waiting"]
    assert {e["rank"] for e in waits} >= {0, 1} and all(e["since"] < e["time"] for e in waits)
    healed = summarize(run_dir=group1).replica
    assert sum(h.bytes for h in healed.heals) == sum(e["bytes"] for e in heals)

    # Waiting semantics: both groups end exactly where the fault-free run ends.
    assert_identical(final_state(group0), reference, steps=STEPS)
    assert_identical(final_state(group1), reference, steps=STEPS)


LIGHTHOUSE_WAIT_S = 30
"""The lost-Lighthouse run's ``replica_wait_s``: how long the ranks wait at a quorum that never
forms. Its step section (where the wait is) outlasts it, so the ranks fail at their quorum
timeout, not at NVRx's section timeout (checked below)."""


def test_a_lost_lighthouse_is_no_worse_than_a_global_restart(
    tmp_path: Path, corpus: Path, reference: dict
) -> None:
    """With the Lighthouse gone no quorum forms: every group's ranks fail their next quorum
    after ``replica_wait_s``, their launchers give up (``max_restarts=0``), and the job's cold
    restart brings up a new Lighthouse and every group from its checkpoints, ending
    bit-identical all the same."""
    run_dir = tmp_path / "lost-lighthouse"
    proc, log = start(
        run_dir,
        corpus,
        "--cold-restarts=1",
        "--resilience.max_restarts=0",
        "--checkpoint.interval=4",
        "--resilience.replica_timeout_s=10",
        f"--resilience.replica_wait_s={LIGHTHOUSE_WAIT_S}",
        f"--resilience.step_section_timeout_s={2 * LIGHTHOUSE_WAIT_S}",
    )
    deadline = time.monotonic() + 300
    while committed_steps(run_dir / "group-0") < 6:
        assert proc.poll() is None, tail(log, 120)
        assert time.monotonic() < deadline, "group 0 never reached the step of the fault"
        time.sleep(0.1)
    (up,) = [e for e in events(run_dir) if e["kind"] == "replica_lighthouse"]
    os.kill(up["pid"], signal.SIGKILL)
    killed = time.time()
    wait(proc, log, timeout=600)

    launcher = events(run_dir)
    assert [e["state"] for e in launcher if e["kind"] == "replica_lighthouse"] == [
        "up",
        "down",
        "up",
        "down",
    ]
    (cold,) = [e for e in launcher if e["kind"] == "restart_begin"]
    assert cold["mode"] == "cold"
    # The groups gave up at their quorum's timeout, not earlier (a heartbeat or section
    # timeout would have restarted them before the wait was over).
    assert cold["time"] - killed >= LIGHTHOUSE_WAIT_S, cold["time"] - killed
    for group in ("group-0", "group-1"):
        assert_identical(final_state(run_dir / group), reference, steps=STEPS)
