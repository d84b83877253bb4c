"""In-memory snapshots of each rank's state, for in-process restarts.

An in-process restart (NVRx's Wrapper: ``resilience.restart`` = ``inprocess`` or ``nested``)
keeps the processes, so a copy of the trainer's state in host memory survives it. Every
``checkpoint.memory_interval`` steps each rank copies its own shard of the state (the local
part of every DTensor, the optimizer state, sampler, step and RNG) into buffers it allocated
once; the next attempt restores the newest snapshot every rank holds, when it is newer than the
newest checkpoint on storage, instead of loading that checkpoint and recomputing the steps
since. Between two shared checkpoints an in-process fault then loses at most one memory
interval of steps instead of one checkpoint interval.

Two slots, written in turn: a slot is marked unwritten before its copy starts and gets its step
only once the copy is complete (on a GPU, once the device-to-host copies recorded before its
event are done), so a fault in the middle of a copy leaves the other slot, the previous
snapshot, intact. A snapshot is offered only to the same run and rank in a world of the same
size, and restored only into a state of the same structure (every leaf's path, and each
tensor's dtype and local shape); the ranks agree on the step first (``CheckpointManager``), so
they all restore the same step or all load from storage.

New processes (an in-job restart, a new pod) start with no snapshot and load from storage: this
tier replaces neither the shared checkpoints nor the node-local ones (``local.py``).
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from training.checkpoint.snapshot_files import walk as _walk
from training.checkpoint.tiers import (
    Rejected,
    Restored,
    RestoreTier,
    SnapshotTier,
    TierContext,
    agree,
    common_steps,
)
from training.runlog.metrics import EventLog


@dataclass
class _Slot:
    step: int | None = None
    """The snapshot's step; None while unwritten or being written."""
    owner: str = ""
    """The run it belongs to (its checkpoint root): a later run in the same process (a test
    process, a notebook) never restores another run's state."""
    rank: int = -1
    world_size: int = 0
    key: tuple = ()
    buffers: list[torch.Tensor | None] = field(default_factory=list)
    """Per leaf: the host copy of a tensor's local part, None for other values."""
    values: list[Any] = field(default_factory=list)
    """Per leaf: a deep copy of a non-tensor value, None for tensors."""
    ready: Any = None
    """On a GPU: the CUDA event recorded after the slot's device-to-host copies."""

    def is_complete(self) -> bool:
        if self.step is None:
            return False
        if self.ready is None:
            return True
        try:
            self.ready.synchronize()
        except RuntimeError:  # the device failed: the copies may not have finished
            self.step = None
            return False
        return True


class MemorySnapshots:
    """The snapshots of one process (see the module docstring); :data:`SNAPSHOTS` is the one a
    trainer uses, kept for the life of the process across in-process attempts."""

    def __init__(self) -> None:
        self._slots = [_Slot(), _Slot()]
        self._next = 0
        self._streams: dict[torch.device, Any] = {}
        self._copying: Any = None
        """The event after the newest snapshot's device-to-host copies, until the compute
        stream has been told to wait for it (``before_update``)."""

    @torch.no_grad()
    def take(
        self, state: dict[str, Any], *, owner: str, step: int, rank: int, world_size: int
    ) -> None:
        """Copy ``state`` (a trainer's ``state_dict()``) into the next slot: one that holds
        this step or a later one if any (a replayed step replaces what an abandoned timeline
        left: never two snapshots of one step), else the two in turn."""
        later = [i for i, s in enumerate(self._slots) if s.step is not None and s.step >= step]
        if later:
            self._next = min(later, key=lambda i: self._slots[i].step != step)
        slot = self._slots[self._next]
        slot.step = None  # torn until the copy below is complete
        leaves, key = _walk(state)
        if key != slot.key:
            slot.buffers = [_host_buffer(value) for _, _, value in leaves]
            slot.key = key
        device = next(
            (v.device for _, _, v in leaves if isinstance(v, torch.Tensor) and v.is_cuda), None
        )
        # On a GPU the copies run on a side stream, after the step that made the state (it
        # waits for the compute stream) and beside the next step's forward and backward, which
        # only read the state; ``before_update`` holds the optimizer's in-place update back
        # until they are done.
        stream = self._stream(device) if device is not None else None
        values: list[Any] = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(device))
            for (_, _, value), buffer in zip(leaves, slot.buffers, strict=True):
                if buffer is None:
                    values.append(copy.deepcopy(value))
                    continue
                buffer.copy_(value, non_blocking=value.is_cuda)
                values.append(None)
            slot.values = values
            slot.ready = None
            if stream is not None:
                # The slot is complete once this event is.
                slot.ready = torch.cuda.Event()
                slot.ready.record(stream)
                self._copying = slot.ready
        slot.owner, slot.rank, slot.world_size = owner, rank, world_size
        slot.step = step
        self._next = 1 - self._next

    def before_update(self) -> None:
        """Call before the state changes in place (the optimizer step): on a GPU the compute
        stream waits for the newest snapshot's copies (no host wait); nothing otherwise."""
        if self._copying is not None:
            torch.cuda.current_stream().wait_event(self._copying)
            self._copying = None

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def steps(self, *, owner: str, rank: int, world_size: int) -> list[int]:
        """The steps of the complete snapshots this rank of this run may restore, newest
        first."""
        held = [
            s.step
            for s in self._slots
            if (s.owner, s.rank, s.world_size) == (owner, rank, world_size) and s.is_complete()
        ]
        return sorted((step for step in held if step is not None), reverse=True)

    @torch.no_grad()
    def matches(self, state: dict[str, Any], *, step: int) -> bool:
        """Whether the snapshot of ``step`` has the structure of ``state`` (restorable)."""
        slot = self._slot(step)
        return slot is not None and slot.is_complete() and slot.key == _walk(state)[1]

    @torch.no_grad()
    def restore(self, state: dict[str, Any], *, step: int) -> None:
        """Copy the snapshot of ``step`` into ``state`` in place (tensors' local parts) and put
        its other values back; the caller then hands ``state`` to ``load_state_dict``."""
        slot = self._slot(step)
        leaves, key = _walk(state)
        if slot is None or not slot.is_complete() or slot.key != key:
            raise ValueError(f"no restorable memory snapshot of step {step}")
        for (container, name, value), buffer, saved in zip(
            leaves, slot.buffers, slot.values, strict=True
        ):
            if buffer is None:
                container[name] = copy.deepcopy(saved)
            else:
                value.copy_(buffer)

    def buffers(self, step: int) -> list[torch.Tensor]:
        slot = self._slot(step)
        return [b for b in (slot.buffers if slot is not None else []) if b is not None]

    def discard_newer(self, step: int) -> list[int]:
        """After a restore of ``step`` (from any tier): forget the snapshots of later steps,
        the timeline that died; the steps forgotten."""
        removed = []
        for slot in self._slots:
            if slot.step is not None and slot.step > step:
                removed.append(slot.step)
                slot.step = None
        return removed

    def clear(self) -> None:
        self._slots = [_Slot(), _Slot()]
        self._next = 0
        self._copying = None

    def _slot(self, step: int) -> _Slot | None:
        return next((s for s in self._slots if s.step == step), None)


