"""Restore tiers: what each failure restores from, what it recomputes and what it reads.

The product keeps the newest state in several places (training/modes.py names them, cheapest
first). Which snapshot tier a run writes, and so restores from, is the product's own decision,
``training.modes.snapshot_plan`` (the checkpoint manager takes it too), evaluated here on the
product's checkpoint settings (:data:`PLANNED`), so the planner cannot restore from another
tier than the product:

- ``pod_memory``: each rank's snapshot in the pod's /dev/shm every ``checkpoint.memory_interval``
  steps (training/checkpoint/pod_memory.py; ``checkpoint.pod_memory_dir``, on by default);
  survives every restart that keeps the pod: new worker processes (``injob``, a dead rank in
  ``nested``) and in-process restarts (``inprocess``, ``nested``) alike.
- ``memory``: the snapshot in each rank's own process memory (training/checkpoint/memory.py),
  only with ``pod_memory_dir`` empty; survives a restart that keeps the processes.
- ``peer``: each node's newest snapshot also in the next node's memory; a replacement pod
  restores its node's shard from that peer over EFA instead of from FSx. Needs two nodes or
  more, and is gone when a second loss takes the holder before the replacement has restored.
- ``local``: NVRx local checkpoints on the node's NVMe (GPU only), every
  ``checkpoint.local_interval`` steps. Whatever leaves a node's NVMe readable leaves its pod's
  memory too, and the memory snapshots are at least as new (the recipes take one every half
  local interval) and faster to read, so the planner never restores from it; the name is here so
  that a restore source from a run report always has a meaning.
- ``storage``: the committed checkpoints on FSx for Lustre; survives everything, and a restore
  from it rolls back to the newest commit (half a checkpoint interval plus the commit lag).

A failure restores from the fastest tier that survives it; the steps it recomputes are half a
memory interval on average for the memory tiers, and what the checkpoint model already charges
(the work since the newest commit) for storage. With the tiers off every restart reads FSx:
the planner's model before these tiers, kept for the side-by-side comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.failures import Outcome
from training.config import CheckpointConfig
from training.modes import MODES, TIERS, ModeSpec, snapshot_plan

MEMORY = "memory"
POD_MEMORY = "pod_memory"
PEER = "peer"
LOCAL = "local"
STORAGE = "storage"
SOURCES: tuple[str, ...] = TIERS
"""Every restore source, fastest first (training/modes.py's tier names)."""

RESERVE = ModeSpec(
    summary="NOT SHIPPED: in-process with NVRx reserve ranks on the hot spares",
    launcher="torchrun",
    ft_restart_policy=None,
    keeps_processes=True,
    keeps_pod=True,
    keeps_nodes=False,
    spare_ranks=True,
)
"""The planner's own scenario: ``inprocess`` whose lost node's ranks are replaced by reserve
ranks on a hot spare while one is free (planner.costs)."""
ROWS: dict[str, ModeSpec] = {
    **{mode: row for mode, row in MODES.items() if not row.replica_groups},
    "reserve": RESERVE,
}
"""Every mode the tier model evaluates: the product's rows (training/modes.py), then its own.
Replica groups are not among them: this model restarts every rank on a fault, so it would
price them as a global in-job restart; they have a row of their own,
``planner.costs.replica_recovery`` (one group's restart at its size, healed from a peer group,
priced in ``planner.plan``; docs/planner.md, docs/replica-groups.md)."""


def row(mode: str) -> ModeSpec:
    """The row of ``mode``; a clear error naming the choices for anything else."""
    try:
        return ROWS[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(ROWS)}") from None


PLANNED = CheckpointConfig(memory_interval=1, peer_copy=True)
"""The checkpoint settings the plan assumes: the product's (``checkpoint.pod_memory_dir`` at
its default, which no recipe or overlay clears) with snapshots and peer copies on, as the
plan's command line recommends them (the interval is the plan's own)."""


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """Which tiers a plan assumes."""

    enabled: bool = True
    """False: every restart reads FSx (the model without memory tiers)."""
    memory_interval_steps: int | None = None
    """``checkpoint.memory_interval``; None: the planner chooses it."""
    checkpoint: CheckpointConfig = PLANNED
    """The product's checkpoint settings that decide the snapshot tier (``snapshot_plan``)."""

    def __post_init__(self) -> None:
        if self.memory_interval_steps is not None and self.memory_interval_steps < 1:
            raise ValueError("memory interval must be >= 1 step")


ON = TierConfig()
"""Every tier, the memory interval chosen by the planner: the default."""
OFF = TierConfig(enabled=False)
"""Every restart reads FSx."""


def whole_job_restart(*, mode: str, outcome: Outcome) -> bool:
    """The recovery recreates every pod (costs.recovery's ``_job_restart`` path): always for a
    manual intervention or a mode whose restarts keep no pod; for a lost node, in a mode that
    does not keep the other nodes, unless reserve ranks on a spare take its place."""
    spec = row(mode)
    if outcome.manual or not spec.keeps_pod:
        return True
    if outcome.needs_node and not spec.keeps_nodes:
        return not (spec.spare_ranks and outcome.spare)
    return False


def restore_source(*, mode: str, outcome: Outcome, nodes: int, tiers: TierConfig) -> str:
    """The tier one failure of this outcome restores from in this mode (before a second loss):
    the snapshot tier ``snapshot_plan`` gives the product's settings, the peer copy for a lost
    node where it makes one, else storage."""
    if not tiers.enabled or whole_job_restart(mode=mode, outcome=outcome):
        return STORAGE
    plan = snapshot_plan(checkpoint=tiers.checkpoint, restart=row(mode), nodes=nodes)
    if outcome.needs_node:
        return PEER if plan.copies >= 2 else STORAGE
    return plan.tier or STORAGE


def peer_lost_chance(*, node_rate_per_s: float, window_s: float) -> float:
    """The chance that a second loss takes a lost node's peer copy before it is restored.

    Each node's copy lives on its next ring neighbour, and the lost node held its previous
    neighbour's copy: the next one failing within ``window_s`` (from the first loss until the
    replacement has read its shard) takes the lost node's only copy, the previous one failing
    leaves its own shard without a copy. Either way the ranks cannot agree on a memory step and
    all restore from FSx: ``1 - exp(-2 lambda w)`` with ``lambda`` one node's failure rate.
    Correlated losses (a rack's power) are not modelled.
    """
    if node_rate_per_s < 0 or window_s < 0:
        raise ValueError("rate and window must be >= 0")
    return -math.expm1(-2.0 * node_rate_per_s * window_s)
