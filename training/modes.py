"""The restart modes: one table of what each mode launches and what its restarts keep.

Everything that depends on ``resilience.restart`` derives it from :data:`MODES`: the CLI's
choices and the config's validation (``training/config.py``), the launcher and its
``--ft-restart-policy`` (``training/command.py``), the pod supervisor's exit code
(``training/launch/pod.py``), the overlays' allowed modes (``manifests/sizes.py``), the
snapshot tier a run takes (:func:`snapshot_plan`: the checkpoint manager, the pod's
``/dev/shm`` budget in ``manifests/render.py`` and the planner's restore sources, so the planner
cannot restore from another tier than the product) and the planner's labels.
Adding a mode is one row here (``tests/test_modes_owner.py`` fails if a list of mode names
comes back anywhere else).

Standard library only: the CDK app, the manifests and the planner import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args

RestartMode = Literal["none", "injob", "inprocess", "nested", "replica"]
"""``resilience.restart``; the order of :data:`MODES` (the planner's columns)."""
Launcher = Literal["torchrun", "ft_launcher"]
TierName = Literal["memory", "pod_memory", "peer", "local", "storage"]
TIERS: tuple[TierName, ...] = get_args(TierName)
"""Every restore tier, cheapest first: the order ``CheckpointManager.load_latest`` tries them
at equal steps (``training/checkpoint/tiers.py`` holds the tiers themselves)."""
SnapshotTier = Literal["memory", "pod_memory"]
"""The tiers the trainer writes snapshots to every ``checkpoint.memory_interval`` steps."""


@dataclass(frozen=True, kw_only=True)
class ModeSpec:
    """One restart mode: its launcher and what a restart keeps (on a fault that leaves every
    node up, unless said otherwise)."""

    summary: str
    """One line for tables and plots (the planner's labels)."""
    launcher: Launcher
    """``torchrun`` with static ranks, or NVRx's ``ft_launcher``, which respawns the workers."""
    ft_restart_policy: str | None
    """``ft_launcher``'s ``--ft-restart-policy``; None with ``torchrun``."""
    keeps_processes: bool
    """The ranks recover inside their processes (NVRx's in-process Wrapper): state in process
    memory survives (the ``memory`` snapshot tier)."""
    keeps_pod: bool
    """The restart keeps the pod, and with it the snapshots in its ``/dev/shm`` (the
    ``pod_memory`` tier); False: a restart is a whole-job restart."""
    keeps_nodes: bool
    """When one node is lost, the other nodes' pods are kept and their launchers wait for its
    replacement (``ft_launcher``'s rendezvous), instead of the whole job restarting."""
    replica_groups: bool = False
    """The ranks form ``resilience.replica_groups`` replica groups (HSDP: FSDP2 shards inside a
    group, torchft's Manager averages gradients across groups, ``training/replica/``): a fault
    restarts only its own group (its launcher's in-job restart), which heals from a live peer
    group; the other groups keep their processes and wait at the step's quorum."""
    spare_ranks: bool = False
    """Reserve ranks wait on the hot spares and take a lost node's place inside the running
    processes (NVRx in-process's reserve ranks). No shipped mode has them: the planner's
    ``reserve`` row (``planner.tiers.ROWS``) models what they would buy."""

    def __post_init__(self) -> None:
        if (self.launcher == "ft_launcher") != (self.ft_restart_policy is not None):
            raise ValueError("ft_restart_policy is ft_launcher's flag: set it with it, only")
        if self.keeps_processes and not self.keeps_pod:
            raise ValueError("a restart that keeps the processes keeps their pod")
        if self.spare_ranks and not self.keeps_processes:
            raise ValueError("reserve ranks join the running processes: keeps_processes")


MODES: dict[RestartMode, ModeSpec] = {
    "none": ModeSpec(
        summary="no resilience (whole-job restart)",
        launcher="torchrun",
        ft_restart_policy=None,
        keeps_processes=False,
        keeps_pod=False,
        keeps_nodes=False,
    ),
    "injob": ModeSpec(
        summary="in-job (ft_launcher)",
        launcher="ft_launcher",
        ft_restart_policy="any-failed",
        keeps_processes=False,
        keeps_pod=True,
        keeps_nodes=True,
    ),
    "inprocess": ModeSpec(
        summary="in-process (NVRx Wrapper)",
        launcher="torchrun",
        ft_restart_policy=None,
        keeps_processes=True,
        keeps_pod=True,
        keeps_nodes=False,
    ),
    # NVRx 0.4.1 examples/fault_tolerance/run_inprocess_injob_example.sh: the in-process
    # Wrapper inside ft_launcher with the min-healthy policy.
    "nested": ModeSpec(
        summary="nested (in-process in in-job)",
        launcher="ft_launcher",
        ft_restart_policy="min-healthy",
        keeps_processes=True,
        keeps_pod=True,
        keeps_nodes=True,
    ),
    # One ft_launcher per group (any-failed inside it); across groups torchft's per-step quorum
    # (docs/replica-groups.md).
    "replica": ModeSpec(
        summary="replica groups (HSDP, torchft across groups)",
        launcher="ft_launcher",
        ft_restart_policy="any-failed",
        keeps_processes=False,
        keeps_pod=True,
        keeps_nodes=True,
        replica_groups=True,
    ),
}

RESILIENT_MODES: tuple[RestartMode, ...] = tuple(m for m, s in MODES.items() if s.keeps_pod)
"""The modes with a restart layer: every mode whose restarts keep the pod."""


def spec(mode: str) -> ModeSpec:
    """The row of ``mode``; a clear error naming the choices for anything else."""
    try:
        return MODES[mode]  # type: ignore[index]
    except KeyError:
        raise ValueError(f"unknown restart mode {mode!r}: use one of {', '.join(MODES)}") from None


class SnapshotSettings(Protocol):
    """The fields of ``training.config.CheckpointConfig`` that decide the snapshots."""

    memory_interval: int
    pod_memory_dir: str
    peer_copy: bool


@dataclass(frozen=True, kw_only=True)
class SnapshotPlan:
    """Where a run keeps its snapshots, and how many nodes' snapshots each node holds."""

    tier: SnapshotTier | None
    """``pod_memory``: the pod's ``/dev/shm`` (every restart that keeps the pod restores it);
    ``memory``: the process's memory (in-process restarts only); None: no snapshots."""
    copies: int
    """Snapshot sets per node: 0 without snapshots, 1 for its own, 2 when it also holds the
    ring neighbour's peer copy (``checkpoint/peer.py``; needs two nodes or more)."""


def snapshot_plan(
    *, checkpoint: SnapshotSettings, restart: str | ModeSpec, nodes: int
) -> SnapshotPlan:
    """The snapshot tier and copies of a run: with ``checkpoint.memory_interval`` on, in the
    pod's memory when the mode's restarts keep the pod and ``pod_memory_dir`` is set, else in
    the process's memory when they keep the processes. Never both: a second copy of the state
    in host memory would restore in-process restarts without a CRC pass over the snapshot, at
    the price of its size in memory and a second copy per interval. ``restart`` is a mode's
    name, or a row (the planner's scenarios that no shipped mode has)."""
    mode = restart if isinstance(restart, ModeSpec) else spec(restart)
    if checkpoint.memory_interval <= 0:
        return SnapshotPlan(tier=None, copies=0)
    if mode.keeps_pod and checkpoint.pod_memory_dir:
        peer = checkpoint.peer_copy and nodes > 1
        return SnapshotPlan(tier="pod_memory", copies=2 if peer else 1)
    if mode.keeps_processes:
        return SnapshotPlan(tier="memory", copies=1)
    return SnapshotPlan(tier=None, copies=0)
