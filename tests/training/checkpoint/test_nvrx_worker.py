"""NVRx's persistent checkpoint worker: device binding, staging on the right device, release of
the request's tensors, a graceful stop, and liveness reports while a save waits for the worker
(training/checkpoint/nvrx_async.py).

Run: ``.venv/bin/pytest tests/training/checkpoint/test_nvrx_worker.py`` (CPU; the CUDA calls are
recorded through fakes, the stop sequence runs on real spawned workers of a 1-rank gloo group).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import pickle
import signal
import threading
import time
import weakref
from functools import partial
from pathlib import Path

import pytest
import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
from support import REPO_ROOT, VENV_BIN, run_in_repo

from training.checkpoint import nvrx_async as nvrx


def test_worker_device_is_the_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvrx, "cuda_usable", lambda: True)
    assert nvrx.worker_device({"LOCAL_RANK": "5"}) == 5
    assert nvrx.worker_device({}) == 0
    monkeypatch.setattr(nvrx, "cuda_usable", lambda: False)
    assert nvrx.worker_device({"LOCAL_RANK": "5"}) is None


def test_bind_worker_sets_the_device_before_anything_else_touches_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(nvrx, "die_with_parent", lambda pid: calls.append(("parent", pid)))
    monkeypatch.setattr(nvrx.signal, "signal", lambda sig, fn: calls.append(("signal", sig)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    nvrx._bind_worker(123, 3)
    assert calls == [
        ("parent", 123),
        ("signal", nvrx.WORKER_STOP_SIGNAL),
        ("set_device", 3),
    ]
    calls.clear()
    nvrx._bind_worker(123, None)  # CPU: no CUDA call at all
    assert ("set_device", 3) not in calls and len(calls) == 2


class _FakeCudaTensor:
    """Stands in for a CUDA tensor received through IPC: records the D2H copy."""

    def __init__(self, index: int, log: list) -> None:
        self.device = torch.device("cuda", index)
        self._log = log

    def detach(self) -> _FakeCudaTensor:
        return self

    def to(self, device: str, *, non_blocking: bool) -> torch.Tensor:
        self._log.append(("copy", self.device.index, device, non_blocking))
        return torch.zeros(2)


def test_stage_synchronizes_each_source_device_after_the_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NVRx 0.4.1's preload synchronizes the current device only (GPU 0 in an unbound worker):
    ours waits on every device it copied from, after issuing all copies."""
    log: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: log.append(("sync", d)))
    cpu = torch.arange(4.0)
    buckets = [
        ("f0", "k0", ([], [("a", _FakeCudaTensor(3, log)), ("b", _FakeCudaTensor(3, log))])),
        ("f1", "k1", ([], [("c", cpu)])),
    ]
    staged = nvrx.stage(buckets)
    assert log == [
        ("copy", 3, "cpu", True),
        ("copy", 3, "cpu", True),
        ("sync", torch.device("cuda", 3)),
    ]
    staged_cpu = staged[1][2][1][0][1]
    assert torch.equal(staged_cpu, cpu) and staged_cpu.data_ptr() != cpu.data_ptr()
    assert buckets == [], "the worker must drop the IPC tensors once staged"


def test_worker_keeps_no_tensor_of_a_finished_request() -> None:
    """Replays NVRx's ``async_loop`` on an unpickled request: after preload and write, while the
    loop still holds ``item`` and ``async_fn_args`` (until its next request), no tensor of the
    request is alive in the worker (after an in-process restart the reused worker would
    otherwise pin the previous iteration's memory)."""
    source = [("f", "k", ([], [("w", torch.ones(8)), ("b", torch.zeros(3))]))]
    request = AsyncRequest(
        async_fn=partial(nvrx._write_then, _CountTensors([]), _noop),
        async_fn_args=(0, source, None),
        finalize_fns=[],
        preload_fn=partial(nvrx.stage, source),
    )
    item = pickle.loads(pickle.dumps(request))  # as the worker receives it
    received = item.async_fn_args[1]
    assert received is item.preload_fn.args[0], "one list object after unpickling"
    refs = [weakref.ref(t) for _, _, (_, data) in received for _, t in data]
    async_fn_args = list(item.async_fn_args)
    async_fn_args[1] = item.preload_fn()
    staged_refs = [weakref.ref(t) for _, _, (_, data) in async_fn_args[1] for _, t in data]
    item.async_fn(*async_fn_args)
    gc.collect()
    assert item.async_fn.args[0].out == [2], "the write saw both staged tensors"
    assert all(r() is None for r in refs + staged_refs)