def _host_buffer(value: Any) -> torch.Tensor | None:
    """A host tensor for a copy of ``value``'s local part (pinned when it lives on a GPU, so
    the device-to-host copy is asynchronous); None for a value that is not a tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    pinned = value.device.type == "cuda"
    return torch.empty(value.shape, dtype=value.dtype, pin_memory=pinned)


class ProcessMemoryTier:
    """The ``memory`` restore tier (``tiers.RestoreTier``) over this process's snapshots."""

    name = "memory"

    def __init__(self, snapshots: MemorySnapshots, *, owner: str, rank: int, world_size: int):
        self.snapshots = snapshots
        self.owner, self.rank, self.world_size = owner, rank, world_size

    def steps(self) -> list[int]:
        held = self.snapshots.steps(owner=self.owner, rank=self.rank, world_size=self.world_size)
        return common_steps(held)

    def load(self, trainer: Any, *, step: int) -> Restored | Rejected:
        state = trainer.state_dict()
        fits = self.snapshots.matches(state, step=step)
        problem = agree(None if fits else "structure")  # all ranks restore, or none does
        if problem is not None:
            return Rejected(path="memory", problem=problem)
        self.snapshots.restore(state, step=step)
        trainer.load_state_dict(state)
        nbytes = sum(b.numel() * b.element_size() for b in self.snapshots.buffers(step))
        return Restored(path="memory", nbytes=nbytes)


SNAPSHOTS = MemorySnapshots()
"""This process's snapshots: in-process restarts run every attempt in the same process."""


class ProcessMemorySnapshotTier(SnapshotTier):
    """The ``memory`` snapshot tier: every ``checkpoint.memory_interval`` steps a copy of the
    rank's state in this process's memory (``SNAPSHOTS``). Local to the rank: no collective."""

    name = "memory"

    def __init__(
        self,
        *,
        snapshots: MemorySnapshots,
        interval: int,
        owner: str,
        rank: int,
        world_size: int,
        events: EventLog,
    ) -> None:
        self.snapshots = snapshots
        self.interval = interval
        self.owner = owner
        self.rank, self.world_size = rank, world_size
        self.events = events

    def restore_tiers(self) -> list[RestoreTier]:
        return [
            ProcessMemoryTier(
                self.snapshots, owner=self.owner, rank=self.rank, world_size=self.world_size
            )
        ]

    def due(self, step: int, *, shared: bool) -> bool:
        # Also at a shared save's step: a restart then restores it from memory instead of
        # reading it back from storage (docs/restore-tiers.md).
        return step % self.interval == 0

    def take(self, trainer: Any, *, step: int) -> None:
        started = time.perf_counter()
        self.snapshots.take(
            trainer.state_dict(),
            owner=self.owner,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
        )
        self.events.emit(
            "memory_snapshot", step=step, blocking_s=time.perf_counter() - started, tier=self.name
        )

    def before_update(self) -> None:
        self.snapshots.before_update()

    def discard_newer(self, step: int) -> None:
        self.snapshots.discard_newer(step)

    def release(self) -> None:
        self.snapshots.clear()  # the run is over: nothing restarts into this process

    def abandon(self) -> None:
        pass  # an in-process restart restores from it


def snapshot_tier(context: TierContext) -> ProcessMemorySnapshotTier | None:
    """The registry's row: on when ``training.modes.snapshot_plan`` picks process memory."""
    if context.plan.tier != "memory":
        return None
    return ProcessMemorySnapshotTier(
        snapshots=SNAPSHOTS,
        interval=context.config.memory_interval,
        owner=str(context.root),
        rank=context.rank,
        world_size=context.world_size,
        events=context.events,
    )
