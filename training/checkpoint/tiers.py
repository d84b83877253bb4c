"""Restore tiers: where a restart finds the state it resumes from, cheapest first.

The names and their cost order are :data:`training.modes.TIERS`. Each tier is one small
module behind :class:`RestoreTier`:

- ``memory``: the rank's process memory (``memory.py``; in-process restarts, when snapshots in
  the pod's memory are off);
- ``pod_memory``: the pod's ``/dev/shm`` (``pod_memory.py``; every restart that keeps the pod);
- ``peer``: a copy of this node's snapshots held in another node's pod memory (``peer.py``);
- ``local``: NVRx local checkpoints on the node's NVMe (``local.py``, GPU only);
- ``storage``: the committed checkpoints on shared storage (``storage.py``, FSx).

``CheckpointManager.for_job`` builds the run's tiers (the one place a tier is registered) and
``CheckpointManager.load_latest`` asks them, collectively, for their restorable steps and walks
all candidates newest step first, the cheaper tier first at equal steps: a rejected candidate
falls through to the next, and no tier's step older than the newest sound committed checkpoint
is reached before that checkpoint is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from training.checkpoint.staging import local_tensors
from training.modes import TIERS as TIERS  # re-exported: training/modes.py owns the names
from training.modes import TierName as TierName


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