class _CountTensors:
    def __init__(self, out: list[int]) -> None:
        self.out = out

    def __call__(self, rank: int, buckets: list, results_queue: object) -> None:
        self.out.append(sum(len(data) for _, _, (_, data) in buckets))


def _noop(*args: object) -> None:
    pass


# --- the stop sequence, on real spawned workers ---------------------------------------------


@pytest.fixture
def one_rank_group(one_rank_group):
    """tests/conftest.py's group, and the shared NVRx worker stopped before it goes."""
    try:
        yield
    finally:
        nvrx.stop_shared_worker()


def _started_queue() -> nvrx.AsyncCheckpointQueue:
    queue = nvrx.AsyncCheckpointQueue()
    queue.start_worker()
    queue.await_worker()
    caller = queue._queue.persistent_caller
    assert caller.process is not None and caller.process.is_alive()
    return queue


def _busy(queue: nvrx.AsyncCheckpointQueue, *requests: AsyncRequest) -> int:
    caller = queue._queue.persistent_caller
    for request in requests:
        queue.schedule_request(request)
    time.sleep(1.0)  # the worker is inside the last request
    return caller.process.pid


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_stop_is_clean_then_signal_then_kill(one_rank_group) -> None:
    """Idle: 'DONE' stops it. Stuck in a write: the stop signal (a clean exit). Deaf to that
    too: only then SIGKILL."""
    queue = _started_queue()
    caller = queue._queue.persistent_caller
    assert nvrx.stop_worker(caller, clean_timeout_s=30) == "clean"
    assert caller.process is None

    queue = _started_queue()
    caller = queue._queue.persistent_caller
    _busy(queue, AsyncRequest(partial(time.sleep, 120), (), []))
    assert nvrx.stop_worker(caller, clean_timeout_s=0.5, signal_timeout_s=30) == "signal"

    queue = _started_queue()
    caller = queue._queue.persistent_caller
    deaf = partial(signal.signal, nvrx.WORKER_STOP_SIGNAL, signal.SIG_IGN)
    pid = _busy(
        queue,
        AsyncRequest(deaf, (), []),
        AsyncRequest(partial(time.sleep, 120), (), []),
    )
    started = time.monotonic()
    assert nvrx.stop_worker(caller, clean_timeout_s=0.5, signal_timeout_s=0.5) == "killed"
    assert time.monotonic() - started < 15
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_abandon_keeps_an_idle_worker_and_stops_a_busy_one(one_rank_group) -> None:
    queue = _started_queue()
    caller = queue._queue.persistent_caller
    queue.abandon()
    assert nvrx._SHARED_CALLER is caller and caller.process.is_alive()
    reused = nvrx.AsyncCheckpointQueue()
    assert reused._queue.persistent_caller is caller
    pid = _busy(reused, AsyncRequest(partial(time.sleep, 120), (), []))
    reused.abandon(stop_timeout_s=0.5)
    assert nvrx._SHARED_CALLER is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_interrupted_stop_is_finished_before_the_next_worker_starts(one_rank_group) -> None:
    """An in-process restart can raise into ``stop_worker`` mid-join: the next attempt's
    ``start_worker`` finishes stopping the old worker before starting its own."""
    queue = _started_queue()
    caller = queue._queue.persistent_caller
    old = caller.process
    pid = _busy(queue, AsyncRequest(partial(time.sleep, 120), (), []))
    caller.process = None  # as stop_worker leaves it when interrupted right after its start
    nvrx._STOPPING.append(old)
    nvrx._SHARED_CALLER = None
    nvrx.AsyncCheckpointQueue().start_worker()
    assert nvrx._STOPPING == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_attempt_after_a_fault_starts_when_only_some_ranks_need_a_new_worker(
    tmp_path: Path,
) -> None:
    """A rank whose save was in flight at the fault gets a new worker; its peers keep their
    idle ones. ``start_worker`` must still be the same collective on every rank, and the ranks'
    saves must keep matching request numbers: when only the new worker's rank sent the binding
    request, its blocking poll met the peer's next collective and in-process restart looped to
    its cap (CI). Real 2-rank torchrun, real NVRx workers
    (tests/training/probes/worker_reuse_probe.py)."""
    command = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        str(REPO_ROOT / "tests/training/probes/worker_reuse_probe.py"),
        str(tmp_path),
    ]
    proc = run_in_repo(command, timeout=150)  # a timeout: the attempt never saved
    assert proc.returncode == 0, proc.stdout[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["finalized"] for r in reports] == [[0], [1]]
    assert [r["kept_worker"] for r in reports] == [True, False]  # the case under test


