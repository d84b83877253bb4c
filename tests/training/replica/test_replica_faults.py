"""More real faults in replica groups: a hang inside a group, a frozen and cut-off node in one
group, and two groups failing at once. The run ends bit-identical each time (waiting semantics).

Two real jobs of 2 groups x 2 CPU ranks (gloo), as in ``test_replica_fault.py``, compared with
its fault-free reference (``conftest.py``: computed once per session):

1. **A hang in group 0, then a frozen node in group 1** (one run). At step 3 rank 0 of group 0
   hangs before its step's collective (the trainer's own ``hang`` fault: it sleeps forever, no
   heartbeat); group 0's rank monitors find it (heartbeat timeout) and its ``ft_launcher``
   restarts that group alone; group 1's cross-group all-reduce times out
   (``replica_timeout_s``), its step is discarded and it waits at the quorum. Later, once
   group 1 has committed step 9, the test SIGSTOPs both of group 1's ranks from outside: the
   whole group's node frozen, alive but silent, which is what the pod emulation's lost node
   does to its processes (tests/pods: the namespace's processes stopped and its veth cut). Here
   only the processes are stopped: both groups run on one machine, so cutting group 1's network
   would cut group 0's too. Group 0 sees it only through its collectives' timeouts (no process
   exited), group 1's rank monitors through the missing heartbeats; group 1 is restarted and
   heals from group 0, whose processes survive (or restores its own pod-memory snapshot, when
   that holds the step group 0 is at). The fault spec goes to every group (the job's
   arguments have one owner), so the test scopes the hang to group 0 by marking it fired in
   group 1's run directory beforehand: the once-per-run marker ``training/faults.py``
   documents (``<run_dir>/.faults/<index>.fired``).
2. **Two groups at once.** The test SIGKILLs rank 1 of both groups in the same instant: no
   group survives to heal from, so both restart from their own restore tiers (pod memory or
   the committed checkpoint of step 8), the quorum finds them again, and the run goes on.

The short timers: a 20 s heartbeat timeout, a 10 s cross-group timeout, a 240 s step section
(a survivor waits for the failed group inside it). About 6-8 minutes on 2 loaded cores.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from replica_runs import STEPS, events, pids_of, signal_group, start, wait, wait_for_step
from support import assert_identical, final_state

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1200)]

HANG_AT_STEP = 3
FREEZE_AFTER_STEP = 9
KILL_BOTH_AFTER_STEP = 10
SHORT_TIMERS = ("--resilience.replica_timeout_s=10",)


def ranks_pids(group_dir: Path) -> list[list[int]]:
    return [pids_of(group_dir, 0), pids_of(group_dir, 1)]


def kinds(group_dir: Path, kind: str) -> list[dict]:
    return [e for e in events(group_dir) if e["kind"] == kind]


def test_a_hang_in_one_group_and_a_frozen_node_in_the_other_restart_each_group_alone(
    tmp_path: Path, corpus: Path, reference: dict
) -> None:
    run_dir = tmp_path / "hang-then-freeze"
    group0, group1 = run_dir / "group-0", run_dir / "group-1"
    # Fault 0 of the spec, already fired as far as group 1 is concerned: it hangs group 0 only.
    (group1 / ".faults").mkdir(parents=True)
    (group1 / ".faults" / "00000.fired").touch()
    proc, log = start(run_dir, corpus, f"--faults=hang@0:{HANG_AT_STEP}", *SHORT_TIMERS)

    wait_for_step(proc, log, group1, FREEZE_AFTER_STEP)
    before_freeze = ranks_pids(group1)
    group0_after_hang = [pids[-1] for pids in ranks_pids(group0)]
    frozen = signal_group(group1, signal.SIGSTOP, ranks=(0, 1))
    wait(proc, log, timeout=800)

    # The hang: group 0's hung rank fired it, and group 0 alone was restarted (new processes
    # for both ranks: the in-job restart of a group is whole), healing from group 1.
    (fault,) = kinds(group0, "fault")
    assert (fault["rank"], fault["fault"], fault["step"]) == (0, "hang", HANG_AT_STEP)
    assert kinds(group1, "fault") == []
    assert all(len(pids) == 2 for pids in ranks_pids(group0)), ranks_pids(group0)
    heals0 = kinds(group0, "replica_heal")
    assert heals0 and all(e["step"] >= HANG_AT_STEP - 1 and e["bytes"] > 0 for e in heals0)
    # Group 1 survived the hang: one process per rank up to the freeze.
    assert all(len(pids) == 1 for pids in before_freeze), before_freeze
    assert [pids[0] for pids in ranks_pids(group1)] == frozen
    # The freeze: group 1 got new processes that caught up with group 0 from a step after the
    # freeze: healed from group 0, or restored from their own pod-memory snapshot when it held
    # the step group 0 was at (seen on a loaded machine: a snapshot of step 10 taken just
    # before the SIGSTOP, group 0 back at step 10 after discarding step 11; nothing to heal) ...
    assert all(len(pids) == 2 for pids in ranks_pids(group1)), ranks_pids(group1)
    restart1 = max(e["time"] for e in kinds(group1, "attempt_start"))
    heals1 = kinds(group1, "replica_heal")
    loads1 = [e for e in kinds(group1, "checkpoint_load") if e["time"] >= restart1]
    assert all(e["step"] >= FREEZE_AFTER_STEP for e in heals1), heals1
    caught_up = [e["step"] for e in heals1 + loads1]  # a restore may precede a heal
    assert caught_up and max(caught_up) >= FREEZE_AFTER_STEP, (heals1, loads1)
    # ... while group 0's processes (those after its own restart) survived it, and its step
    # in flight was discarded and redone once group 1 was back (both groups in its quorums).
    assert [pids[-1] for pids in ranks_pids(group0)] == group0_after_hang
    discarded = [e for e in kinds(group0, "replica_step_discarded") if e["step"] > HANG_AT_STEP]
    stalls = [e for e in kinds(group0, "replica_stall") if e["step"] > FREEZE_AFTER_STEP]
    assert discarded or stalls, "group 0 never noticed group 1's freeze"
    # The quorum before the redone step carries the last committed step (FREEZE_AFTER_STEP).
    late = [e for e in kinds(group0, "replica_quorum") if e["step"] >= FREEZE_AFTER_STEP]
    assert late and all(e["participants"] == 2 for e in late), late

    assert_identical(final_state(group0), reference, steps=STEPS)
    assert_identical(final_state(group1), reference, steps=STEPS)


def test_two_groups_failing_at_once_fall_back_to_the_restore_tiers(
    tmp_path: Path, corpus: Path, reference: dict
) -> None:
    run_dir = tmp_path / "both-groups"
    groups = [run_dir / "group-0", run_dir / "group-1"]
    proc, log = start(run_dir, corpus, *SHORT_TIMERS)
    for group_dir in groups:
        wait_for_step(proc, log, group_dir, KILL_BOTH_AFTER_STEP)
    first = [ranks_pids(g) for g in groups]
    for group_dir in groups:
        signal_group(group_dir, signal.SIGKILL, ranks=(1,))
    wait(proc, log, timeout=800)

    for group_dir, before in zip(groups, first, strict=True):
        # Each group restarted as a whole (new processes for both ranks), once.
        assert all(len(pids) == 1 for pids in before), before
        assert all(len(pids) == 2 for pids in ranks_pids(group_dir)), ranks_pids(group_dir)
        # No live peer to heal from: each restarted group's ranks read their own restore tiers
        # (a snapshot in pod memory, or the step-8 checkpoint) ...
        attempt = [e for e in kinds(group_dir, "attempt_start") if e.get("attempt", 0) > 0]
        restored_at = min(e["time"] for e in attempt)
        loads = [e for e in kinds(group_dir, "checkpoint_load") if e["time"] >= restored_at]
        assert sorted(e["rank"] for e in loads) == [0, 1], loads
        assert all(8 <= e["step"] <= KILL_BOTH_AFTER_STEP + 1 for e in loads), loads
        # ... and never waited for a group that was still training.
        late = [e for e in kinds(group_dir, "replica_quorum") if e["time"] >= restored_at]
        assert late and all(e["participants"] == 2 for e in late), late
        assert_identical(final_state(group_dir), reference, steps=STEPS)
