"""``training.run.run_training``: what the restart layers' watchdogs see of an attempt.

One real rank (gloo, in this process), the real NVRx checkpoint worker (a spawned process), the
tiny model for two steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import TINY_MODEL

from training import run
from training.checkpoint import nvrx_async
from training.hooks import StepHooks
from training.overrides import build_config
from training.run import run_training


class RecordingHooks(StepHooks):
    """Records the order of sections and steps, and the checkpoint worker's state on entering
    and leaving each section: "none" (no process), "spawned" (process up, its binding request
    not yet finalized) or "ready". While the worker is only spawned, each step takes
    ``step_s`` more: the tiny model's steps take milliseconds, a real one's far longer."""

    def __init__(self, *, step_s: float) -> None:
        self.seen: list[tuple[str, str, str]] = []
        self.step_s = step_s

    @staticmethod
    def _worker() -> str:
        caller = nvrx_async._SHARED_CALLER
        process = getattr(caller, "process", None)
        if process is None or not process.is_alive():
            return "none"
        queues = [q for m in run._LEFTOVERS if (q := getattr(m.engine, "queue", None))]
        return "spawned" if any(q.binding for q in queues) else "ready"

    def before_step(self, step: int) -> None:
        worker = self._worker()
        self.seen.append(("step", str(step), worker))
        if worker == "spawned":
            time.sleep(self.step_s)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.seen.append(("enter", name, self._worker()))
        yield
        self.seen.append(("exit", name, self._worker()))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_checkpoint_worker_start_up_overlaps_the_first_steps_and_no_step_waits_for_it(
    tmp_path: Path, corpus: Path, one_rank_group: None
) -> None:
    """Starting the NVRx worker takes seconds (a fresh process importing torch). It is spawned
    after the first step, off the restart's critical path (beside the load and step 1 it slowed
    both on 2 CPU ranks), inside a section the watchdogs honour (outside one, a short soft
    timeout read the start as a hang: CI, in-process restart looped to its cap), and no step
    waits for it: each step's poll finds it ready. Waiting for it after step 1 instead had cost
    ~1.9 s of every restart that replaced the worker in bench.goodput (the gap before step 2)."""
    nvrx_async.stop_shared_worker()  # a worker left by another test would hide the start-up
    config, _ = build_config(
        [
            *TINY_MODEL,
            "--run-dir",
            str(tmp_path / "run"),
            f"--data.path={corpus}",
            "--train.steps=400",
            "--checkpoint.interval=0",  # the final save only: no save waits for the worker
            "--checkpoint.engine=nvrx",
        ]
    )
    hooks = RecordingHooks(step_s=0.02)
    run_training(config, hooks=lambda _env, _events: hooks, rank=0, world_size=1)
    seen = hooks.seen
    spawned = next(i for i, (_, _, worker) in enumerate(seen) if worker != "none")
    assert seen[spawned - 1 : spawned + 1] == [
        ("enter", "checkpoint_start", "none"),
        ("exit", "checkpoint_start", "spawned"),
    ], seen[:10]
    assert ("step", "1", "none") in seen[:spawned], "spawned before the first step: " + str(
        seen[:10]
    )
    assert ("step", "2", "spawned") in seen, "step 2 waited for the worker: " + str(seen[:12])
    ready = next(i for i, (_, _, worker) in enumerate(seen) if worker == "ready")
    kind, step, _ = seen[ready]
    assert kind == "step" and int(step) > 2, (
        f"found ready by a wait, not a step's poll: {seen[ready - 2 : ready + 1]}"
    )
    assert seen[ready - 1][2] == "spawned", seen[ready - 2 : ready + 1]
    assert all(worker == "ready" for _, _, worker in seen[ready:]), "ready, then not"
