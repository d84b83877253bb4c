"""Restore tiers: what each failure restores from, what it recomputes and what it reads.

The product keeps the newest state in several places (training/modes.py names them, cheapest
first, and says which one a restart of each mode keeps: ``kept_snapshot_tier``):

- ``memory``: each rank's snapshot in its own process memory, every ``checkpoint.memory_interval``
  steps (training/checkpoint/memory.py); survives a restart that keeps the processes (NVRx's
  in-process Wrapper: modes ``inprocess``, ``nested``).
- ``pod_memory``: the same snapshot in the pod's /dev/shm; survives new worker processes in the
  same pod (ft_launcher's in-job restart: a dead or hung rank, an OOM, every fault in ``injob``).
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
from training.modes import TIERS, kept_snapshot_tier

MEMORY = "memory"
POD_MEMORY = "pod_memory"
PEER = "peer"
LOCAL = "local"
STORAGE = "storage"
SOURCES: tuple[str, ...] = TIERS
"""Every restore source, fastest first (training/modes.py's tier names)."""


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """Which tiers a plan assumes."""

    enabled: bool = True
    """False: every restart reads FSx (the model without memory tiers)."""
    memory_interval_steps: int | None = None
    """``checkpoint.memory_interval``; None: the planner chooses it."""

    def __post_init__(self) -> None:
        if self.memory_interval_steps is not None and self.memory_interval_steps < 1:
            raise ValueError("memory interval must be >= 1 step")


ON = TierConfig()
"""Every tier, the memory interval chosen by the planner: the default."""
OFF = TierConfig(enabled=False)
"""Every restart reads FSx."""


def whole_job_restart(*, mode: str, outcome: Outcome) -> bool:
    """The recovery recreates every pod (costs.recovery's ``_job_restart`` path)."""
    if outcome.manual or mode == "none":
        return True
    if mode in ("inprocess", "reserve") and outcome.needs_node:
        return not (mode == "reserve" and outcome.spare)
    return False


def restore_source(*, mode: str, outcome: Outcome, nodes: int, tiers: TierConfig) -> str:
    """The tier one failure of this outcome restores from in this mode (before a second loss)."""
    if not tiers.enabled or whole_job_restart(mode=mode, outcome=outcome):
        return STORAGE
    if outcome.needs_node:
        return PEER if nodes >= 2 else STORAGE
    if mode == "reserve":  # the planner's own mode: in-process restarts keep the processes
        return MEMORY
    return kept_snapshot_tier(mode) or STORAGE


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
