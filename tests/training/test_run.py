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

from training.checkpoint import nvrx_async
from training.hooks import StepHooks
from training.overrides import build_config
from training.run import run_training


class RecordingHooks(StepHooks):
    """Records the order of sections and steps, and whether the checkpoint worker was running
    on entering and leaving each section."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bool]] = []

    @staticmethod
    def _worker_alive() -> bool:
        caller = nvrx_async._SHARED_CALLER
        process = getattr(caller, "process", None)
        return process is not None and process.is_alive()

    def before_step(self, step: int) -> None:
        self.seen.append(("step", str(step), self._worker_alive()))

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.seen.append(("enter", name, self._worker_alive()))
        yield
        self.seen.append(("exit", name, self._worker_alive()))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_checkpoint_worker_start_up_is_inside_a_section(
    tmp_path: Path, corpus: Path, one_rank_group: None
) -> None:
    """Starting the NVRx worker takes seconds (a fresh process importing torch); outside a
    section no ping covers it, and a short soft timeout read it as a hang after every restart
    that had to replace the worker (CI: in-process restart looped to its cap). The worker must
    come up inside a section the watchdogs honour, before the first step."""
    nvrx_async.stop_shared_worker()  # a worker left by another test would hide the start-up
    config, _ = build_config(
        [
            *TINY_MODEL,
            "--run-dir",
            str(tmp_path / "run"),
            f"--data.path={corpus}",
            "--train.steps=2",
            "--checkpoint.engine=nvrx",
        ]
    )
    hooks = RecordingHooks()
    run_training(config, hooks=hooks, rank=0, world_size=1)
    came_up = next(i for i, (kind, _, alive) in enumerate(hooks.seen) if alive)
    kind, name, _ = hooks.seen[came_up]
    assert (kind, name) == ("exit", "checkpoint_start"), hooks.seen
    assert hooks.seen[came_up - 1] == ("enter", "checkpoint_start", False), hooks.seen
    first_step = next(i for i, (kind, _, _) in enumerate(hooks.seen) if kind == "step")
    assert came_up < first_step, hooks.seen
