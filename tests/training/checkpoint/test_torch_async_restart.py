"""torch DCP's ``async_save`` background process (engine ``torch_async``) across an in-process
restart (training/checkpoint/torch_async.py): a write of the failed attempt never outlives its
abandon, and the next attempt's save is written and finalized on its own. Real
``dcp.async_save`` with torch's process executor on a one-rank gloo group; the slow write is a
``FileSystemWriter`` that waits before writing (the spawned checkpoint process imports it from
this module).

Run: ``.venv/bin/pytest tests/training/checkpoint/test_torch_async_restart.py`` (CPU).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from training.checkpoint.torch_async import drop_background_process

SLOW_WRITE_S = 6.0


class _SlowWriter(FileSystemWriter):
    """Marks that the write began, waits, then writes (a write slowed by a busy file system or
    stuck on a peer)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        (Path(self.path) / "began").write_text("")
        time.sleep(SLOW_WRITE_S)
        return super().write_data(plan, planner)


def _async_save(state: dict, writer: FileSystemWriter) -> Any:
    return dcp.async_save(
        state,
        storage_writer=writer,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_write_of_the_failed_attempt_never_outlives_its_abandon(
    one_rank_group, tmp_path: Path
) -> None:
    stale = tmp_path / "step_1"
    stale.mkdir()
    _async_save({"w": torch.arange(8.0)}, _SlowWriter(str(stale)))
    deadline = time.monotonic() + 120
    while not (stale / "began").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (stale / "began").exists(), "the first write never began: nothing was tested"
    drop_background_process(timeout_s=0.5)  # the manager's abandon, on every rank
    time.sleep(SLOW_WRITE_S + 2.0)  # when the stale write would have written
    assert sorted(p.name for p in stale.iterdir()) == ["began"], (
        "a write of the failed attempt went on after its abandon"
    )
    fresh = tmp_path / "step_2"
    fresh.mkdir()
    future = _async_save({"w": torch.arange(8.0) + 2}, FileSystemWriter(str(fresh)))
    future.result(timeout=180)
    state = {"w": torch.zeros(8)}
    dcp.load(state, checkpoint_id=str(fresh))
    assert torch.equal(state["w"], torch.arange(8.0) + 2)
    assert drop_background_process(timeout_s=60) == "clean"  # idle: torch's own stop
