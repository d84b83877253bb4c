"""Shrinking semantics: the survivors go on without the failed group, and every sample of its
share is accounted for.

Real processes, as ``test_replica_fault.py`` (whose launch helpers this reuses): 2 groups x 2
CPU ranks (gloo), the real torchft Lighthouse (``--min_replicas=1``), one real NVRx
``ft_launcher`` per group, a real SIGKILL of group 1's rank 1 from outside. One fault-free run
and one faulty run with ``--resilience.replica_semantics=shrink``. Then:

- group 0 keeps its processes (one PID per rank) and commits steps while group 1 is out (the
  steps its own ``replica_samples_skipped`` events name);
- group 1 restarts, heals from group 0 at group 0's step and sampler position, and rejoins
  (a quorum of both groups after the heal);
- the sample account is exact: group 1's share of every step was either trained (a step group
  1 committed, or one it contributed its gradient to before dying) or recorded as skipped,
  never both, never twice: the steps group 1 logged after its heal start right after the heal
  step (a group resuming from its own checkpoint would log steps again), and the skipped count
  is the steps it missed x its share (``GROUP_SHARE``);
- the final loss is within tolerance of the fault-free run's (below).

The survivors' stall (group 0's ``replica_stall``) is printed, not asserted (a timing on a
shared machine); docs/replica-groups.md records it.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from replica_runs import (
    COMMON,
    STEPS,
    events,
    pids_of,
    signal_group,
    start,
    wait,
    wait_for_step,
)

from training.overrides import build_config
from training.runlog.accounting import summarize

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

KILL_AFTER_STEP = 4
SHRINK_STEPS = 250
"""Long enough that group 0 is still training when group 1 is back: a group back after its
peers finished has no one to heal from and fails at its quorum, as in the waiting semantics.
Group 1's restart took group 0 12 steps alone here and 108 in CI (a slower machine), of 150
then: 250 leaves CI's case ~140 steps (tens of seconds) to spare."""
SHRINK = (f"--train.steps={SHRINK_STEPS}", "--resilience.replica_semantics=shrink")
_TRAIN = build_config([*COMMON, *SHRINK])[0].train
GROUP_SHARE = 2 * _TRAIN.micro_batch_size * _TRAIN.grad_accum_steps
"""Group 1's samples per step: its 2 ranks' micro-batches."""
LOSS_TOLERANCE = 0.05
"""Relative, on the mean loss of the last 5 steps. The shrunk steps average the gradient of half
the batch: an unbiased estimate of the same gradient with more noise, at the same learning
rate, so the curves part by sampling noise only. Sized from measured runs (docs); a path that
breaks the update (a gradient summed over the full group count, NaNs) parts by far more."""


def metrics_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [int(m["step"]) for m in lines if "loss" in m]


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(m["step"]): float(m["loss"]) for m in lines if "loss" in m}


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("shrink-reference") / "run"
    proc, log = start(run_dir, corpus, *SHRINK)
    wait(proc, log, timeout=500)
    return losses(run_dir / "group-0")


def test_shrink_goes_on_without_the_failed_group_and_accounts_for_its_samples(
    tmp_path: Path, corpus: Path, reference_losses: dict[int, float]
) -> None:
    assert STEPS < SHRINK_STEPS and "--checkpoint.interval=8" in COMMON
    run_dir = tmp_path / "shrink"
    group0, group1 = run_dir / "group-0", run_dir / "group-1"
    proc, log = start(run_dir, corpus, *SHRINK)
    wait_for_step(proc, log, group1, KILL_AFTER_STEP)
    survivors = [pids_of(group0, 0), pids_of(group0, 1)]
    signal_group(group1, signal.SIGKILL, ranks=(1,))
    wait(proc, log, timeout=600)

    # Group 0: the same processes throughout, one attempt per rank.
    assert [pids_of(group0, 0), pids_of(group0, 1)] == survivors
    assert all(len(p) == 1 for p in survivors), survivors
    # Group 1: new processes, healed from group 0 (its step and sampler position).
    assert len(pids_of(group1, 1)) == 2, pids_of(group1, 1)
    heals = [e for e in events(group1) if e["kind"] == "replica_heal"]
    assert sorted(e["rank"] for e in heals) == [0, 1], heals
    healed_to = heals[0]["step"]
    assert all(e["step"] == healed_to for e in heals), heals

    # Group 0 committed steps without group 1 and wrote down group 1's samples of each.
    survivor = summarize(run_dir=group0).replica
    assert survivor is not None
    skipped = [step for g, step in survivor.steps_skipped if g == 1]
    assert {g for g, _ in survivor.steps_skipped} == {1}, survivor.steps_skipped
    assert skipped, "group 0 committed no step without group 1"
    assert set(skipped) <= set(metrics_steps(group0))  # committed by group 0
    # ... then a quorum of both groups again, after group 1's heal.
    rejoined = [
        e
        for e in events(group0)
        if e["kind"] == "replica_quorum" and e["participants"] == 2 and e["step"] >= healed_to
    ]
    assert rejoined, [e for e in events(group0) if e["kind"] == "replica_quorum"]

    # The sample account. Group 1 logged steps 1..k before the fault, then healed_to+1..end.
    logged = metrics_steps(group1)
    assert len(logged) == len(set(logged)), f"group 1 trained a step twice: {logged}"
    before = [s for s in logged if s <= healed_to]
    after = [s for s in logged if s > healed_to]
    assert after == list(range(healed_to + 1, SHRINK_STEPS + 1)), logged
    last = max(before, default=0)
    # Skipped: every step after group 1's last own commit up to the heal. The step after ``last``
    # may instead have been committed by group 0 with group 1's gradient in it (group 1 died
    # after its all-reduce, before its own commit): then it is trained, not skipped.
    assert skipped in (
        list(range(last + 1, healed_to + 1)),
        list(range(last + 2, healed_to + 1)),
    ), (skipped, logged, healed_to)
    assert not set(skipped) & set(logged)
    assert survivor.samples_skipped == len(skipped) * GROUP_SHARE, survivor
    # A sample is (epoch, index): a long outage runs past the end of an epoch (seen in CI: 108
    # steps skipped, 1728 samples, 317 indices again in the next epoch's permutation).
    samples = [
        (e["epoch"], i)
        for e in events(group0)
        if e["kind"] == "replica_samples_skipped"
        for i in e["indices"]
    ]
    assert len(samples) == len(set(samples)) == survivor.samples_skipped

    # The loss: within LOSS_TOLERANCE of the fault-free run's (the mean of the last 5 steps).
    mine = losses(group0)
    tail_steps = range(SHRINK_STEPS - 4, SHRINK_STEPS + 1)
    ours = sum(mine[s] for s in tail_steps) / 5
    theirs = sum(reference_losses[s] for s in tail_steps) / 5
    stall_line = (
        f"survivors' stalls {len(survivor.stalls)} p50 {survivor.stall_p50_s} s"
        f" max {survivor.stall_max_s} s; skipped {skipped}; loss {ours:.4f} vs {theirs:.4f}"
    )
    print(stall_line)
    assert survivor.stalls, stall_line
    assert abs(ours - theirs) <= LOSS_TOLERANCE * theirs, stall_line
