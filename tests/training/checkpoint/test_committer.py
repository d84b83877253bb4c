"""Rank 0's commits off the training loop (training/checkpoint/committer.py): the committer's
order and errors, and the manager's real NVRx save on one gloo rank in this process, whose
commit is held inside the commit point while the loop goes on."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from nvidia_resiliency_ext.inprocess.monitor_thread import RankShouldRestart

from training.checkpoint.committer import Committer
from training.checkpoint.layout import COMMIT, committed_steps, step_dir
from training.checkpoint.manager import CheckpointManager
from training.config import CheckpointConfig
from training.runlog import writer
from training.runlog.files import EVENTS_FILE, read_jsonl
from training.runlog.metrics import EventLog


def test_jobs_run_in_order_and_a_failure_reaches_the_main_thread() -> None:
    committer = Committer()
    ran: list[int] = []
    committer.submit(lambda: ran.append(1))
    committer.submit(lambda: 1 / 0)
    committer.submit(lambda: ran.append(3))  # later commits still run
    with pytest.raises(ZeroDivisionError):
        committer.drain()
    assert ran == [1, 3]
    committer.drain()  # raised once
    committer.submit(lambda: 1 / 0)
    committer.close()  # after a fault: finishes, raises nothing
    assert committer._thread is None


class _Trainer:
    def __init__(self) -> None:
        self.step = 0
        self.state = {"w": torch.arange(4096, dtype=torch.float32)}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.update(state)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_async_save_commits_on_rank_0s_committer_not_in_the_loop(
    tmp_path: Path, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's poll finalizes the save (every rank's files durable) and returns while the
    commit record is still being written; ``wait`` (the final save, ``close``) returns only
    once it is. Retention runs after the commit on the same thread: the newest stays. The
    commit's event is on disk when the commit returns, not at the event writer's next flush
    (here an hour away): a SIGKILL in between would hide a committed checkpoint."""
    monkeypatch.setattr(writer, "_appender", writer.BufferedAppender(interval_s=3600))
    main = threading.get_ident()
    at_commit = threading.Event()
    release = threading.Event()
    commit_threads: list[int] = []

    def point_hook(point: str, step: int) -> None:
        if point == "commit":
            commit_threads.append(threading.get_ident())
            at_commit.set()
            assert release.wait(20)

    root = tmp_path / "checkpoints"
    manager = CheckpointManager(
        config=CheckpointConfig(engine="nvrx", keep_last=1),
        root=root,
        rank=0,
        world_size=1,
        events=EventLog(run_dir=tmp_path, rank=0),
        point_hook=point_hook,
    )
    trainer = _Trainer()
    try:
        manager.start()
        manager.prepare(trainer)
        release.set()  # the first save commits freely
        manager.save(trainer, step=10, blocking=False)
        manager.wait()
        assert committed_steps(root) == [10]

        release.clear()
        at_commit.clear()
        manager.save(trainer, step=20, blocking=False)
        while manager._pending:  # the loop's polls, one per step
            manager.poll()
        assert at_commit.wait(30), "the commit never started"
        # The loop goes on: the save is finalized, its record not yet written.
        assert not (step_dir(root, 20) / COMMIT).exists()
        manager.poll()
        release.set()
        manager.wait()
        assert committed_steps(root) == [20]  # committed, then step 10 retired
    finally:
        release.set()
        manager.close()
    assert commit_threads and all(t != main for t in commit_threads)
    committed = [
        e["step"]
        for e in read_jsonl(tmp_path / EVENTS_FILE)[0]
        if e["kind"] == "checkpoint_committed"
    ]
    assert committed == [10, 20]


class _FaultAfterPut(queue.Queue):
    """The committer's job queue where the fault lands in ``close`` right after its stop entry
    is queued, before the join (NVRx's ``RankShouldRestart``, raised asynchronously)."""

    def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        if item is None:
            raise RankShouldRestart


def test_the_next_attempts_committer_waits_for_a_commit_an_interrupted_close_left(
    tmp_path: Path,
) -> None:
    """The next attempt's manager makes its committer before it sweeps uncommitted step
    directories (``CheckpointManager.start``): by then no commit of the earlier attempt may
    still be running, or its record lands in a directory the sweep deletes."""
    release = threading.Event()
    record = tmp_path / "commit"

    def slow_commit() -> None:
        release.wait(timeout=30)
        record.write_text("committed")

    first = Committer()
    first._jobs = _FaultAfterPut()
    first.submit(slow_commit)
    with pytest.raises(RankShouldRestart):
        first.close()
    threading.Timer(1.0, release.set).start()
    Committer()  # the next attempt's
    assert record.exists(), "the next attempt started while a commit was still running"
