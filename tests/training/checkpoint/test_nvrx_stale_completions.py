"""A save of one attempt is never finalized on another's completion or write results
(training/checkpoint/nvrx_async.py; issue #43, defects 1 and 2).

NVRx 0.4.1 keeps two things per process that outlive an in-process restart: the persistent
worker with its queues (``core.py`` ``PersistentAsyncCaller``: ``queue``, ``preload_q``,
``comp_q``) and the write-results queue (``filesystem_async._results_queue``). Neither says
which save an entry belongs to as NVRx reads it: ``is_current_async_call_done`` takes any
completion for the head request's, ``retrieve_write_results`` takes the oldest results for the
save being finalized. These tests leave a real stale entry behind the way a fault does, on real
NVRx workers of a one-rank gloo group, and check that the next attempt's saves are finalized
only once written, with their own results, and load back equal.

Run: ``.venv/bin/pytest tests/training/checkpoint/test_nvrx_stale_completions.py`` (CPU, ~1 min).
The GPU-shaped case (a fault while the trainer waits in ``preload_q.join()`` for the worker's
device-to-host copies) runs NVRx's preload path with a CPU preload function: the queue
protocol is the same, only the copy is not a CUDA copy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from functools import partial
from pathlib import Path
from queue import Empty

import pytest
import torch
import torch.distributed.checkpoint as dcp
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
from nvidia_resiliency_ext.inprocess.monitor_thread import RankShouldRestart, async_raise

from training.checkpoint import nvrx_async as nvrx
from training.checkpoint.layout import CheckpointError


@pytest.fixture
def one_rank_group(one_rank_group):
    """tests/conftest.py's group; the shared NVRx worker stopped before and after the test."""
    nvrx.stop_shared_worker()
    try:
        yield
    finally:
        nvrx.stop_shared_worker()


def _started_queue() -> nvrx.AsyncCheckpointQueue:
    queue = nvrx.AsyncCheckpointQueue()
    queue.start_worker()
    queue.await_worker()
    return queue


def _slow_marker(directory: str, files: object) -> None:
    """``after_write``: a write that takes 3 s, then leaves a marker."""
    time.sleep(3.0)
    (Path(directory) / "marker").write_text("ok")


def _marker_seen(directory: str, seen: list[bool]) -> None:
    """``finalize``: was this save's write done when it was finalized?"""
    seen.append((Path(directory) / "marker").exists())


def _nothing(*args: object) -> None:
    pass


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(8.0) + 100 * step}


def _loaded(directory: Path) -> torch.Tensor:
    state = {"w": torch.zeros(8)}
    dcp.load(state, checkpoint_id=str(directory))
    return state["w"]


def _save_and_check(queue: nvrx.AsyncCheckpointQueue, directory: Path, step: int) -> None:
    """One save of the next attempt: finalized only after its write, and it loads back."""
    directory.mkdir(parents=True)
    seen: list[bool] = []
    queue.schedule_save(
        state_dict=_state(step),
        checkpoint_dir=str(directory),
        after_write=partial(_slow_marker, str(directory)),
        finalize=partial(_marker_seen, str(directory), seen),
    )
    queue.poll(blocking=True)
    assert seen == [True], f"step {step} was finalized before its write ended"
    assert torch.equal(_loaded(directory), _state(step)["w"])


# --- defect 1: a request the worker holds but NVRx does not track ------------------------------


class _FaultOnAppend(deque):
    """``async_calls`` of a queue where the fault lands right before NVRx tracks the request."""

    def append(self, item: object) -> None:
        raise RankShouldRestart


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_request_handed_over_but_not_tracked_is_not_taken_for_the_next_attempts(
    one_rank_group, tmp_path: Path
) -> None:
    """The fault lands between NVRx's ``queue.put`` and ``async_calls.append``
    (``AsyncCallsQueue.schedule_async_request``): the worker has the request, the queue does
    not know it. The window is a few bytecodes wide; here the append itself raises what NVRx's
    monitor thread raises, so NVRx's own code runs up to that point."""
    first = _started_queue()
    first._queue.async_calls = _FaultOnAppend()
    with pytest.raises(RankShouldRestart):
        first.schedule_request(AsyncRequest(partial(time.sleep, 2.0), (), []))
    first.abandon()
    _save_and_check(_started_queue(), tmp_path / "step_2", 2)


def _slow_preload(seconds: float) -> list:
    """A preload that takes ``seconds`` (the worker's device-to-host copies on a GPU)."""
    time.sleep(seconds)
    return []


