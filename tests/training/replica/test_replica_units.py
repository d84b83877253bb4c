"""The replica mode's pieces that need no running job: its row, its settings, its topology,
its per-group launch and its data shares; bad input gets one clear error."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT, subprocess_env

from training import exits
from training.command import Rendezvous, injob_timeout_floor_s, launcher_command
from training.config import CheckpointConfig, ResilienceConfig
from training.exits import ConfigError
from training.hooks import STEP, section_timeouts
from training.modes import MODES, snapshot_plan, spec
from training.overrides import build_config
from training.replica.launch import (
    group_args,
    group_dir,
    group_launches,
    start_lighthouse,
    stop,
)
from training.replica.topology import (
    GROUP_ENV,
    LIGHTHOUSE_BIN,
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


def test_the_lighthouse_command_takes_the_fewest_groups_and_fast_failure_detection() -> None:
    command = lighthouse_command(min_replicas=3, port=29510)
    assert command[0] == "torchft_lighthouse"
    assert "--min_replicas=3" in command and "--bind=[::]:29510" in command
    assert "--heartbeat_timeout_ms=2000" in command and "--join_timeout_ms=1000" in command


@pytest.mark.parametrize(("semantics", "expected"), [("wait", 3), ("shrink", 1)])
def test_one_setting_gives_the_fewest_groups_everywhere(semantics: str, expected: int) -> None:
    """``resilience.replica_semantics`` is the one owner: the trainer's Manager
    (``replica_min_groups``), the local launcher's and the EKS Lighthouse's --min_replicas."""
    from manifests.replica import jobset_objects

    args = [
        "--restart=replica",
        "--resilience.replica_groups=3",
        f"--resilience.replica_semantics={semantics}",
    ]
    config, _ = build_config(args)
    assert ResilienceConfig().replica_semantics == "shrink"  # the default (docs: which default)
    assert config.resilience.replica_semantics == semantics
    assert config.resilience.replica_min_groups == expected
    objects = jobset_objects(overlay="2node", namespace="t", image="i:1", train_args=args[1:])
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert f"--min_replicas={expected}" in container["command"]
    (jobset,) = [o for o in objects if o["kind"] == "JobSet"]
    (group,) = jobset["spec"]["replicatedJobs"]
    pod = group["template"]["spec"]["template"]["spec"]
    assert any(
        f"--resilience.replica_semantics={semantics}" in " ".join(c.get("args", []))
        for c in pod["containers"]
    )


def test_a_bad_semantics_is_refused_with_the_field_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"resilience\.replica_semantics.*wait.*shrink"):
        build_config(["--resilience.replica_semantics=fast"])
    with pytest.raises(ConfigError, match=r"resilience\.replica_semantics.*--resilience"):
        ResilienceConfig(replica_semantics="fast")  # type: ignore[arg-type]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.launch.local",
            "--nproc=4",
            "--restart=replica",
            "--resilience.replica_semantics=fast",
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,  # the launcher imports torch: tens of seconds on a loaded machine
    )
    assert proc.returncode == exits.USAGE, proc.stderr
    assert "resilience.replica_semantics: must be one of wait, shrink" in proc.stderr


def test_skipped_samples_are_summed_and_listed_per_missing_group() -> None:
    from training.runlog.replica import summarize_replica

    def skipped(step: int, rank: int, indices: list[int]) -> dict:
        return {
            "kind": "replica_samples_skipped",
            "time": 100.0 + step,
            "step": step,
            "rank": rank,
            "group": 0,
            "missing_group": 1,
            "position": 8 * (step - 1),
            "samples": len(indices),
            "indices": indices,
        }

    summary = summarize_replica(
        [skipped(5, 0, [1, 2]), skipped(5, 1, [3, 4]), skipped(6, 0, [5, 6]), skipped(6, 1, [7, 8])]
    )
    assert summary is not None
    assert summary.samples_skipped == 8
    assert summary.steps_skipped == ((1, 5), (1, 6))


def test_skipped_samples_are_named_by_epoch_and_index_across_an_epoch_end() -> None:
    """A group out for longer than an epoch's rest: its skipped indices repeat in the next
    epoch's permutation (CI: 1728 skipped, 1411 distinct indices), the (epoch, index) pairs do
    not, and each epoch's pairs are that epoch's samples of the missing group's share."""
    from training.data import ResumableSampler
    from training.replica.topology import ReplicaTopology
    from training.replica.trainer import replica_layout, samples_at

    def sampler(group: int, rank: int) -> ResumableSampler:
        layout = replica_layout(
            topology=ReplicaTopology(group=group, groups=2, lighthouse="x:1"),
            group_size=2,
            rank=rank,
            micro_batch_size=2,
            grad_accum_steps=2,
        )
        return ResumableSampler(num_samples=50, layout=layout, seed=7, shuffle=True)

    missing = [sampler(1, 0), sampler(1, 1)]
    per_step = missing[0].layout.global_batch  # 16; an epoch is 48 of 50 samples: 3 steps
    seen = [samples_at(sampler=s, position=step * per_step) for step in range(6) for s in missing]
    indices = [i for _, idx in seen for i in idx]
    pairs = [(epoch, i) for epoch, idx in seen for i in idx]
    assert len(set(indices)) < len(indices), "6 steps of 3-step epochs must repeat indices"
    assert len(set(pairs)) == len(pairs) == 6 * 2 * 4
    assert {epoch for epoch, _ in seen} == {0, 1}
    # Each epoch's half: group 1's share, disjoint from group 0's at the same positions.
    present = [sampler(0, 0), sampler(0, 1)]
    for step in range(6):
        ours = {i for s in present for i in samples_at(sampler=s, position=step * per_step)[1]}
        theirs = {i for s in missing for i in samples_at(sampler=s, position=step * per_step)[1]}
        assert not ours & theirs


