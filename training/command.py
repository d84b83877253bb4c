"""The launcher command line of one node: the single function the local launcher and the EKS Job
(`manifests/render.py`) both call, so every launcher flag comes from the run's `ResilienceConfig`.

- ``none`` / ``inprocess``: ``torchrun`` with static ranks (``--max-restarts=0``); the in-process
  layer restarts inside the processes.
- ``injob``: NVRx's ``ft_launcher`` with ``--ft-restart-policy=any-failed``: a dead or hung rank
  gets the whole worker group respawned.
- ``nested``: ``ft_launcher`` with ``--ft-restart-policy=min-healthy`` running ranks that use the
  in-process layer (NVRx 0.4.1's ``examples/fault_tolerance/run_inprocess_injob_example.sh``).

Torch-free: the manifest renderer imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from training.config import JobConfig, ResilienceConfig
from training.hooks import out_of_section_timeout_s, replica_wait_bound_s, section_timeouts
from training.modes import MODES

COLD_RESTARTS_ENV = "TRAINING_COLD_RESTARTS"
"""Set by the local launcher on a whole-job relaunch (its ``--cold-restarts``): how many came
before, so that the run numbers its attempts on from there (training/run.py)."""

LAUNCHERS = {mode: s.launcher for mode, s in MODES.items()}
"""Each restart mode's launcher (``training.modes.MODES``)."""


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where the launchers of one job meet (torch's c10d rendezvous)."""

    endpoint: str
    """``host:port`` of the rendezvous store."""
    run_id: str
    """Unique per job: a store may serve several jobs, and a closed rendezvous stays closed."""
    external_store: bool = False
    """True: the store runs on its own (EKS: the rendezvous Service), no launcher hosts it, so
    losing any one node (pod 0 included) does not take the rendezvous with it."""
    local_addr: str = ""
    """This node's address as the other nodes reach it (EKS: the pod IP); empty: the hostname."""


def _seconds(value: float) -> str:
    return f"{value:g}"


def launcher_flags(
    *, config: JobConfig, nnodes: int | str, nproc_per_node: int | str, rdzv: Rendezvous
) -> list[str]:
    """The launcher's own flags (everything between its name and ``-m training``)."""
    r = config.resilience
    conf = [f"join_timeout={_seconds(r.join_timeout_s)}"]
    if rdzv.external_store:
        conf.append("is_host=0")
    flags = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv.endpoint}",
        f"--rdzv-id={rdzv.run_id}",
        f"--rdzv-conf={','.join(conf)}",
        f"--monitor-interval={_seconds(r.monitor_interval_s)}",
    ]
    if rdzv.local_addr:
        flags.append(f"--local-addr={rdzv.local_addr}")
    mode = MODES[r.restart]
    if mode.ft_restart_policy is None:
        return [*flags, "--max-restarts=0"]
    sections = ",".join(f"{name}:{_seconds(t)}" for name, t in section_timeouts(r).items())
    if mode.keeps_processes:
        # Nested ranks open no sections (an in-process restart would leave one open), and
        # NVRx's rank monitor applies the out-of-section timeout whenever none is open
        # (rank_monitor_server.py `_is_section_timeout_elapsed`): with one, every healthy rank
        # is killed each time it runs out. Heartbeats are the in-job layer's only signal here,
        # and they pause while the in-process layer recovers (soft timeout, then abort and
        # reload, within its hard timeout): the heartbeat timeout must outlast that, or every
        # hang would become an in-job restart.
        heartbeat_s = max(r.heartbeat_timeout_s, r.soft_timeout_s + r.hard_timeout_s)
        monitor = [f"--ft-rank-heartbeat-timeout={_seconds(heartbeat_s)}"]
    else:
        monitor = [
            f"--ft-rank-heartbeat-timeout={_seconds(r.heartbeat_timeout_s)}",
            f"--ft-rank-section-timeouts={sections}",
            f"--ft-rank-out-of-section-timeout={_seconds(out_of_section_timeout_s(r))}",
        ]
    return [
        *flags,
        # One more than the cap: the ranks enforce `resilience.max_restarts` themselves at the
        # start of an attempt, so the run ends with a cause and an exit code that says why.
        f"--max-restarts={r.max_restarts + 1}",
        f"--ft-restart-policy={mode.ft_restart_policy}",
        f"--ft-initial-rank-heartbeat-timeout={_seconds(r.initial_heartbeat_timeout_s)}",
        *monitor,
        # The rank monitors compare the clock with the timeouts this often (NVRx's default is
        # 5 s, which would add up to 5 s to every detection, and more than the 2 s a calibrated
        # step timeout may be).
        f"--ft-workload-check-interval={_seconds(hang_check_interval_s(r))}",
        f"--workers-stop-timeout={_seconds(r.stop_timeout_s)}",
        f"--term-timeout={_seconds(r.term_timeout_s)}",
    ]


def hang_check_interval_s(resilience: ResilienceConfig) -> float:
    """How often the rank monitors check for a missed heartbeat or an overrun section: a
    quarter of ``hang_floor_s``. A detection comes up to this long after a timeout elapses,
    so the least calibrated step timeout is ``hang_floor_s`` less this
    (:func:`injob_timeout_floor_s`)."""
    return resilience.hang_floor_s / 4


def injob_timeout_floor_s(resilience: ResilienceConfig) -> float:
    """The least step-section timeout in-job calibration sets: a hang at it is detected within
    ``hang_floor_s`` (the timeout, then at most one check interval); in replica groups, not
    below the wait for a failed group (:func:`training.hooks.replica_wait_bound_s`)."""
    return max(
        resilience.hang_floor_s - hang_check_interval_s(resilience),
        replica_wait_bound_s(resilience),
    )


def launcher_command(
    *,
    config: JobConfig,
    trainer_args: Sequence[str],
    nnodes: int | str,
    nproc_per_node: int | str,
    rdzv: Rendezvous,
    launcher_path: str = "",
) -> list[str]:
    """``[launcher, flags..., -m, training, --, train, trainer_args...]`` for one node.

    `trainer_args` must be the arguments `config` was built from (`training.overrides`).
    ``--`` keeps the trainer's flags (``--restart``) away from the launcher's parser, which would
    take it as a prefix of ``--restart-policy``.
    """
    launcher = launcher_path or LAUNCHERS[config.resilience.restart]
    flags = launcher_flags(config=config, nnodes=nnodes, nproc_per_node=nproc_per_node, rdzv=rdzv)
    return [launcher, *flags, "-m", "training", "--", "train", *trainer_args]


def trainer_args_of(command: Sequence[str]) -> list[str]:
    """The trainer's arguments in a command built by `launcher_command`."""
    for i in range(len(command) - 3):
        if list(command[i : i + 4]) == ["-m", "training", "--", "train"]:
            return list(command[i + 4 :])
    raise ValueError("not a trainer launch command: expected '-m training -- train ...'")
