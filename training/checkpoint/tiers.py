"""Snapshot and restore tiers: where the state is kept between shared checkpoints
(:class:`SnapshotTier`), and where a restart finds the state it resumes from, cheapest first
(:class:`RestoreTier`).

The names and their cost order are :data:`training.modes.TIERS`. Each tier is one small
module behind :class:`RestoreTier`:

- ``memory``: the rank's process memory (``memory.py``; in-process restarts, when snapshots in
  the pod's memory are off);
- ``pod_memory``: the pod's ``/dev/shm`` (``pod_memory.py``; every restart that keeps the pod);
- ``peer``: a copy of this node's snapshots held in another node's pod memory (``peer.py``);
- ``local``: NVRx local checkpoints on the node's NVMe (``local.py``, GPU only);
- ``storage``: the committed checkpoints on shared storage (``storage.py``, FSx).

``training.checkpoint.registry.build`` builds the run's snapshot tiers from one table of rows
(the one place a tier is registered); each brings its restore tiers, and the manager adds
``storage``. ``CheckpointManager.after_step`` takes the snapshots each tier says are due, and
``CheckpointManager.load_latest`` asks the restore tiers, collectively, for their restorable
steps and walks all candidates newest step first, the cheaper tier first at equal steps: a
rejected candidate falls through to the next, and no tier's step older than the newest sound
committed checkpoint is reached before that checkpoint is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from training.checkpoint.staging import local_tensors
from training.config import CheckpointConfig
from training.modes import TIERS as TIERS  # re-exported: training/modes.py owns the names
from training.modes import SnapshotPlan
from training.modes import TierName as TierName
from training.runlog.metrics import EventLog


@dataclass(frozen=True, kw_only=True)
class Restored:
    """A tier loaded a step into the trainer."""

    path: str
    """Where it came from (a directory, or the tier's name)."""
    nbytes: int
    """Bytes of this rank's state restored (the local tensors' bytes)."""


@dataclass(frozen=True, kw_only=True)
class Rejected:
    """A tier could not load a step; the trainer's state is unchanged on every rank."""

    path: str
    problem: str


class RestoreTier(Protocol):
    """One source of restorable state. Both methods are collective: every rank calls them in
    the same order and gets the same answer."""

    name: TierName

    def steps(self) -> list[int]:
        """The steps every rank can restore from this tier, newest first."""
        ...

    def load(self, trainer: Any, *, step: int) -> Restored | Rejected:
        """Load ``step`` into ``trainer`` (a ``StatefulTrainer``), or change nothing on any
        rank and say why not."""
        ...


@dataclass(frozen=True, kw_only=True)
class TierContext:
    """What a tier's factory (a row of ``registry.TIER_ROWS``) builds its tier from."""

    config: CheckpointConfig
    root: Path
    """The shared checkpoints' root (``config.checkpoint_dir``): the run's identity."""
    rank: int
    world_size: int
    local_world_size: int
    """torchrun's ranks per node (``LOCAL_WORLD_SIZE``)."""
    events: EventLog
    keepalive: Callable[[], None]
    """Called between the passes of a blocking wait (``StepHooks.keepalive``)."""
    plan: SnapshotPlan
    """The run's snapshot tier and copies (``training.modes.snapshot_plan``)."""
    built: tuple[SnapshotTier, ...] = ()
    """The tiers of the rows above this one (a tier that wraps another finds it here)."""


class SnapshotTier(Protocol):
    """One place the state is written to between shared checkpoints, and its restore tiers.

    The manager calls every active tier at the same points on every rank, in the order of
    ``registry.TIER_ROWS``; the collective ones say so. Subclass it for the defaults (no-ops)."""

    name: str
    io: bool = False
    """Whether a take is I/O (the trainer's ``checkpoint_save`` section, which the restart
    layer's hang timeout allows for) rather than a copy in host memory between two steps."""
    wraps: SnapshotTier | None = None
    """The tier whose snapshots this one carries on (peer: pod memory's); it takes that tier's
    place in the schedule and drives it."""

    def restore_tiers(self) -> list[RestoreTier]:
        """The restore tiers over what this tier writes."""
        ...

    def due(self, step: int, *, shared: bool) -> bool:
        """Whether to take a snapshot after ``step`` (``shared``: a shared save was just
        scheduled at it). The same answer on every rank."""
        ...

    def start(self) -> None:
        """At the attempt's start, before the restore: clear what no restore can use."""

    def prepare(self, trainer: Any) -> None:
        """After the first step (the optimizer state exists): ready the first take."""

    def take(self, trainer: Any, *, step: int) -> None:
        """Copy or write ``trainer``'s state of ``step``."""
        ...

    def before_update(self) -> None:
        """Before the optimizer changes the state in place: a take still reading it (a GPU's
        device-to-host copies) is waited for, on the device (no host wait)."""

    def poll(self) -> None:
        """Between steps: finish what every rank has finished (collective where it says so)."""

    def wait(self) -> None:
        """Until everything taken is finished (collective where it says so)."""

    def discard_newer(self, step: int) -> None:
        """After a restore of ``step`` (0: none): forget this rank's snapshots of later steps,
        the timeline that died. Local: no collective."""

    def close(self) -> None:
        """The run is over: finish (collectively) and give back what the tier holds."""
        self.release()

    def release(self) -> None:
        """Give back what the tier holds (memory, files), without a collective."""

    def abandon(self) -> None:
        """After a fault, without a collective: drop what is in flight."""


def cost(name: TierName) -> int:
    return TIERS.index(name)


def by_cost(tiers: list[RestoreTier]) -> list[RestoreTier]:
    """``tiers`` in the order of :data:`TIERS` (one tier of each name at most)."""
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ValueError(f"one restore tier per name, got {names}")
    return sorted(tiers, key=lambda t: cost(t.name))


def common_steps(held: list[int]) -> list[int]:
    """The steps every rank holds (``held``: this rank's), newest first (collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return sorted(set(held), reverse=True)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(held))
    common = set(gathered[0]).intersection(*gathered[1:])
    return sorted(common, reverse=True)


def agree(problem: str | None) -> str | None:
    """Every rank's verdict: the first problem any rank found, on every rank (collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return problem
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return next((f"rank {rank}: {p}" for rank, p in enumerate(gathered) if p), None)


def state_bytes(state: Any) -> int:
    """Bytes of the local tensors in a (nested) state: what a restore of it moves per rank."""
    return sum(t.numel() * t.element_size() for t in local_tensors(state))