def test_replica_ids_name_their_group() -> None:
    from training.replica.trainer import group_of

    assert group_of("group1:6f1c-uuid") == 1
    assert group_of("group12:x") == 12
    assert group_of("0b7e-uuid") is None


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


@pytest.mark.timeout(150)
def test_the_lighthouse_output_is_never_an_undrained_pipe(tmp_path: Path) -> None:
    """The Lighthouse logs every quorum tick; a pipe nobody reads fills (64 KiB) and then
    blocks it, so that no quorum forms any more: what the bench's 4-rank replica run met ~35
    steps in, and the shrink test ~30 steps in. Its output goes to a file of the run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_path = shutil.which(LIGHTHOUSE_BIN, path=str(Path(sys.executable).parent))
    assert bin_path, LIGHTHOUSE_BIN
    log_path = tmp_path / "run" / "lighthouse.log"
    process = start_lighthouse(min_replicas=2, port=port, bin_path=bin_path, log_path=log_path)
    try:
        assert process.stdout is None and process.stderr is None
        assert log_path.exists()
    finally:
        stop(process)


def test_no_out_of_section_timeout_kills_a_survivor_waiting_at_the_quorum() -> None:
    """The quorum at the top of a step (``Trainer.begin_step``) is outside every rank-monitor
    section, where NVRx applies the out-of-section timeout: a survivor waiting there for a
    failed group (up to replica_wait_s, then torchft's timeout) must not be killed as hung. The
    launcher's flag, the one the pod runs, says so; outside replica groups it stays as set."""

    def out_of_section(args: list[str]) -> float:
        config, _ = build_config(args)
        command = launcher_command(
            config=config,
            trainer_args=args,
            nnodes=1,
            nproc_per_node=2,
            rdzv=Rendezvous(endpoint="127.0.0.1:1", run_id="r"),
        )
        (flag,) = [a for a in command if a.startswith("--ft-rank-out-of-section-timeout=")]
        return float(flag.split("=", 1)[1])

    replica = [
        "--restart=replica",
        "--resilience.checkpoint_section_timeout_s=300",
        "--resilience.replica_wait_s=600",
        "--resilience.replica_timeout_s=30",
    ]
    assert out_of_section(replica) >= 630
    assert (
        out_of_section(["--restart=injob", "--resilience.checkpoint_section_timeout_s=300"]) == 300
    )
