"""Every metric the run exporter serves: name, type, labels and meaning, in one place.

The exporter builds its families from this table, the alert rules and the dashboard name only
metrics listed here or in the DCGM exporter's field list (``observability/dcgm-counters.csv``),
and tests check both. Names follow Prometheus' conventions: base units (seconds, bytes, ratios
0-1), ``_total`` on counters, ``_seconds`` / ``_bytes`` / ``_ratio`` as the unit suffix.

Labels: ``training_job`` (the Kubernetes Job's name, or the local run directory's name) on every
series; ``node`` (a node index) on the per-node ones; ``layer`` (the restart layer: inprocess,
injob, cold) and ``cause`` on restarts; ``cause`` on faults; ``replica_group`` (the group's
index) on the replica groups' (``restart=replica``). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from training.runlog.files import STRAGGLER_REPORT_EVENT

METRICS_PORT = 9464
"""The exporter's TCP port in a trainer pod (the container port named ``METRICS_PORT_NAME``)."""
METRICS_PORT_NAME = "metrics"
"""The trainer container's port name: the scraper keeps pod targets on a port of this name."""

SCRAPE_INTERVAL_S = 30
"""How often the stack's scraper reads each exporter (``observability/scrape.yaml`` says the
same; tests/observability checks that they agree)."""

JOB_LABEL = "training_job"
NODE_LABEL = "node"
REPLICA_GROUP_LABEL = "replica_group"


@dataclass(frozen=True, kw_only=True)
class Metric:
    """One metric family."""

    name: str
    type: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...] = ()
    """Labels besides ``training_job``."""
    scope: Literal["job", "node"] = "job"
    """``job``: served by the job's reporting exporter only (node 0, or the local run), so a
    query never sees one figure twice; ``node``: served by every pod's exporter for its node."""


_JOB_METRICS: tuple[Metric, ...] = (
    Metric(
        name="training_info",
        type="gauge",
        help="1, with the run's recipe, restart mode and world size as labels (from the run's "
        "start on).",
        labels=("recipe", "restart_mode", "world_size"),
    ),
    Metric(
        name="training_run_active",
        type="gauge",
        help="1 while the run is going (started, no run_end since), else 0.",
    ),
    Metric(
        name="training_steps_total",
        type="counter",
        help="Optimizer steps completed, steps repeated after a restart included.",
    ),
    Metric(name="training_step", type="gauge", help="The highest step number completed."),
    Metric(
        name="training_last_step_timestamp_seconds",
        type="gauge",
        help="Unix time at which the newest step completed.",
    ),
    Metric(
        name="training_last_progress_timestamp_seconds",
        type="gauge",
        help="Unix time of the run's newest progress: a step completed, the run started, or "
        "an attempt started (its process group up); the stall alert counts from here.",
    ),
    Metric(
        name="training_step_duration_seconds",
        type="gauge",
        help="Duration of the newest step.",
    ),
    Metric(
        name="training_step_duration_calibrated_seconds",
        type="gauge",
        help="The run's calibrated step time: the median of the current attempt's last 50 steps.",
    ),
    Metric(
        name="training_stall_threshold_seconds",
        type="gauge",
        help="How long without a step counts as a stall: max(observe.stall_floor_s, "
        "observe.stall_factor x the calibrated step time).",
    ),
    Metric(name="training_tokens_total", type="counter", help="Tokens trained on (all ranks)."),
    Metric(
        name="training_tokens_per_second",
        type="gauge",
        help="Throughput of the newest step (tokens per second, all ranks).",
    ),
    Metric(
        name="training_mfu_ratio",
        type="gauge",
        help="Model FLOPs utilisation of the newest step (0-1); absent where the peak FLOP/s "
        "of the device is unknown (CPU).",
    ),
    Metric(name="training_loss", type="gauge", help="Training loss of the newest step."),
    Metric(
        name="training_attempt",
        type="gauge",
        help="Attempt of the newest step: 0, then +1 per restart of any layer.",
    ),
    Metric(
        name="training_ettr_ratio",
        type="gauge",
        help="Effective training time ratio so far: productive step time / wall time (0-1).",
    ),
    Metric(
        name="training_restarts_total",
        type="counter",
        help="Restarts, by restart layer and cause (the fault kind, 'hang', the exception's "
        "type, or 'unknown').",
        labels=("layer", "cause"),
    ),
    Metric(
        name="training_restart_lost_seconds_total",
        type="counter",
        help="Time lost to restarts (downtime plus recomputed steps), by restart layer.",
        labels=("layer",),
    ),
    Metric(
        name="training_checkpoints_committed_total",
        type="counter",
        help="Checkpoints committed to shared storage: those this run's events name, and "
        "those it restored from.",
    ),
    Metric(
        name="training_checkpoint_last_commit_step",
        type="gauge",
        help="Step of the newest checkpoint on shared storage: committed by this run, or "
        "restored from (0 before either).",
    ),
    Metric(
        name="training_checkpoint_last_commit_timestamp_seconds",
        type="gauge",
        help="Unix time of the newest checkpoint commit.",
    ),
    Metric(
        name="training_checkpoint_interval_steps",
        type="gauge",
        help="checkpoint.interval: steps between shared checkpoints; absent when only the final "
        "one is saved.",
    ),
    Metric(
        name="training_checkpoint_save_blocking_seconds",
        type="gauge",
        help="The newest shared checkpoint's training stall (the slowest rank's staging).",
    ),
    Metric(
        name="training_checkpoint_commit_seconds",
        type="gauge",
        help="The newest checkpoint's time from save start to commit.",
    ),
    Metric(
        name="training_checkpoint_restore_seconds",
        type="gauge",
        help="The newest restore's duration (the slowest rank), by source (memory, pod_memory, "
        "peer, local, storage).",
        labels=("source",),
    ),
    Metric(
        name="training_checkpoint_restores_total",
        type="counter",
        help="Restores of the training state, by source (memory, pod_memory, peer, local, "
        "storage).",
        labels=("source",),
    ),
)

