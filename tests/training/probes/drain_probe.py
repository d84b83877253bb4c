"""A one-rank run whose SIGTERM lands where the work between two steps outlasts the stop's grace.
Run by tests/training/test_trainer_stop.py: ``drain_probe.py CASE RUN_DIR CORPUS``; prints the
``TrainResult`` as one JSON line and exits 0, unless the stop's watcher ended the process (143).

A snapshot tier of the probe's own, registered as a row of ``training.checkpoint.registry`` (as
a real tier is), makes the slow part; the loop, the checkpoint manager, the stop request and the
signal are the real ones. CASE:

- ``save``: SIGTERM during the snapshot take of step 4 (the checkpoint schedule, after the
  shared save of the same step), which then waits twice the grace for its writer, reporting
  each pass through the manager's ``keepalive``: as the first save of an attempt waits for the
  NVRx worker's start. The run must stop at step 5 with a final checkpoint.
- ``agreed``: SIGTERM during step 1, so its all-reduce agrees on the stop; the first-step
  prepare (the tier's: mapping its slots) then takes twice the grace without a pass. The run
  must stop at step 1 with a final checkpoint.
- ``worker``: the NVRx engine, whose worker (spawned by the first-step prepare) is SIGSTOPped
  while it starts; SIGTERM after step 4's all-reduce, and the worker resumes twice the grace
  later: the first save, at step 4, waits for it for real (the drain of tests/pods, where the
  worker's start took 11-24 s under load and the steps 0.4-2 s). The run must stop at step 5.
  Prints ``worker PID`` (a test kills it should the probe die first).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from podsim.model import TINY_MODEL
from training.checkpoint import nvrx_async, registry
from training.checkpoint.tiers import SnapshotTier, TierContext
from training.hooks import StepHooks
from training.overrides import build_config
from training.run import run_training
from training.runlog import writer
from training.trainer import STOP_GRACE_FLOOR_S

case = sys.argv[1] if __name__ == "__main__" else ""  # not in the NVRx worker (spawned)
SIGNAL_STEP = {"save": 4, "agreed": 1, "worker": 4}.get(case, 0)


class IterationClock(StepHooks):
    """The slowest iteration so far (between two ``before_step`` calls: at least the trainer's
    own measure), and so the grace the trainer gives a SIGTERM now, at the most."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.slowest_s = 0.0

    def before_step(self, step: int) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.slowest_s = max(self.slowest_s, now - self.last)
        self.last = now
        if case == "agreed" and step == SIGNAL_STEP:
            os.kill(os.getpid(), signal.SIGTERM)

    def after_step(self, step: int) -> None:  # after the step's all-reduce
        if case == "worker" and step == SIGNAL_STEP:
            threading.Timer(self.hold_s(), os.kill, (WORKER[0], signal.SIGCONT)).start()
            os.kill(os.getpid(), signal.SIGTERM)

    def hold_s(self) -> float:
        """Twice the grace (``Trainer.fit``: max(floor, 2 x the slowest iteration))."""
        return 2 * max(STOP_GRACE_FLOOR_S, 2 * self.slowest_s) + 0.5


CLOCK = IterationClock()
WORKER: list[int] = []


class SlowTier(SnapshotTier):
    name = "slow"

    def __init__(self, keepalive: Callable[[], None]) -> None:
        self.keepalive = keepalive

    def restore_tiers(self) -> list:
        return []

    def due(self, step: int, *, shared: bool) -> bool:
        return case == "save" and step == SIGNAL_STEP

    def prepare(self, trainer: Any) -> None:
        if case == "agreed":
            time.sleep(CLOCK.hold_s())  # one long piece of work, no pass
        if case == "worker":  # the engine has just spawned its worker (manager.prepare)
            WORKER.append(nvrx_async._SHARED_CALLER.process.pid)
            os.kill(WORKER[0], signal.SIGSTOP)
            print(f"worker {WORKER[0]}", flush=True)

    def take(self, trainer: Any, *, step: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        until = time.monotonic() + CLOCK.hold_s()
        while time.monotonic() < until:  # a wait for this rank's writer, pass by pass
            time.sleep(0.05)
            self.keepalive()


def slow_tier(context: TierContext) -> SlowTier:
    return SlowTier(context.keepalive)


def main(run_dir: str, corpus: str) -> None:
    registry.TIER_ROWS.append(slow_tier)
    config, _ = build_config(
        [
            *TINY_MODEL,
            "--run-dir",
            run_dir,
            f"--data.path={corpus}",
            "--train.steps=12",
            "--checkpoint.interval=4",
            f"--checkpoint.engine={'nvrx' if case == 'worker' else 'sync'}",
        ]
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    result = run_training(config, hooks=lambda _env, _events: CLOCK, rank=0, world_size=1)
    writer.flush()
    print(json.dumps(dataclasses.asdict(result)), flush=True)
    dist.destroy_process_group()  # a live gloo group can abort in its destructor
    sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[2], sys.argv[3])
