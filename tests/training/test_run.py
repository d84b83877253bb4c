"""``training.run.run_training``: what the restart layers' watchdogs see of an attempt.

One real rank (gloo, in this process), the real NVRx checkpoint worker (a spawned process), the
tiny model for two steps.
"""

from __future__ import annotations

import contextlib
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
    not yet waited on) or "ready"."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    @staticmethod
    def _worker() -> str:
        caller = nvrx_async._SHARED_CALLER
        process = getattr(caller, "process", None)
        if process is None or not process.is_alive():
            return "none"
        queues = [m._nvrx for m in run._LEFTOVERS if m._nvrx is not None]
        return "spawned" if any(q._binding for q in queues) else "ready"

    def before_step(self, step: int) -> None:
        self.seen.append(("step", str(step), self._worker()))

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.seen.append(("enter", name, self._worker()))
        yield
        self.seen.append(("exit", name, self._worker()))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_checkpoint_worker_start_up_overlaps_step_1_and_is_awaited_in_a_section(
    tmp_path: Path, corpus: Path, one_rank_group: None
) -> None:
    """Starting the NVRx worker takes seconds (a fresh process importing torch). It is spawned
    before the load and waited for after the first step, so the import overlaps the load and
    step 1 instead of adding to every start-up and restart. The wait must be inside a section
    the watchdogs honour: outside one, a short soft timeout read it as a hang after every
    restart that had to replace the worker (CI: in-process restart looped to its cap)."""
    nvrx_async.stop_shared_worker()  # a worker left by another test would hide the start-up
    config, _ = build_config(
        [
            *TINY_MODEL,
            "--run-dir",
            str(tmp_path / "run"),
            f"--data.path={corpus}",
            "--train.steps=3",
            "--checkpoint.engine=nvrx",
        ]
    )
    hooks = RecordingHooks()
    run_training(config, hooks=hooks, rank=0, world_size=1)
    seen = hooks.seen
    spawned = next(i for i, (_, _, worker) in enumerate(seen) if worker != "none")
    assert seen[spawned - 1 : spawned + 1] == [
        ("enter", "checkpoint_start", "none"),
        ("exit", "checkpoint_start", "spawned"),
    ], seen
    first_step = seen.index(("step", "1", "spawned"))  # step 1 did not wait for the worker
    ready = next(i for i, (_, _, worker) in enumerate(seen) if worker == "ready")
    assert spawned < first_step < ready, seen
    assert seen[ready - 1 : ready + 1] == [
        ("enter", "checkpoint_start", "spawned"),
        ("exit", "checkpoint_start", "ready"),
    ], seen
    assert ready < seen.index(("step", "2", "ready")), seen