def _fresh_unbound_queue() -> tuple[nvrx.AsyncCheckpointQueue, object]:
    """A queue whose worker was just spawned (still importing torch) and is not bound yet."""
    nvrx.stop_shared_worker()
    queue = nvrx.AsyncCheckpointQueue()
    queue.start_worker()
    assert queue.binding, "the worker was already bound: nothing to test"
    return queue, queue._queue.persistent_caller


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_sigterm_while_the_worker_starts_does_not_kill_it(one_rank_group) -> None:
    """A drain in the first seconds of an attempt: the launcher's ``killpg`` SIGTERMs the rank's
    process group while the fresh worker is still importing torch, before its binding request
    has it ignore SIGTERM. The worker must survive it and finish the binding (the pod test's
    final save once waited on a worker killed that way until the heartbeat timeout)."""
    queue, caller = _fresh_unbound_queue()
    os.kill(caller.process.pid, signal.SIGTERM)
    assert queue.await_worker(blocking=True)
    assert caller.process.is_alive()
    os.kill(caller.process.pid, signal.SIGTERM)  # bound now: ignored
    time.sleep(0.5)
    assert caller.process.is_alive()
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, []), "rank left blocked"
    queue.close()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_worker_that_dies_before_it_is_ready_is_an_error_not_a_hang(one_rank_group) -> None:
    """NVRx's blocking wait spins for good on a dead worker; the wait for the binding names the
    death instead, so the restart layer acts at once rather than at the heartbeat timeout."""
    from training.checkpoint.layout import CheckpointError

    queue, caller = _fresh_unbound_queue()
    os.kill(caller.process.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="died before it was ready"):
        queue.await_worker(blocking=True)
    assert time.monotonic() - started < 30
    queue.abandon()
    nvrx.stop_shared_worker()


class _Trainer:
    """The least ``StatefulTrainer``: one tensor and the step."""

    def __init__(self) -> None:
        self.step = 1
        self.weights = torch.arange(1 << 16, dtype=torch.float32)

    def state_dict(self) -> dict:
        return {"weights": self.weights, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.weights.copy_(state["weights"])


HEARTBEAT_TIMEOUT_S = 1.0
"""The rank monitor's heartbeat timeout in this test, shorter than the worker's start."""


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_save_reports_liveness_while_the_worker_starts_slowly(
    one_rank_group, tmp_path: Path
) -> None:
    """A save waits for the NVRx worker's start when it comes before the worker is ready (the
    final save of an attempt that restored a few steps before the end). The wait must report
    liveness (``StepHooks.keepalive``: the in-job layer's heartbeat) more often than the
    heartbeat timeout, which NVRx's rank monitor checks whether or not a section is open
    (``rank_monitor_server.py`` ``_periodic_rank_check``): the fault matrix's in-job run was
    killed by it until its restart cap. The worker's start is slow for real: the fresh worker
    is SIGSTOPped for 3 s while it imports torch. The test applies the monitor's check
    (``_is_hb_timeout_elapsed``: the time since the last heartbeat) to every silence of the
    save, from its start to its commit."""
    from training.checkpoint.layout import committed_steps
    from training.checkpoint.manager import CheckpointManager
    from training.config import CheckpointConfig
    from training.runlog.metrics import EventLog

    nvrx.stop_shared_worker()  # a fresh worker: its start is what the save waits for
    beats: list[float] = []
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(
        config=CheckpointConfig(dir=str(root), engine="nvrx", interval=1),
        root=root,
        rank=0,
        world_size=1,
        events=EventLog(run_dir=tmp_path, rank=0),
        keepalive=lambda: beats.append(time.monotonic()),
    )
    trainer = _Trainer()
    manager.start()
    manager.prepare(trainer)  # spawns the worker, does not wait for it
    worker = nvrx._SHARED_CALLER.process
    os.kill(worker.pid, signal.SIGSTOP)
    resume = threading.Timer(3.0, os.kill, (worker.pid, signal.SIGCONT))
    resume.start()
    try:
        started = time.monotonic()
        manager.save(trainer, step=1, blocking=True)
        ended = time.monotonic()
    finally:
        resume.join()
    manager.close()
    assert committed_steps(root) == [1]
    assert ended - started > 3.0, "the save did not wait for the worker: nothing was tested"
    silences = [b - a for a, b in itertools.pairwise([started, *beats, ended])]
    assert max(silences) < HEARTBEAT_TIMEOUT_S, (
        f"silent for {max(silences):.1f} s while the save waited ({len(beats)} reports)"
    )
