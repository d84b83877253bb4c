"""The cost model: what a checkpoint and each kind of recovery cost at N GPUs.

Every default is a :class:`Param` naming its source (``planner.sources``); ``estimate=True``
marks a number no publication gave us. ``--set NAME=VALUE`` overrides any of them. Terms that
grow with the job are computed from these parameters by the functions below:

- detection: a timeout (hangs, lost nodes) or an exit/exception seen at once;
- in-process restart overhead (NVRx's table), its TCPStore barrier (linear in ranks);
- rendezvous / TCPStore start-up of new processes (linear in ranks, 100 s at 98,304);
- NCCL communicator initialisation (linear in ranks from 265 s at 96k: the paper says it grows
  super-linearly, so below 96k linear scaling over-estimates it, which we prefer to hiding it);
- checkpoint load = checkpoint bytes / FSx throughput;
- checkpoint stall = device-to-host copy of each GPU's shard + a fixed save overhead; the FSx
  write of the whole checkpoint must fit in the interval (see planner.plan);
- pod replacement (whole-job restart: every pod; scheduling rate-limited) and node replacement
  (EKS auto-repair wait + new instance + image pull), or a hot spare (a waiting node, image
  already pulled).

Recovery paths per mode (``recovery``):

- ``none`` (no resilience): every failure restarts the whole job: pods torn down and recreated.
- ``injob`` (ft_launcher): new worker processes in the same pods; a lost node first needs a
  replacement node (or spare) and its pod.
- ``inprocess`` (NVRx Wrapper): restart inside the live processes; a lost node cannot be
  recovered in place (the trainer will not shrink the world), so it falls back to ``none``.
- ``nested`` (in-process inside in-job): in-place faults take the in-process path, a lost node
  the in-job path.
- a host fault (the node stops answering) waits for the node fencer (infra/fencer: its wait,
  EC2's termination, PodGC) instead of the 10-min GPU repair; a manual intervention waits
  ``manual_intervention_s`` then restarts the job.

Modes beyond the four priced in full, modelled to show what would close the gap at 100k GPUs
(``reserve`` is NOT SHIPPED; ``replica`` ships as ``--restart replica``):

- ``reserve``: NVRx in-process restart with reserve ranks on the hot spares: a lost node's ranks
  are replaced inside the running job (in-process path) while a spare is free; else as
  ``inprocess``.
- ``replica``: replica groups (``replica_recovery``): the failed group restarts alone (its own
  ``ft_launcher``, rendezvous and NCCL at the group's size) and heals from a live peer group
  instead of a checkpoint: no global NCCL re-initialisation, no rollback. In the shrinking
  semantics (the default) the other groups go on once they see the failure and the job pays the
  group's share; in the waiting semantics they wait for it, so the whole job pays the group's
  recovery.

NCCL start-up and rendezvous are ranges: the published figures (high) and a labelled low end
for lazy or scalable initialisation (``low_startup``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from facts import hardware, prices
from infra.fencer.settings import FENCER, KUBE
from planner import tiers
from planner.failures import Outcome
from training.config import ResilienceConfig
from training.modes import MODES as PRODUCT_MODES
from training.resilience.nvrx import (
    LAST_CALL_WAIT_S,
    MONITOR_PROCESS_INTERVAL_S,
    wrapper_heartbeat_timeout_s,
)

# The trainer's own settings (their owners: training/config.py, training/resilience/nvrx.py).
_RESILIENCE = ResilienceConfig()

REPLICA_REJOIN_S = 0.35
"""Seconds from the failed group's restored workers (its ``checkpoint_loaded``) to the
survivors' next committed step, in the fault test's recorded run
(tests/training/replica/recorded/sigkill-group1: the quorum, the heal of 0.8 MB per rank in
0.17 s, the redone step of the tiny model; planner.measured.replica_rejoin_s recomputes it from
that run, a test checks). Emulation: CPU ranks, gloo, one machine."""
REPLICA_QUORUM_S = 0.8
"""The survivors' stall per crash in the shrinking semantics: p50 of the two runs of
tests/training/replica/test_replica_shrink.py on 2026-12-07 (1.1 s and 0.5 s: the discarded
step to the quorum without the failed group; docs/replica-groups.md). Emulation: CPU ranks,
gloo, one machine; the Lighthouse's heartbeat timeout (2 s, training/replica/topology.py) is
the same text a cluster runs."""
REPLICA_SEMANTICS: tuple[str, ...] = ("wait", "shrink")
"""``wait``: the survivors wait for the failed group and redo the step; ``shrink``: they go on
without it (docs/replica-groups.md). Both ship; the default is the trainer's
(``REPLICA_DEFAULT``)."""
REPLICA_DEFAULT = _RESILIENCE.replica_semantics
"""The semantics ``--restart replica`` runs unless told (training/config.py: one owner)."""

MODES: tuple[str, ...] = tuple(m for m in PRODUCT_MODES if m in tiers.ROWS)
"""The restart modes this project ships (training/modes.py) that the tier model evaluates
(replica groups have their own row, ``replica_recovery``: ``tiers.ROWS``)."""
NOT_SHIPPED: tuple[str, ...] = ("reserve",)
"""Modes users would buy next, modelled to show what would close the gap; not in the product."""
MODE_LABELS: dict[str, str] = {
    **{mode: spec.summary for mode, spec in tiers.ROWS.items()},
    "replica": f"replica groups (HSDP, torchft across groups), {REPLICA_DEFAULT} semantics "
    "(the default): a failed group restarts alone and heals from a peer"
    + (" while the others go on" if REPLICA_DEFAULT == "shrink" else " while the others wait"),
}
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Param:
    """One default of the cost model."""

    value: float
    """The default value (unit in ``unit``)."""
    unit: str
    """s, GB/s, pods/s or ranks."""
    source: str
    """Key into planner.sources.SOURCES."""
    estimate: bool = False
    """True when no published number backs the value."""
    help: str = ""
    """What the parameter is."""


DEFAULTS: dict[str, Param] = {
    # --- detection ---------------------------------------------------------------------------
    "detect_exception_inprocess_s": Param(
        value=LAST_CALL_WAIT_S,
        unit="s",
        source="project-wrapper",
        help="in-process: a rank raises; the peers abort after last_call_wait",
    ),
    "detect_hang_inprocess_s": Param(
        value=_RESILIENCE.soft_timeout_s + MONITOR_PROCESS_INTERVAL_S,
        unit="s",
        source="project-wrapper",
        help="in-process: a hang; soft_timeout + monitor_process_interval (its check period)",
    ),
    "detect_lost_rank_inprocess_s": Param(
        value=wrapper_heartbeat_timeout_s(_RESILIENCE.soft_timeout_s),
        unit="s",
        source="project-wrapper",
        help="in-process: a rank (node) vanished; the Wrapper's heartbeat_timeout",
    ),
    "detect_exit_injob_s": Param(
        value=1.0,
        unit="s",
        source="estimate",
        estimate=True,
        help="in-job: a worker exits; ft_launcher notices on its next monitor pass",
    ),
    "detect_hang_injob_s": Param(
        value=30.0,
        unit="s",
        source="project",
        help="in-job: a hang or lost node; rank heartbeat timeout",
    ),
    "detect_exit_none_s": Param(
        value=10.0,
        unit="s",
        source="estimate",
        estimate=True,
        help="no resilience: a rank exits; pod fails and the Job is torn down",
    ),
    "detect_hang_none_s": Param(
        value=600.0,
        unit="s",
        source="project",
        help="no resilience: a hang or lost node; the process-group (NCCL) timeout",
    ),
    # --- restart work ------------------------------------------------------------------------
    "inprocess_abort_s": Param(
        value=1.0,
        unit="s",
        source="nvrx-latency",
        help="in-process: destroy_process_group 0.5 s + rank_assignment 0.5 s (+ 1 step, added)",
    ),
    "inprocess_barrier_s_at_16k": Param(
        value=0.5,
        unit="s",
        source="nvrx-latency",
        help="in-process: TCPStore barrier at 16,384 ranks (scaled linearly with ranks)",
    ),
    "worker_stop_s": Param(
        value=5.0,
        unit="s",
        source="estimate",
        estimate=True,
        help="in-job: stopping the surviving workers (bounded by stop_timeout_s = 10 s here)",
    ),
    "worker_start_s": Param(
        value=30.0,
        unit="s",
        source="estimate",
        estimate=True,
        help="new worker processes: Python + torch import, CUDA context, checkpoint worker",
    ),
    "rendezvous_s_at_98k": Param(
        value=100.0,
        unit="s",
        source="tcpstore",
        help="TCPStore start-up for new processes at 98,304 ranks (scaled linearly)",
    ),
    "nccl_init_s_at_96k": Param(
        value=265.0,
        unit="s",
        source="ncclx",
        help="NCCL communicator initialisation at 98,304 ranks (scaled linearly)",
    ),
    "pod_teardown_s": Param(
        value=30.0,
        unit="s",
        source="k8s-grace",
        help="whole-job restart: old pods terminate (grace period)",
    ),
    "pod_start_s": Param(
        value=5.0,
        unit="s",
        source="k8s-slo",
        help="a pod's start-up with its image already on the node",
    ),
    "pod_schedule_rate": Param(
        value=100.0,
        unit="pods/s",
        source="estimate",
        estimate=True,
        help="whole-job restart: pods the Job controller + scheduler create per second",
    ),
    "node_repair_wait_s": Param(
        value=600.0,
        unit="s",
        source="eks-repair",
        help="EKS node auto-repair waits this long before replacing a GPU node",
    ),
    "node_boot_s": Param(
        value=300.0,
        unit="s",
        source="estimate",
        estimate=True,
        help="terminate the bad instance, launch a p5, boot, join the cluster",
    ),
    "image_pull_s": Param(
        value=300.0,
        unit="s",
        source="soci",
        help="pull the training image on a new node (15-20 GB: 4-6 min)",
    ),
    "fence_wait_s": Param(
        value=FENCER.wait_s,
        unit="s",
        source="fencer",
        help="the node fencer terminates a node whose Ready stayed Unknown this long",
    ),
    "fence_poll_s": Param(
        value=FENCER.poll_s,
        unit="s",
        source="fencer",
        help="the node fencer's pass over the Nodes: a silent node waits up to one more",
    ),
    "podgc_loop_s": Param(
        value=KUBE.podgc_loop_s,
        unit="s",
        source="k8s-podgc",
        help="PodGC fails a fenced node's pods at its next loop (out-of-service taint: no "
        "quarantine)",
    ),
    "node_monitor_grace_s": Param(
        value=KUBE.node_monitor_grace_s,
        unit="s",
        source="k8s-node-lifecycle",
        help="a silent node's Ready condition turns Unknown after the node-monitor grace period",
    ),
    "instance_terminate_s": Param(
        value=FENCER.terminate_s,
        unit="s",
        source="estimate",
        estimate=True,
        help="EC2 reports the fenced (hung) instance terminated (TerminateInstances with "
        "SkipOsShutdown: no graceful OS shutdown to wait for)",
    ),
    "manual_intervention_s": Param(
        value=7200.0,
        unit="s",
        source="estimate",
        estimate=True,
        help="a failure automation cannot handle: a person diagnoses it before the restart",
    ),
    "spare_refill_s": Param(
        value=4 * 3600.0,
        unit="s",
        source="estimate",
        estimate=True,
        help="a used hot spare is replaced (capacity block / reservation: the failed host must "
        "come back from repair; 1205 s if EC2 always had a free p5)",
    ),
    "nccl_init_low_s_at_96k": Param(
        value=26.5,
        unit="s",
        source="estimate",
        estimate=True,
        help="low end of NCCL start-up at 98,304 ranks (lazy or scalable init, a tenth of the "
        "published 265 s)",
    ),
    "rendezvous_low_s_at_98k": Param(
        value=10.0,
        unit="s",
        source="estimate",
        estimate=True,
        help="low end of rendezvous at 98,304 ranks (a tenth of the published 100 s)",
    ),
    # --- replica groups (--restart replica) ----------------------------------------------------
    "replica_quorum_s": Param(
        value=REPLICA_QUORUM_S,
        unit="s",
        source="replica-emulation",
        help="replica groups, shrinking semantics: the survivors' stall from the discarded step "
        "to the quorum without the failed group, once the failure is seen (measured in "
        "emulation; the Lighthouse forgets a replica silent for 2 s)",
    ),
    "replica_group_gpus": Param(
        value=512.0,
        unit="GPUs",
        source="estimate",
        estimate=True,
        help="replica groups: GPUs per replica group (HSDP shard group: FSDP2 inside it)",
    ),
    "replica_rejoin_s": Param(
        value=REPLICA_REJOIN_S,
        unit="s",
        source="replica-emulation",
        help="replica groups: from the failed group's restored workers to the survivors' next "
        "committed step (quorum, heal handshake, a tiny step), beyond the group's own restart; "
        "measured in emulation (CPU, gloo, 2 x 2 ranks; the heal's transfer and the redone step "
        "are priced at cluster scale in replica_heal_s and replica_redo_step_s)",
    ),
    # --- prices -------------------------------------------------------------------------------
    "gpu_hour_usd": Param(
        value=prices.GPU_HOUR_USD,
        unit="USD",
        source="prices",
        help="one H100 hour (p5.48xlarge Capacity Block / 8): what an ETTR point and an idle "
        "spare cost",
    ),
    **{
        f"fsx_usd_per_gb_month_{tier}": Param(
            value=usd,
            unit="USD",
            source="prices",
            help=f"FSx for Lustre Persistent-2 SSD at {tier} MB/s/TiB, per GB-month",
        )
        for tier, usd in prices.FSX_PERSISTENT2_USD_PER_GB_MONTH.items()
    },
    # --- checkpoint --------------------------------------------------------------------------
    "d2h_gbps": Param(
        value=hardware.PCIE5_X16_BYTES_PER_S / GB / 2,
        unit="GB/s",
        source="pcie",
        estimate=True,
        help="GPU <-> host memory copy per GPU, either way (half of PCIe 5.0 x16 nominal: an "
        "estimate); checkpoint stalls and restores from memory",
    ),
    "shm_copy_gbps": Param(
        value=hardware.P5_HOST_MEMORY_BYTES_PER_S / GB / hardware.P5_GPUS / 2,
        unit="GB/s",
        source="p5",
        estimate=True,
        help="per GPU, copying its shard out of the pod's /dev/shm on a restore: a node's "
        "nominal host memory bandwidth shared by its 8 ranks, each byte read and written once "
        "(the page-cache read, or CUDA's staging of a pageable copy)",
    ),
    "efa_gbps": Param(
        value=hardware.P5_EFA_BYTES_PER_S / GB,
        unit="GB/s",
        source="p5",
        help="node-to-node EFA, each way (p5.48xlarge 3,200 Gbps nominal): a peer restore and "
        "the peer copy of each memory snapshot",
    ),
    "memory_snapshot_s": Param(
        value=0.1,
        unit="s",
        source="estimate",
        estimate=True,
        help="blocking work per memory snapshot besides the copies (the update waits for the "
        "copy's event; slot bookkeeping; the /dev/shm copy)",
    ),
    "save_fixed_s": Param(
        value=0.5,
        unit="s",
        source="estimate",
        estimate=True,
        help="per-save blocking work besides the copy (planning, commit barrier)",
    ),
    "write_drag": Param(
        value=0.0,
        unit="fraction",
        source="estimate",
        estimate=True,
        help="training slows by this fraction while the background write runs (0: not charged, "
        "no steady-state figure published; try 0.02-0.05)",
    ),
}
ZERO_OK = frozenset(name for name, p in DEFAULTS.items() if p.unit == "fraction")
"""Parameters that may be set to 0."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """The parameters in force: defaults, measured-cpu values or overrides, with sources."""

    name: str
    """``cluster`` (the default) or ``measured-cpu``."""
    params: Mapping[str, float]
    """Parameter name -> value."""
    sources: Mapping[str, str]
    """Parameter name -> source key (``override`` for --set)."""
    measured: Mapping[str, float] = field(default_factory=dict)
    """measured-cpu only: stall and per-mode restart seconds from bench/results."""


def cluster_model(*, overrides: Mapping[str, float] | None = None) -> CostModel:
    """The default cluster-scale model, with ``overrides`` (validated names) applied."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown cost parameter(s) {', '.join(unknown)}: see --list-costs")
    params = {k: overrides.get(k, p.value) for k, p in DEFAULTS.items()}
    sources = {k: "override" if k in overrides else p.source for k, p in DEFAULTS.items()}
    return CostModel(name="cluster", params=params, sources=sources)


