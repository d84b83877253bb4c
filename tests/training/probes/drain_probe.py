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
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from podsim.model import TINY_MODEL
from training.checkpoint import registry
from training.checkpoint.tiers import SnapshotTier, TierContext
from training.hooks import StepHooks
from training.overrides import build_config
from training.run import run_training
from training.runlog import writer
from training.trainer import STOP_GRACE_FLOOR_S

case, run_dir, corpus = sys.argv[1], sys.argv[2], sys.argv[3]
SIGNAL_STEP = {"save": 4, "agreed": 1}[case]


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

    def hold_s(self) -> float:
        """Twice the grace (``Trainer.fit``: max(floor, 2 x the slowest iteration))."""
        return 2 * max(STOP_GRACE_FLOOR_S, 2 * self.slowest_s) + 0.5


CLOCK = IterationClock()


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

    def take(self, trainer: Any, *, step: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        until = time.monotonic() + CLOCK.hold_s()
        while time.monotonic() < until:  # a wait for this rank's writer, pass by pass
            time.sleep(0.05)
            self.keepalive()


def slow_tier(context: TierContext) -> SlowTier:
    return SlowTier(context.keepalive)


registry.TIER_ROWS.append(slow_tier)
config, _ = build_config(
    [
        *TINY_MODEL,
        "--run-dir",
        run_dir,
        f"--data.path={corpus}",
        "--train.steps=12",
        "--checkpoint.interval=4",
        "--checkpoint.engine=sync",
    ]
)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
result = run_training(config, hooks=lambda _env, _events: CLOCK, rank=0, world_size=1)
writer.flush()
print(json.dumps(dataclasses.asdict(result)), flush=True)
dist.destroy_process_group()  # a live gloo group can abort in its destructor
sys.exit(0)
