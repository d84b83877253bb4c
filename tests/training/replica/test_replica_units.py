"""The replica mode's pieces that need no running job: its row, its settings, its topology,
its per-group launch and its data shares; bad input gets one clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO_ROOT, subprocess_env

from training import exits
from training.command import Rendezvous, injob_timeout_floor_s, launcher_command
from training.config import CheckpointConfig
from training.exits import ConfigError
from training.hooks import STEP, section_timeouts
from training.modes import MODES, snapshot_plan, spec
from training.overrides import build_config
from training.replica.launch import group_args, group_dir, group_launches
from training.replica.topology import (
    GROUP_ENV,
    LIGHTHOUSE_ENV,
    ReplicaTopology,
    group_sizes,
    lighthouse_command,
)


def test_replica_is_one_row_restarted_per_group_by_ft_launcher() -> None:
    row = spec("replica")
    assert row.replica_groups and row.launcher == "ft_launcher"
    assert row.ft_restart_policy == "any-failed"  # the failed group's workers, all of them
    assert [m for m, r in MODES.items() if r.replica_groups] == ["replica"]
    # A group restart keeps its pod: its snapshots in /dev/shm restore it when no group is left
    # to heal from.
    plan = snapshot_plan(
        checkpoint=CheckpointConfig(memory_interval=10), restart="replica", nodes=1
    )
    assert plan.tier == "pod_memory"


def test_the_settings_come_from_the_command_line_and_bad_ones_name_the_field() -> None:
    config, _ = build_config(["--restart=replica", "--resilience.replica_groups=4"])
    assert config.resilience.restart == "replica"
    assert config.resilience.replica_groups == 4
    with pytest.raises(ConfigError, match=r"resilience\.replica_groups"):
        build_config(["--resilience.replica_groups=0"])
    with pytest.raises(ConfigError, match=r"resilience\.replica_wait_s"):
        build_config(["--resilience.replica_wait_s=0"])


def test_topology_comes_from_the_replica_launchers_environment() -> None:
    env = {GROUP_ENV: "1", LIGHTHOUSE_ENV: "http://127.0.0.1:29510"}
    topology = ReplicaTopology.from_environment(groups=2, env=env)
    assert (topology.group, topology.groups) == (1, 2)
    with pytest.raises(ConfigError, match=f"{GROUP_ENV} and {LIGHTHOUSE_ENV}.*replica launcher"):
        ReplicaTopology.from_environment(groups=2, env={})
    with pytest.raises(ConfigError, match=r"resilience\.replica_groups"):
        ReplicaTopology.from_environment(groups=1, env=env)


def test_ranks_split_into_equal_groups_or_the_launch_is_refused() -> None:
    assert group_sizes(world_size=4, groups=2) == 2
    with pytest.raises(ConfigError, match="4 ranks do not split into 3"):
        group_sizes(world_size=4, groups=3)
    proc = subprocess.run(
        [sys.executable, "-m", "training.launch.local", "--nproc=3", "--restart=replica"],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == exits.USAGE
    assert "resilience.replica_groups: 3 ranks do not split into 2" in proc.stderr


def test_the_lighthouse_waits_for_every_group() -> None:
    command = lighthouse_command(groups=3, port=29510)
    assert command[0] == "torchft_lighthouse"
    assert "--min_replicas=3" in command and "--bind=[::]:29510" in command


def test_each_group_runs_the_in_job_launch_in_its_own_run_directory() -> None:
    train_args = ["--restart=replica", "--run-dir=runs/r", "--checkpoint.dir=/ckpt"]
    config, _ = build_config(train_args)
    launches = group_launches(
        config=config,
        train_args=train_args,
        nproc=4,
        lighthouse="http://127.0.0.1:1",
        command_of=lambda args, n, g: launcher_command(
            config=build_config(args)[0],
            trainer_args=args,
            nnodes=1,
            nproc_per_node=n,
            rdzv=Rendezvous(endpoint=f"127.0.0.1:{100 + g}", run_id=f"g{g}"),
        ),
        env={},
    )
    assert [launch.env[GROUP_ENV] for launch in launches] == ["0", "1"]
    assert all(launch.env[LIGHTHOUSE_ENV] == "http://127.0.0.1:1" for launch in launches)
    for launch in launches:
        assert launch.command[0] == "ft_launcher"
        assert "--nproc-per-node=2" in launch.command
        assert "--ft-restart-policy=any-failed" in launch.command
        group_config, _ = build_config(
            group_args(config=config, train_args=train_args, group=launch.group)
        )
        assert group_config.run_dir == str(group_dir("runs/r", launch.group))
        assert group_config.checkpoint_dir == f"/ckpt/group-{launch.group}"


def test_each_group_reads_its_own_share_of_every_global_batch() -> None:
    """The groups' samples of one step are disjoint and together the global batch of a plain
    data-parallel run of the same size (``replica_layout``)."""
    from training.data import BatchLayout, ResumableSampler
    from training.replica.trainer import replica_layout

    def step_samples(layout: BatchLayout) -> list[int]:
        sampler = ResumableSampler(num_samples=1000, layout=layout, seed=3, shuffle=True)
        return [i for micro in sampler.next_step() for i in micro]

    shares = {
        (g, r): step_samples(
            replica_layout(
                topology=ReplicaTopology(group=g, groups=2, lighthouse=""),
                group_size=2,
                rank=r,
                micro_batch_size=3,
                grad_accum_steps=2,
            )
        )
        for g in range(2)
        for r in range(2)
    }
    plain = [
        step_samples(BatchLayout(world_size=4, rank=k, micro_batch_size=3, grad_accum_steps=2))
        for k in range(4)
    ]
    assert [shares[(g, r)] for g in range(2) for r in range(2)] == plain
    group0 = set(shares[(0, 0)] + shares[(0, 1)])
    group1 = set(shares[(1, 0)] + shares[(1, 1)])
    assert not group0 & group1 and len(group0 | group1) == 24


def test_no_step_timeout_kills_a_survivor_while_it_waits_for_a_failed_group() -> None:
    """A surviving group redoes a discarded step inside the rank monitor's step section, waiting
    up to replica_wait_s at the quorum and replica_timeout_s in torchft: neither the configured
    step timeout (the launcher's flag) nor the calibrated one (its floor) may be shorter."""
    config, _ = build_config(
        [
            "--restart=replica",
            "--resilience.step_section_timeout_s=60",
            "--resilience.calibrate_timeouts_after=50",
            "--resilience.replica_wait_s=240",
            "--resilience.replica_timeout_s=30",
        ]
    )
    r = config.resilience
    assert section_timeouts(r)[STEP] >= 270
    assert injob_timeout_floor_s(r) >= 270
    # Outside replica groups both stay as configured.
    plain, _ = build_config(["--restart=injob", "--resilience.step_section_timeout_s=60"])
    assert section_timeouts(plain.resilience)[STEP] == 60
    assert injob_timeout_floor_s(plain.resilience) < plain.resilience.hang_floor_s
