"""The save engines: how a shared checkpoint's files get written, behind :class:`SaveEngine`.

- ``sync``: torch DCP's blocking ``save``; committed before ``CheckpointManager.save`` returns;
- ``torch_async``: torch DCP's ``async_save`` in its background process (``torch_async.py``);
- ``nvrx``: NVRx's persistent worker (``nvrx_async.py``), with a cached save plan.

The manager owns the step directory, the pending saves and the commit; an engine writes this
rank's files and reports, through ``EngineContext.finalize``, when every rank's are durable.
``registry.ENGINES`` maps ``checkpoint.engine`` to an engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from training.checkpoint.integrity import ChecksummingWriter
from training.checkpoint.layout import SHARDS, write_rank_manifest
from training.checkpoint.staging import staged_bytes, structure_key
from training.checkpoint.torch_async import drop_background_process


@dataclass
class Pending:
    """A save scheduled and not yet committed."""

    step: int
    path: Path
    started: float
    future: Any = None  # torch_async only


@dataclass(frozen=True, kw_only=True)
class EngineContext:
    """What an engine gets from the manager that owns it."""

    rank: int
    keepalive: Callable[[], None]
    pending: list[Pending]
    """The manager's saves in flight, oldest first (the engine appends what it schedules)."""
    finalize: Callable[[Pending], None]
    """Every rank's files of a save are durable: commit it (collective)."""
    plan_key: str
    """torch's save-plan cache key for this manager (:class:`CachingSavePlanner`)."""


class SaveEngine(Protocol):
    """One way to write a shared checkpoint. Collective methods: every rank calls them at the
    same point."""

    commits_inline: bool
    """Whether the commit runs on the caller (sync) instead of rank 0's committer thread."""
    cpu_collectives: bool
    """Whether the process group needs a CPU backend beside NCCL (``needs_cpu_collectives``)."""

    def start(self) -> None:
        """Spawn what writes in the background, without waiting for it (collective)."""
        ...

    def prepare(self, trainer: Any, *, root: Path) -> None:
        """After the first step: ready the first save (plan, staging buffer; collective)."""
        ...

    def plan_fits(self, state: dict[str, Any]) -> bool:
        """Whether this rank's cached save plan fits ``state`` (the ranks then agree)."""
        ...

    def write(
        self, state: dict[str, Any], *, pending: Pending, reuse_plan: bool, mark: Callable
    ) -> None:
        """Write (or schedule) this rank's files of ``pending``; ``mark`` times each phase."""
        ...

    def poll(self, *, blocking: bool) -> None:
        """Finalize the saves every rank has written (collective); ``blocking``: all of them."""
        ...

    def tick(self) -> None:
        """Every step, pending or not: finish the worker's start (collective)."""
        ...

    def close(self) -> None:
        """Finish and stop the background writer (collective)."""
        ...

    def abandon(self) -> None:
        """After a fault, without a collective: drop the writes in flight."""
        ...


class Phases:
    """Seconds spent in each phase of one save (the blocking part), in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


class CachingSavePlanner(DefaultSavePlanner):
    """torch's save planner with its plan caching on (torch 2.13 ``default_planner.py``:
    ``enable_plan_caching``; each rank still compares its local plan with the cached one and
    sends an empty plan when it is unchanged), under a key of its own: torch keys its
    class-level cache by class name, so two managers (a restart with another world size in the
    same process) would otherwise share, and mix, their plans. Module-level: torch_async pickles
    it into its background process, where the cache then lives."""

    def __init__(self, *, key: str) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key


class _TorchEngine:
    """What both torch DCP engines share: the checksumming writer, the cached planner."""

    commits_inline = False
    cpu_collectives = False

    def __init__(self, context: EngineContext) -> None:
        self.context = context

    def _writer(self, path: Path) -> ChecksummingWriter:
        return ChecksummingWriter(path, rank=self.context.rank)

    def _planner(self) -> CachingSavePlanner:
        return CachingSavePlanner(key=self.context.plan_key)

    def start(self) -> None:
        pass

    def tick(self) -> None:
        pass

    def prepare(self, trainer: Any, *, root: Path) -> None:
        pass

    def plan_fits(self, state: dict[str, Any]) -> bool:
        return False

    def close(self) -> None:
        pass


class SyncEngine(_TorchEngine):
    """torch DCP's blocking save: written and committed when ``save`` returns."""

    commits_inline = True

    def write(
        self, state: dict[str, Any], *, pending: Pending, reuse_plan: bool, mark: Callable
    ) -> None:
        dcp.save(state, storage_writer=self._writer(pending.path), planner=self._planner())
        mark("write")
        self.context.finalize(pending)
        mark("commit")

    def poll(self, *, blocking: bool) -> None:
        pass

    def abandon(self) -> None:
        pass