def _slow_write(seconds: float, *args: object) -> None:
    """A write that takes ``seconds`` (NVRx calls it with the request's arguments)."""
    time.sleep(seconds)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_fault_while_the_trainer_waits_for_the_preload_is_not_taken_for_the_next_attempts(
    one_rank_group, tmp_path: Path
) -> None:
    """The GPU shape of the same window: the trainer blocks in NVRx's ``preload_q.join()``
    while the worker copies the tensors to host; NVRx's monitor thread raises
    ``RankShouldRestart`` into it (``monitor_thread.async_raise``, used here as is); the
    exception lands when ``join`` returns, after ``queue.put``, before
    ``async_calls.append``."""
    first = _started_queue()
    request = AsyncRequest(
        partial(_slow_write, 2.0), (0, [], None), [], preload_fn=partial(_slow_preload, 1.5)
    )
    fault = threading.Timer(0.5, async_raise, (threading.main_thread().ident, RankShouldRestart))
    before = first._queue.call_idx
    fault.start()
    try:
        with pytest.raises(RankShouldRestart):
            first.schedule_request(request)
            time.sleep(5.0)  # the fault lands in here only if it missed the join: see below
    finally:
        fault.join()
    assert first._queue.call_idx == before + 1 and not first._queue.async_calls, (
        "the fault did not land between the hand-over and the tracking: nothing was tested"
    )
    first.abandon()
    _save_and_check(_started_queue(), tmp_path / "step_2", 2)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_completion_is_matched_to_its_request_by_index(one_rank_group, tmp_path: Path) -> None:
    """Completions older than the head request are dropped; one newer than the head means a
    request was lost on the way: an error rather than a save finalized on another's word."""
    queue = _started_queue()
    caller = queue._queue.persistent_caller
    caller.comp_q.put(queue._queue.call_idx)  # the binding's index again: stale
    seen: list[bool] = []
    queue.schedule_request(
        AsyncRequest(
            partial(_slow_marker, str(tmp_path)), ({},), [partial(_marker_seen, tmp_path, seen)]
        )
    )
    finalized = queue.poll(blocking=True)
    assert seen == [True], "finalized on a stale completion, before its write ended"
    assert finalized == [queue._queue.call_idx], "NVRx's finalize checks the request's index"
    caller.comp_q.put(queue._queue.call_idx + 5)  # from a request this queue never handed over
    queue.schedule_request(AsyncRequest(partial(time.sleep, 1.0), (), []))
    with pytest.raises(CheckpointError, match="completion of request"):
        queue.poll(blocking=True)
    queue.abandon()


# --- defect 2: write results left in NVRx's process-wide queue --------------------------------


def _results_left() -> int:
    return filesystem_async._results_queue.qsize()


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_save_written_but_not_finalized_leaves_no_results_for_later_saves(
    one_rank_group, tmp_path: Path
) -> None:
    """The first attempt's save is written (its manifest is there) but the fault comes before
    its finalize: its write results stay in NVRx's process-wide queue. Every later save must
    still be finalized with its own results: the byte item's size differs between the saves,
    so results taken from another save describe the wrong offsets and the load fails."""
    first = _started_queue()
    written = tmp_path / "step_1"
    written.mkdir()
    first.schedule_save(
        state_dict={"note": "x" * 10, "w": torch.arange(8.0)},
        checkpoint_dir=str(written),
        after_write=_nothing,
        finalize=_nothing,
    )
    deadline = time.monotonic() + 60
    while _results_left() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _results_left() == 1, "the first save was not written: nothing was tested"
    first.abandon()
    second = _started_queue()
    for step in (2, 3, 4):
        directory = tmp_path / f"step_{step}"
        directory.mkdir()
        note = "y" * (5000 * step)
        second.schedule_save(
            state_dict={"note": note, "w": _state(step)["w"]},
            checkpoint_dir=str(directory),
            after_write=_nothing,
            finalize=_nothing,
        )
        second.poll(blocking=True)
        state = {"note": "", "w": torch.zeros(8)}
        dcp.load(state, checkpoint_id=str(directory))
        assert state["note"] == note and torch.equal(state["w"], _state(step)["w"])
    assert _results_left() == 0
    second.close()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_results_nobody_claims_are_never_taken_for_a_save(one_rank_group, tmp_path: Path) -> None:
    """Whatever else sits in the process-wide queue (results of a writer no queue tracks any
    more) is not this save's: it is finalized with the results its own write sent."""
    queue = _started_queue()
    with contextlib.suppress(Empty):  # this test's stranger alone, whatever ran before it
        while True:
            filesystem_async._results_queue.get_nowait()
    filesystem_async._results_queue.put({0: []})  # a stranger's results, queued first
    directory = tmp_path / "step_5"
    directory.mkdir()
    queue.schedule_save(
        state_dict=_state(5),
        checkpoint_dir=str(directory),
        after_write=_nothing,
        finalize=_nothing,
    )
    queue.poll(blocking=True)
    assert torch.equal(_loaded(directory), _state(5)["w"])
    queue.close()
