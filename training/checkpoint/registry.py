"""The one registry of the checkpoint seam: the save engines by ``checkpoint.engine``, and the
snapshot tiers, one row each (a tier is one module: its writer, its ``SnapshotTier`` and its
``RestoreTier``, and a ``snapshot_tier(context)`` factory that says whether it is on).

A new tier is its module, its name in ``training.modes.TIERS`` (the restore order) and one row
in :data:`TIER_ROWS`; ``CheckpointManager`` iterates whatever :func:`build` returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from training.checkpoint import local, memory, peer, pod_memory
from training.checkpoint.engines import (
    EngineContext,
    NvrxEngine,
    SaveEngine,
    SyncEngine,
    TorchAsyncEngine,
)
from training.checkpoint.tiers import SnapshotTier, TierContext
from training.config import CheckpointConfig

ENGINES: dict[str, type[SaveEngine]] = {
    "nvrx": NvrxEngine,
    "torch_async": TorchAsyncEngine,
    "sync": SyncEngine,
}
"""``checkpoint.engine`` -> its engine (the names: ``training.config.CheckpointEngine``)."""

TierRow = Callable[[TierContext], SnapshotTier | None]

TIER_ROWS: list[TierRow] = [
    local.snapshot_tier,
    memory.snapshot_tier,
    pod_memory.snapshot_tier,
    peer.snapshot_tier,  # wraps pod_memory's: after its row
]
"""The snapshot tiers, in the order a step takes them: the I/O ones first (after the shared
save, in its section), then the copies in memory. A row returns None when its tier is off."""


def engine_for(config: CheckpointConfig, context: EngineContext) -> SaveEngine:
    return ENGINES[config.engine](context)  # type: ignore[call-arg]


def needs_cpu_collectives(config: CheckpointConfig) -> bool:
    """Whether the checkpoint engine needs a CPU backend in the process group (on a GPU the
    group is then "cpu:gloo,cuda:nccl", training/parallel.py)."""
    return ENGINES[config.engine].cpu_collectives


def build(context: TierContext) -> list[SnapshotTier]:
    """The run's active snapshot tiers, row by row; a tier that wraps another (``wraps``)
    takes its place."""
    active: list[SnapshotTier] = []
    for row in TIER_ROWS:
        tier = row(dataclasses.replace(context, built=tuple(active)))
        if tier is None:
            continue
        if tier.wraps is not None:
            active[active.index(tier.wraps)] = tier
        else:
            active.append(tier)
    return active
