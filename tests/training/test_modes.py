"""training/modes.py: the snapshot tier and copies each mode gets, and a row that contradicts
itself is refused."""

from __future__ import annotations

import pytest

from training.config import CheckpointConfig
from training.modes import MODES, ModeSpec, snapshot_plan

SHM = "/dev/shm/fsdp-snapshots"


@pytest.mark.parametrize(
    ("restart", "memory_interval", "pod_memory_dir", "peer_copy", "nodes", "tier", "copies"),
    [
        ("nested", 10, SHM, True, 2, "pod_memory", 2),  # its own slots + the neighbour's
        ("injob", 10, SHM, True, 1, "pod_memory", 1),  # one node: no ring, no copy
        ("inprocess", 10, SHM, False, 16, "pod_memory", 1),
        ("inprocess", 10, "", False, 1, "memory", 1),  # the process's memory instead
        ("injob", 10, "", False, 1, None, 0),  # new processes: process memory does not survive
        ("none", 10, SHM, False, 1, None, 0),  # a whole-job restart keeps no pod
        ("nested", 0, SHM, False, 2, None, 0),  # snapshots off
    ],
)
def test_snapshot_plan(restart, memory_interval, pod_memory_dir, peer_copy, nodes, tier, copies):
    checkpoint = CheckpointConfig(
        memory_interval=memory_interval, pod_memory_dir=pod_memory_dir, peer_copy=peer_copy
    )
    plan = snapshot_plan(checkpoint=checkpoint, restart=restart, nodes=nodes)
    assert (plan.tier, plan.copies) == (tier, copies)


def test_with_the_default_settings_every_restart_that_keeps_the_pod_uses_pod_memory() -> None:
    """``checkpoint.pod_memory_dir`` is on by default (no recipe or overlay clears it): in-process
    restarts restore the pod's /dev/shm too, not the process's memory."""
    checkpoint = CheckpointConfig(memory_interval=10)
    assert {m: snapshot_plan(checkpoint=checkpoint, restart=m, nodes=2).tier for m in MODES} == {
        "none": None,
        "injob": "pod_memory",
        "inprocess": "pod_memory",
        "nested": "pod_memory",
        "replica": "pod_memory",
    }


def test_a_row_gives_the_plan_of_its_properties() -> None:
    """The planner's own scenarios are rows, not names (planner.tiers.ROWS)."""
    row = ModeSpec(
        summary="x",
        launcher="torchrun",
        ft_restart_policy=None,
        keeps_processes=True,
        keeps_pod=True,
        keeps_nodes=False,
    )
    shm, no_shm = (
        CheckpointConfig(memory_interval=5),
        CheckpointConfig(memory_interval=5, pod_memory_dir=""),
    )
    assert snapshot_plan(checkpoint=shm, restart=row, nodes=4).tier == "pod_memory"
    assert snapshot_plan(checkpoint=no_shm, restart=row, nodes=4).tier == "memory"


def test_an_unknown_mode_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown restart mode 'always': use one of none, injob"):
        snapshot_plan(checkpoint=CheckpointConfig(), restart="always", nodes=1)


def test_a_row_that_contradicts_itself_is_refused() -> None:
    row = dict(summary="x", keeps_processes=False, keeps_pod=True, keeps_nodes=True)
    with pytest.raises(ValueError, match="ft_restart_policy"):
        ModeSpec(launcher="torchrun", ft_restart_policy="any-failed", **row)
    with pytest.raises(ValueError, match="ft_restart_policy"):
        ModeSpec(launcher="ft_launcher", ft_restart_policy=None, **row)
    with pytest.raises(ValueError, match="reserve ranks"):
        ModeSpec(launcher="torchrun", ft_restart_policy=None, spare_ranks=True, **row)
    with pytest.raises(ValueError, match="keeps their pod"):
        ModeSpec(
            summary="x",
            launcher="torchrun",
            ft_restart_policy=None,
            keeps_processes=True,
            keeps_pod=False,
            keeps_nodes=False,
        )