_G = (REPLICA_GROUP_LABEL,)
_REPLICA_METRICS: tuple[Metric, ...] = (
    # restart=replica, from each group's events (training/runlog/replica.py); the job's
    # reporting exporter of each group serves its group's, labelled with the group.
    Metric(
        name="training_replica_groups",
        type="gauge",
        help="Replica groups the job has (resilience.replica_groups).",
        labels=_G,
    ),
    Metric(
        name="training_replica_quorum_participants",
        type="gauge",
        help="Groups in the group's newest quorum (waiting semantics: every group, or none forms).",
        labels=_G,
    ),
    Metric(
        name="training_replica_quorum_changes_total",
        type="counter",
        help="Quorums whose members changed, or that ended a wait for a group that was out.",
        labels=_G,
    ),
    Metric(
        name="training_replica_waiting",
        type="gauge",
        help="1 while the group's ranks wait at a quorum for a group that is out, else 0.",
        labels=_G,
    ),
    Metric(
        name="training_replica_waiting_since_timestamp_seconds",
        type="gauge",
        help="Unix time the group's ranks began waiting for a group that is out; absent while "
        "no group is out (the ReplicaGroupOut alert counts from here).",
        labels=_G,
    ),
    Metric(
        name="training_replica_steps_discarded_total",
        type="counter",
        help="Steps the group discarded because a cross-group collective failed (redone).",
        labels=_G,
    ),
    Metric(
        name="training_replica_stalls_total",
        type="counter",
        help="Failures of another group this group waited for (one stall each).",
        labels=_G,
    ),
    Metric(
        name="training_replica_stall_seconds_total",
        type="counter",
        help="Seconds this group went without a step waiting for failed groups (the slowest "
        "rank's, summed over stalls).",
        labels=_G,
    ),
    Metric(
        name="training_replica_stall_seconds",
        type="gauge",
        help="The newest survivor's stall: seconds without a step for one failure.",
        labels=_G,
    ),
    Metric(
        name="training_replica_heals_total",
        type="counter",
        help="Times this group healed from a live peer group (instead of storage).",
        labels=_G,
    ),
    Metric(
        name="training_replica_heal_seconds",
        type="gauge",
        help="The newest heal's quorum-and-transfer time (the slowest rank).",
        labels=_G,
    ),
    Metric(
        name="training_replica_heal_bytes_total",
        type="counter",
        help="Bytes this group's ranks received from peer groups when healing.",
        labels=_G,
    ),
)

_NODE_METRICS: tuple[Metric, ...] = (
    Metric(
        name="training_faults_total",
        type="counter",
        help="Faults seen by this node's ranks, by cause (the injected fault's kind, or 'hang' "
        "for a hang the in-process watchdog detected).",
        labels=("node", "cause"),
        scope="node",
    ),
    Metric(
        name="training_straggler_score",
        type="gauge",
        help="A rank's newest straggler score (its performance relative to the fastest rank: "
        "1 is as fast, lower is slower).",
        labels=("node", "rank"),
        scope="node",
    ),
    Metric(
        name="training_straggler_flagged",
        type="gauge",
        help="1 when the straggler detector flags the rank as a straggler, else 0.",
        labels=("node", "rank"),
        scope="node",
    ),
    Metric(
        name="efa_transmitted_bytes_total",
        type="counter",
        help="Bytes sent by an EFA device of this node (sysfs hw_counters tx_bytes).",
        labels=("node", "device"),
        scope="node",
    ),
    Metric(
        name="efa_received_bytes_total",
        type="counter",
        help="Bytes received by an EFA device of this node (sysfs hw_counters rx_bytes).",
        labels=("node", "device"),
        scope="node",
    ),
    Metric(
        name="efa_rdma_read_bytes_total",
        type="counter",
        help="Bytes read by RDMA through an EFA device (sysfs hw_counters rdma_read_bytes).",
        labels=("node", "device"),
        scope="node",
    ),
    Metric(
        name="efa_rdma_write_bytes_total",
        type="counter",
        help="Bytes written by RDMA through an EFA device (sysfs hw_counters rdma_write_bytes).",
        labels=("node", "device"),
        scope="node",
    ),
)

METRICS: dict[str, Metric] = {m.name: m for m in (*_JOB_METRICS, *_REPLICA_METRICS, *_NODE_METRICS)}

STRAGGLER_EVENT = STRAGGLER_REPORT_EVENT
"""The straggler detector's report (its shape: ``training.runlog.files.STRAGGLER_REPORT_EVENT``):
the exporter serves the newest score of each of its node's ranks, flagged when below the
report's threshold."""