class TorchAsyncEngine(_TorchEngine):
    """torch DCP's ``async_save``: staged on the caller, written in a background process.
    It plans with collectives on CPU tensors and refuses a group without a CPU backend, so on
    a GPU the group is "cpu:gloo,cuda:nccl" (training/parallel.py)."""

    cpu_collectives = True

    def write(
        self, state: dict[str, Any], *, pending: Pending, reuse_plan: bool, mark: Callable
    ) -> None:
        # On CPU nothing copies the live tensors before the background write: clone them.
        staged = state if torch.cuda.is_available() else _snapshot(state)
        mark("snapshot")
        pending.future = dcp.async_save(
            staged,
            storage_writer=self._writer(pending.path),
            planner=self._planner(),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        mark("schedule")
        self.context.pending.append(pending)

    def poll(self, *, blocking: bool) -> None:
        saves = self.context.pending
        while saves:
            head = saves[0]
            while blocking and not head.future.done():
                self.context.keepalive()
                time.sleep(0.05)
            done = torch.tensor(
                [1 if head.future.done() else 0], dtype=torch.int32, device=collective_device()
            )
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if not done.item():
                return
            head.future.result()  # re-raises a failed write; the manifest is written by then
            self.context.finalize(head)

    def abandon(self) -> None:
        drop_background_process()  # every rank: the next attempt makes a new one alike


class NvrxEngine:
    """NVRx async checkpointing with a persistent worker per rank (``nvrx_async.py``)."""

    commits_inline = False
    cpu_collectives = False

    def __init__(self, context: EngineContext) -> None:
        from training.checkpoint.nvrx_async import AsyncCheckpointQueue  # imports NVRx

        self.context = context
        self.queue: AsyncCheckpointQueue | None = AsyncCheckpointQueue(keepalive=context.keepalive)
        self._started = False
        self._plan_key: tuple | None = None
        """The structure the cached save plan was made for."""

    def start(self) -> None:
        """Spawn (or rebind) this attempt's NVRx worker, once, without waiting for it; the steps'
        :meth:`tick` find it ready. Not at the manager's start: a fresh worker imports torch
        (seconds of CPU) and the write-results server's start blocks (~0.1 s, a fresh Python);
        both sat on a restart's critical path, between the model build and the first step. The
        first save is an interval later. Collective (the worker's binding): every rank calls it
        at the same point, which the manager's ``prepare`` and ``save`` are."""
        if self.queue is not None and not self._started:
            self._started = True
            self.queue.start_worker()

    def tick(self) -> None:
        if self.queue is not None:
            self.queue.await_worker(blocking=False)  # a no-op once the worker is up

    def prepare(self, trainer: Any, *, root: Path) -> None:
        assert self.queue is not None
        state = {"trainer": trainer.state_dict()}  # as the manager's save builds it
        self.queue.plan_ahead(state_dict=state, checkpoint_root=str(root))
        self._plan_key = structure_key(state)
        nbytes = staged_bytes(state)
        if nbytes:
            self.queue.reserve_staging(nbytes)

    def plan_fits(self, state: dict[str, Any]) -> bool:
        key = structure_key(state)
        fits = key == self._plan_key and self.queue is not None and self.queue.has_plan()
        self._plan_key = key
        return fits

    def write(
        self, state: dict[str, Any], *, pending: Pending, reuse_plan: bool, mark: Callable
    ) -> None:
        assert self.queue is not None
        self.start()  # a save before any prepare (none in the trainer's loop)
        self._wait_for_own_writes()
        mark("wait_previous")
        self.queue.schedule_save(
            state_dict=state,
            checkpoint_dir=str(pending.path),
            reuse_plan=reuse_plan,
            after_write=partial(write_rank_manifest, str(pending.path), self.context.rank),
            finalize=partial(self.context.finalize, pending),
            phases=mark,
        )
        self.context.pending.append(pending)

    def _wait_for_own_writes(self) -> None:
        """Wait, in Python, until the worker has written this rank's earlier saves.

        The persistent worker writes one request at a time, and NVRx's schedule then blocks in
        ``JoinableQueue.join()`` (a wait inside C) until the worker has staged the new request,
        that is, after it finished the previous write. NVRx's in-process watchdog times out
        when either of its timestamps is stale (``progress_watchdog.py`` ``is_timed_out``), and
        the automatic one only moves while the main thread runs Python: a write slowed by a
        busy file system would read as a hang. Polling for the rank's manifest (written by the
        worker right after the files) keeps it moving; the wait is the same length."""
        for pending in list(self.context.pending):
            manifest = pending.path / SHARDS / f"rank_{self.context.rank:05d}.json"
            while not manifest.exists() and self.queue is not None and self.queue.worker_alive():
                self.context.keepalive()
                time.sleep(0.05)

    def poll(self, *, blocking: bool) -> None:
        if self.queue is not None:
            self.queue.poll(blocking=blocking)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
            self.queue = None

    def abandon(self) -> None:
        if self.queue is not None:
            self.queue.abandon()
            self.queue = None


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: the rank's current CUDA device
    when the group's backend is NCCL (NCCL takes CUDA tensors only: ``ProcessGroupNCCL`` rejects
    a CPU tensor with "Tensors must be CUDA and dense"), the CPU otherwise (gloo). Mixed
    backends ("cpu:gloo,cuda:nccl") take CPU tensors on gloo, so only a pure NCCL group needs
    the device."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _snapshot(state: Any) -> Any:
    """Deep copy of the tensors in a state dict (DTensors keep their sharding)."""
    if isinstance(state, dict):
        return {key: _snapshot(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_snapshot(value) for value in state]
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state
