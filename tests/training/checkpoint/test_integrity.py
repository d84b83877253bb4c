"""The verified load, in one process (no process group: DCP then loads rank-locally)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from training.checkpoint.integrity import ChecksummingWriter, VerifyingReader, gc_paused
from training.checkpoint.layout import commit, step_dir


class _RecordingPlanner(DefaultLoadPlanner):
    """DCP's planner, noting whether garbage collection was on as each tensor landed."""

    def __init__(self) -> None:
        super().__init__()
        self.gc_enabled: list[bool] = []

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        self.gc_enabled.append(gc.isenabled())
        super().commit_tensor(read_item, tensor)


def test_a_verified_load_runs_without_garbage_collection_and_restores_it(tmp_path: Path) -> None:
    """A full collection mid-load cost ~150 ms in bench.checkpoint, more than the checks."""
    saved = {"w": torch.arange(4096.0), "b": torch.ones(16)}
    path = step_dir(tmp_path, 10)
    dcp.save(saved, storage_writer=ChecksummingWriter(path, rank=0))
    commit(path, step=10, world_size=1, engine="sync")

    loaded = {"w": torch.zeros(4096), "b": torch.zeros(16)}
    planner = _RecordingPlanner()
    assert gc.isenabled()
    dcp.load(loaded, storage_reader=VerifyingReader(path), planner=planner)

    assert planner.gc_enabled and not any(planner.gc_enabled)
    assert gc.isenabled(), "the load must turn collection back on"
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


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
