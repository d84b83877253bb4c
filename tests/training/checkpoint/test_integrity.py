"""Checkpoint loads and writes without garbage collection (``integrity.gc_paused``): one real
rank (gloo, in this process) and the manager's own save and load."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpoint.integrity import gc_paused
from training.checkpoint.manager import CheckpointManager
from training.config import CheckpointConfig
from training.runlog.metrics import EventLog


class _Trainer:
    """A stateful trainer for the manager: its tensors, and whether garbage collection was on
    when DCP handed the loaded state back (``load_state_dict``, the end of the load)."""

    def __init__(self, fill: float) -> None:
        self.state = {"w": torch.full((4096,), fill), "b": torch.full((16,), fill)}
        self.gc_enabled_at_load: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gc_enabled_at_load.append(gc.isenabled())
        self.state.update(state)


@pytest.mark.distributed
@pytest.mark.parametrize("verify_on_load", [True, False])
def test_a_checkpoint_load_runs_without_garbage_collection_and_restores_it(
    tmp_path: Path, one_rank_group: None, verify_on_load: bool
) -> None:
    """A full collection mid-load took ~150 ms in bench.checkpoint, as long as the load: the
    manager's load pauses it, whichever reader it uses."""
    manager = CheckpointManager(
        config=CheckpointConfig(engine="sync", verify_on_load=verify_on_load),
        root=tmp_path / "checkpoints",
        rank=0,
        world_size=1,
        events=EventLog(run_dir=tmp_path, rank=0),
    )
    manager.start()
    saved = _Trainer(fill=1.5)
    manager.save(saved, step=10, blocking=True)

    loaded = _Trainer(fill=0.0)
    assert gc.isenabled()
    assert manager.load_latest(loaded) == 10
    manager.close()

    assert loaded.gc_enabled_at_load == [False]
    assert gc.isenabled(), "the load must turn collection back on"
    assert all(torch.equal(loaded.state[k], saved.state[k]) for k in saved.state)


def test_gc_paused_keeps_the_outer_state() -> None:
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "an inner pause must not end the outer one"
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled(), "a pause must not turn on what the caller had off"
    finally:
        gc.enable()