@dataclass(frozen=True, kw_only=True)
class Job:
    """The job being planned."""

    gpus: int
    """GPUs (ranks) in the job."""
    gpus_per_node: int
    """GPUs per node (8 on p5.48xlarge)."""
    ckpt_bytes: float
    """Bytes of one full checkpoint, all shards."""
    step_time_s: float
    """Seconds per optimizer step."""
    fsx_bytes_per_s: float
    """Aggregate FSx throughput the checkpoint is read and written at."""

    @property
    def nodes(self) -> int:
        """Nodes (pods) in the job; a partial node counts as one."""
        return -(-self.gpus // self.gpus_per_node)


@dataclass(frozen=True)
class Term:
    """One cost term evaluated for a job."""

    name: str
    seconds: float
    source: str
    """Source key, or ``override``."""


def _p(model: CostModel, name: str) -> Term:
    return Term(name, model.params[name], model.sources[name])


def terms(*, model: CostModel, job: Job) -> dict[str, Term]:
    """Every term in seconds at this job's size (scaled terms carry their parameter's source)."""
    p = model.params
    s = model.sources
    out = {
        name: _p(model, name)
        for name in DEFAULTS
        if name.endswith("_s") and not name.endswith(("_at_16k", "_at_98k", "_at_96k"))
    }
    out["inprocess_abort_s"] = Term(
        "inprocess_abort_s", p["inprocess_abort_s"] + job.step_time_s, s["inprocess_abort_s"]
    )
    out["inprocess_barrier_s"] = Term(
        "inprocess_barrier_s",
        p["inprocess_barrier_s_at_16k"] * job.gpus / 16_384,
        s["inprocess_barrier_s_at_16k"],
    )
    out["rendezvous_s"] = Term(
        "rendezvous_s", p["rendezvous_s_at_98k"] * job.gpus / 98_304, s["rendezvous_s_at_98k"]
    )
    out["nccl_init_s"] = Term(
        "nccl_init_s", p["nccl_init_s_at_96k"] * job.gpus / 98_304, s["nccl_init_s_at_96k"]
    )
    out["ckpt_load_s"] = Term("ckpt_load_s", job.ckpt_bytes / job.fsx_bytes_per_s, "fsx")
    out["ckpt_write_s"] = Term("ckpt_write_s", job.ckpt_bytes / job.fsx_bytes_per_s, "fsx")
    out["pod_replace_all_s"] = Term(
        "pod_replace_all_s",
        p["pod_start_s"] + job.nodes / p["pod_schedule_rate"],
        s["pod_schedule_rate"],
    )
    out["node_replace_s"] = Term(
        "node_replace_s",
        p["node_repair_wait_s"] + p["node_boot_s"] + p["image_pull_s"] + p["pod_start_s"],
        s["node_repair_wait_s"],
    )
    # A silent node is fenced (infra/fencer: terminated, then out of service); the node group
    # launches its replacement at the termination (docs/node-loss.md, "The fencer").
    out["node_replace_host_s"] = Term(
        "node_replace_host_s",
        p["node_monitor_grace_s"]
        + p["fence_wait_s"]
        + p["fence_poll_s"]
        + p["instance_terminate_s"]
        + p["node_boot_s"]
        + p["image_pull_s"]
        + p["pod_start_s"],
        s["fence_wait_s"],
    )
    out["spare_swap_s"] = Term("spare_swap_s", p["pod_start_s"], s["pod_start_s"])
    # A silent node's pod is replaced only once it is Failed: after the fencer terminated the
    # instance and tainted the node out of service, at PodGC's next loop (docs/node-loss.md,
    # "The fencer"), with a spare as without one.
    out["spare_swap_host_s"] = Term(
        "spare_swap_host_s",
        p["node_monitor_grace_s"]
        + p["fence_wait_s"]
        + p["fence_poll_s"]
        + p["instance_terminate_s"]
        + p["podgc_loop_s"]
        + p["pod_start_s"],
        s["fence_wait_s"],
    )
    shard_gpu = job.ckpt_bytes / job.gpus
    shard_node = job.ckpt_bytes / job.nodes
    h2d = p["d2h_gbps"] * GB
    efa = p["efa_gbps"] * GB
    shm = p["shm_copy_gbps"] * GB
    # Process memory: a pinned host buffer straight to the GPU (checkpoint/memory.py). Pod
    # memory: the same shard first copied out of the /dev/shm file (snapshot_files.load: a
    # read into a CPU tensor, or a pageable copy that CUDA stages through pinned memory), with
    # no CRC pass (pod_memory.PodMemorySnapshots.check says why).
    out["restore_memory_s"] = Term("restore_memory_s", shard_gpu / h2d, s["d2h_gbps"])
    out["restore_pod_memory_s"] = Term(
        "restore_pod_memory_s", shard_gpu / shm + shard_gpu / h2d, s["shm_copy_gbps"]
    )
    # The replacement reads its node's shard from one peer: one node's EFA at each end.
    out["restore_peer_s"] = Term(
        "restore_peer_s", shard_node / efa + shard_gpu / h2d, s["efa_gbps"]
    )
    # The device-to-host copy runs on a side stream beside the next step's forward and backward
    # (training/checkpoint/memory.py): only what outlasts a step blocks. The peer copy is charged
    # whole (it shares EFA with FSDP's collectives).
    peer_copy = shard_node / efa if job.nodes >= 2 else 0.0
    out["memory_snapshot_stall_s"] = Term(
        "memory_snapshot_stall_s",
        p["memory_snapshot_s"] + peer_copy + max(0.0, shard_gpu / h2d - job.step_time_s),
        s["memory_snapshot_s"],
    )
    out["ckpt_stall_s"] = Term(
        "ckpt_stall_s",
        p["save_fixed_s"] + job.ckpt_bytes / job.gpus / (p["d2h_gbps"] * GB),
        s["d2h_gbps"],
    )
    return out


def checkpoint_stall_s(*, model: CostModel, job: Job) -> float:
    """Seconds training blocks per checkpoint (delta)."""
    if model.name == "measured-cpu":
        return model.measured["ckpt_stall_s"]
    return terms(model=model, job=job)["ckpt_stall_s"].seconds


def _detection(t: dict[str, Term], *, mode: str, outcome: Outcome) -> Term:
    """Who sees the fault: the Job's own timeouts (no restart layer), ft_launcher's rank
    monitor (new processes), or the in-process Wrapper (the processes survive)."""
    spec = tiers.row(mode)
    hang = outcome.needs_node or outcome.hangs
    if not spec.keeps_pod:
        return t["detect_hang_none_s" if hang else "detect_exit_none_s"]
    if not spec.keeps_processes:
        return t["detect_hang_injob_s" if hang else "detect_exit_injob_s"]
    if outcome.needs_node:
        return t["detect_lost_rank_inprocess_s"]
    return t["detect_hang_inprocess_s" if outcome.hangs else "detect_exception_inprocess_s"]


def _node(t: dict[str, Term], outcome: Outcome) -> Term:
    if outcome.spare:
        return t["spare_swap_host_s" if outcome.host else "spare_swap_s"]
    return t["node_replace_host_s" if outcome.host else "node_replace_s"]


RESTORE_TERMS: dict[str, str] = {
    tiers.MEMORY: "restore_memory_s",
    tiers.POD_MEMORY: "restore_pod_memory_s",
    tiers.PEER: "restore_peer_s",
    tiers.STORAGE: "ckpt_load_s",
}
"""The term that reads the state back, per restore source (``local`` is never chosen:
planner.tiers)."""


def low_startup(model: CostModel) -> CostModel:
    """The model with NCCL start-up and rendezvous at the low ends of their ranges."""
    if model.name != "cluster":
        return model
    params = dict(model.params)
    sources = dict(model.sources)
    for high, low in (
        ("nccl_init_s_at_96k", "nccl_init_low_s_at_96k"),
        ("rendezvous_s_at_98k", "rendezvous_low_s_at_98k"),
    ):
        params[high] = params[low]
        sources[high] = sources[low]
    return CostModel(name="cluster", params=params, sources=sources)


def scaled_estimates(model: CostModel, factor: float) -> CostModel:
    """The model with every estimated parameter (not overridden) multiplied by ``factor``: the
    planner's error bar for what no publication pins down."""
    if model.name != "cluster":
        return model
    params = dict(model.params)
    for name, prm in DEFAULTS.items():
        if prm.estimate and model.sources[name] != "override" and prm.unit != "fraction":
            params[name] = params[name] * factor
    return CostModel(name="cluster", params=params, sources=dict(model.sources))


def _job_restart(t: dict[str, Term], outcome: Outcome, detect: Term) -> list[Term]:
    """Every pod torn down and recreated (a new node, if one is needed, comes up meanwhile)."""
    pods = t["pod_replace_all_s"]
    if outcome.needs_node and (outcome.host or not outcome.spare):
        # The new node (or a silent node's pod, which the Job replaces only once it is Failed)
        # and the recreated pods come up in parallel; the slower one counts.
        pods = max(pods, _node(t, outcome), key=lambda x: x.seconds)
    tail = [t["rendezvous_s"], t["nccl_init_s"], t["ckpt_load_s"]]
    return [detect, t["pod_teardown_s"], pods, t["worker_start_s"], *tail]


def recovery(
    *,
    model: CostModel,
    job: Job,
    mode: str,
    outcome: Outcome,
    precomputed: Mapping[str, Term] | None = None,
    source: str = tiers.STORAGE,
) -> list[Term]:
    """The terms one failure of this outcome costs in this mode, in order; their sum is R.

    ``source`` is the tier the state is read back from (planner.tiers.restore_source); a
    whole-job restart always reads storage.

    ``replica`` is charged by :func:`replica_recovery`: its recovery restarts one group.
    """
    spec = tiers.row(mode)  # a clear error for an unknown mode
    if model.name == "measured-cpu":
        return [Term("measured restart", _measured_restart(model, mode, outcome), "bench")]
    if source not in RESTORE_TERMS:
        raise ValueError(f"no restore from {source!r}: use one of {', '.join(RESTORE_TERMS)}")
    t = dict(precomputed) if precomputed is not None else terms(model=model, job=job)
    if tiers.whole_job_restart(mode=mode, outcome=outcome):
        source = tiers.STORAGE
    t["ckpt_load_s"] = t[RESTORE_TERMS[source]]
    detect = _detection(t, mode=mode, outcome=outcome)
    if outcome.manual:
        return [t["manual_intervention_s"], *_job_restart(t, outcome, detect)]
    in_place = [
        detect,
        t["inprocess_abort_s"],
        t["inprocess_barrier_s"],
        t["nccl_init_s"],
        t["ckpt_load_s"],
    ]
    if tiers.whole_job_restart(mode=mode, outcome=outcome):
        return _job_restart(t, outcome, detect)
    if outcome.needs_node and not spec.keeps_nodes:
        # Reserve ranks (whole_job_restart said so): the spare's processes already run; the
        # Wrapper swaps them in.
        return in_place
    if outcome.needs_node or not spec.keeps_processes:
        # New worker processes in the kept pods (and a new node first, for a lost one).
        node = [_node(t, outcome)] if outcome.needs_node else []
        tail = [t["rendezvous_s"], t["nccl_init_s"], t["ckpt_load_s"]]
        return [detect, t["worker_stop_s"], *node, t["worker_start_s"], *tail]
    # The processes survive a fault recoverable in place: no new processes or store clients.
    return in_place


def replica_recovery(
    *, model: CostModel, job: Job, outcome: Outcome, semantics: str = "wait"
) -> list[Term]:
    """Replica groups: the job-wide seconds one failure costs, term by term.

    The failed group (``replica_group_gpus``) recovers on its own, by the path its own
    ``ft_launcher`` takes (``injob`` at the group's size: detection, new workers, a node or
    spare for a lost one, rendezvous and NCCL among the group's ranks), with the state read
    from a live peer group over EFA (``replica_heal_s``: each node of the group receives its
    shard from its counterpart, the peer restore's term at the group's size) instead of a
    checkpoint, so nothing is rolled back. Then ``replica_rejoin_s`` (measured in emulation)
    and the step in flight, discarded and redone (``replica_redo_step_s``).

    ``wait``: every other group waits meanwhile, so the job loses all of it. ``shrink``: the
    others go on once they see the failure and agree on a quorum without the group
    (``replica_quorum_s``, measured), and the job loses the group's share of its recovery. They
    see it at once when the group's processes die (their cross-group all-reduce fails); a hung
    group, when its own layer kills its processes (the group's detection) or torchft's
    all-reduce times out (``resilience.replica_timeout_s``), whichever comes first; a silent
    node's processes cannot be killed, so only the timeout frees them
    (``replica_survivors_wait_s``).
    """
    if semantics not in REPLICA_SEMANTICS:
        raise ValueError(f"unknown replica semantics {semantics!r}: use one of wait, shrink")
    p = model.params
    group_gpus = min(job.gpus, int(p["replica_group_gpus"]))
    group = Job(
        gpus=group_gpus,
        gpus_per_node=job.gpus_per_node,
        ckpt_bytes=job.ckpt_bytes,
        step_time_s=job.step_time_s,
        fsx_bytes_per_s=job.fsx_bytes_per_s,
    )
    restart = recovery(model=model, job=group, mode="injob", outcome=outcome, source=tiers.PEER)
    heal_name = RESTORE_TERMS[tiers.PEER]
    own = [
        Term("replica_heal_s", t.seconds, t.source) if t.name == heal_name else t for t in restart
    ]
    own += [
        _p(model, "replica_rejoin_s"),
        Term("replica_redo_step_s", job.step_time_s, "project"),
    ]
    if semantics == "wait":
        return own
    share = group_gpus / job.gpus
    timeout = _RESILIENCE.replica_timeout_s
    if outcome.host:
        seen = [Term("replica_survivors_wait_s", timeout, "config")]
    elif outcome.hangs:
        seen = [Term("replica_survivors_wait_s", min(restart[0].seconds, timeout), "config")]
    else:
        seen = []
    return [
        *seen,
        _p(model, "replica_quorum_s"),
        Term("replica_redo_step_s", job.step_time_s, "project"),
        *(Term(t.name, t.seconds * share, t.source) for t in own[:-1]),
    ]


def replica_loss_s(
    *, model: CostModel, job: Job, outcome: Outcome, semantics: str = "wait"
) -> float:
    """The sum of ``replica_recovery``."""
    return sum(
        t.seconds
        for t in replica_recovery(model=model, job=job, outcome=outcome, semantics=semantics)
    )


def recovery_s(
    *, model: CostModel, job: Job, mode: str, outcome: Outcome, source: str = tiers.STORAGE
) -> float:
    """R: seconds from the failure to training again, for one outcome in one mode."""
    return sum(
        term.seconds
        for term in recovery(model=model, job=job, mode=mode, outcome=outcome, source=source)
    )


def _measured_restart(model: CostModel, mode: str, outcome: Outcome) -> float:
    m = model.measured
    spec = tiers.row(mode)
    if not spec.keeps_pod or (outcome.needs_node and not spec.keeps_nodes):
        return m["cold_s"]
    if spec.keeps_processes and not outcome.needs_node:
        return m["inprocess_s"]
    return m["injob_s"]
