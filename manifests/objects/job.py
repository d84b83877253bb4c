"""The training job of an overlay: its headless Service and its Indexed Job, whose pods run one
node's launcher command each; and where such a pod is placed (`pod_placement`, which the hot
spares copy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from manifests.objects.common import (
    CONFIG_MAP,
    CONTAINER,
    FSX_MOUNT,
    PVC_NAME,
    SERVICE_ACCOUNT,
    TRAINER,
    labels,
    size_of,
)
from manifests.objects.rdzv_store import RDZV_STORE, RDZV_STORE_PORT
from manifests.sizes import RESTART_MODES, OverlaySize
from training import exits
from training.command import Rendezvous, launcher_command
from training.config import JobConfig
from training.modes import snapshot_plan
from training.observe.catalog import METRICS_PORT, METRICS_PORT_NAME
from training.overrides import build_config
from training.runlog.verdict import NODE_NAME_ENV

FSX_FSTYPE = "lustre"
"""What the start-up check expects at FSX_MOUNT (fsx.csi.aws.com mounts FSx for Lustre)."""
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""The container's terminationMessagePath (the kubelet's default, set explicitly): the start-up
check writes its verdict, naming the node, there."""
DATA_DIR = f"{FSX_MOUNT}/data/stdlib"
NODE_LOSS_TOLERATION_SECONDS = 30
"""How long a trainer pod stays bound to a node that turned NotReady or unreachable before the
taint eviction controller deletes it (the DefaultTolerationSeconds admission plugin would give
300). Deleted, the pod carries the DisruptionTarget condition, so its failure is Ignored by the
pod failure policy, and a node that comes back kills it at once instead of rejoining a run that
went on without it (docs/node-loss.md)."""
TTL_SECONDS_AFTER_FINISHED = 86400  # a finished Job (and its logs) stays a day, then goes
SCRATCH = "/scratch"
NODE_SCRATCH = "/mnt/k8s-disks/0/eks-fsdp-resilient"
"""The node's directory behind SCRATCH: on the instance-store RAID0 that nodeadm's
`localStorage: RAID0` builds and mounts at /mnt/k8s-disks/0 (amazon-eks-ami,
templates/shared/runtime/bin/setup-local-disks: `array_mount_point="${MNT_DIR}/0"`, MNT_DIR
/mnt/k8s-disks by default). It outlives pods, not the node; each run's local checkpoints are
in their own NVRx session (the run), and nothing sweeps old runs' files but the node's end."""

# Data shards on FSx, prepared once: index 0 builds them in a temporary directory and renames it
# into place (atomic on Lustre); the other pods wait for meta.json.
SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "scripts"
PREPARE_SCRIPT = (SCRIPTS_DIR / "prepare-data.sh").read_text()
"""The init container's script (a real shell file, so shellcheck can read it)."""


@dataclass(frozen=True, kw_only=True)
class PodPlacement:
    """Where a pod of an overlay's GPU nodes goes, and what it holds there: its node selector,
    its tolerations and its container's resources. The trainer pod and the hot spare that
    stands in for it share it (`pod_placement`)."""

    node_selector: dict[str, str]
    tolerations: list[dict]
    resources: dict[str, dict[str, str]]


def pod_placement(size: OverlaySize) -> PodPlacement:
    """A whole node of `size`'s type: every GPU, EFA interface and huge page of it (one pod per
    node follows from that), on the GPU nodes' taint, bound to a lost node for
    NODE_LOSS_TOLERATION_SECONDS. Fresh dicts on every call."""
    node = size.node_type
    # Extended resources (GPU, EFA) and huge pages need requests == limits.
    devices = {
        "nvidia.com/gpu": str(node.gpus),
        "vpc.amazonaws.com/efa": str(node.efa),
        "hugepages-2Mi": node.hugepages_2mi,
    }
    return PodPlacement(
        # The selector picks the node type.
        node_selector={"node.kubernetes.io/instance-type": node.name},
        tolerations=[
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            # The node lifecycle controller's taints for a node that stopped answering
            # (unreachable: Ready=Unknown) or reports itself not ready (not-ready: Ready=False).
            *(
                {
                    "key": f"node.kubernetes.io/{key}",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": NODE_LOSS_TOLERATION_SECONDS,
                }
                for key in ("unreachable", "not-ready")
            ),
        ],
        resources={
            "requests": {"cpu": node.cpu, "memory": node.memory, **devices},
            "limits": dict(devices),
        },
    )


def job_objects(
    *,
    overlay: str,
    namespace: str,
    image: str,
    restart: str | None = None,
    train_args: Sequence[str] | None = None,
) -> list[dict]:
    """The headless Service and the Indexed Job of `overlay`.

    `restart` (injob | inprocess) and `train_args` (trainer overrides such as
    `--train.steps=100`) default to the overlay's row in `sizes.py`.
    """
    size = size_of(overlay)
    restart = restart or size.restart
    if restart not in RESTART_MODES:
        raise ValueError(f"restart must be one of {', '.join(RESTART_MODES)}, got {restart!r}")
    args = trainer_args(
        size=size,
        restart=restart,
        train_args=size.train_args if train_args is None else train_args,
    )
    return [
        _service(size=size, namespace=namespace),
        job_for_args(size=size, namespace=namespace, image=image, args=args),
    ]


def job_for_args(*, size: OverlaySize, namespace: str, image: str, args: list[str]) -> dict:
    """The overlay's Job for the trainer arguments ``args`` (:func:`trainer_args`), any restart
    mode: the Indexed Job above, and each replica group's Job in ``manifests/replica.py``."""
    config = _job_config(size=size, args=args)
    return _job(
        size=size,
        namespace=namespace,
        image=image,
        command=_launcher(size=size, namespace=namespace, args=args, config=config),
        memory_env=pod_memory_env(size=size, config=config),
    )


def trainer_args(*, size: OverlaySize, restart: str, train_args: Sequence[str]) -> list[str]:
    """The trainer's arguments in the Job (the recipe comes from the RECIPE variable)."""
    return [
        "--recipe=$(RECIPE)",
        f"--run-dir={FSX_MOUNT}/runs/{size.job_name}",
        f"--restart={restart}",
        f"--checkpoint.dir={FSX_MOUNT}/checkpoints/{size.job_name}",
        f"--data.path={DATA_DIR}",
        # ft_launcher's SIGTERM-to-SIGKILL time fits in the pod's grace period, with 30 s left
        # for the launcher itself.
        f"--resilience.term_timeout_s={max(size.grace_seconds - 30, 30)}",
        *train_args,
    ]


def _job_config(*, size: OverlaySize, args: Sequence[str]) -> JobConfig:
    """The config the Job's trainer runs with (`args`: :func:`trainer_args`)."""
    config, _ = build_config([a.replace("$(RECIPE)", size.recipe) for a in args])
    return config


def pod_command(
    *, size: OverlaySize, namespace: str, restart: str, train_args: Sequence[str]
) -> list[str]:
    """The trainer container's args: one node's launcher command, derived from the run's config
    by `training.command` (the same function the local launcher uses). `$(VAR)` is
    expanded by the kubelet from the container's environment."""
    args = trainer_args(size=size, restart=restart, train_args=train_args)
    return _launcher(
        size=size, namespace=namespace, args=args, config=_job_config(size=size, args=args)
    )


def _launcher(
    *, size: OverlaySize, namespace: str, args: list[str], config: JobConfig
) -> list[str]:
    return launcher_command(
        config=config,
        trainer_args=args,
        nnodes="$(NNODES)",
        nproc_per_node="$(NPROC_PER_NODE)",
        rdzv=Rendezvous(
            endpoint=f"{RDZV_STORE}.{namespace}:{RDZV_STORE_PORT}",
            run_id="$(JOB_UID)",
            external_store=True,
            local_addr="$(POD_IP)",
        ),
    )


def _service(*, size: OverlaySize, namespace: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": size.job_name, "namespace": namespace, "labels": labels("rdzv")},
        "spec": {
            "clusterIP": "None",
            # Stable per-pod DNS names (<job>-<index>.<job>) for people and tools; the ranks
            # meet through the rendezvous store and dial each other by pod IP.
            "publishNotReadyAddresses": True,
            "selector": {"batch.kubernetes.io/job-name": size.job_name},
        },
    }


def pod_memory_env(*, size: OverlaySize, config: JobConfig) -> dict[str, str]:
    """The start-up check's figures for the memory snapshots in the pod's /dev/shm
    (training/startup_check.py ``check_pod_memory``): where they live (the run's
    ``checkpoint.pod_memory_dir``) and the bytes this node needs
    (``facts.checkpoint.snapshot_bytes_per_node``): its own two slots, and with the run's
    ``checkpoint.peer_copy`` on and more than one node, the two slots of the node before it
    (training/checkpoint/peer.py; on one node the copy is off: ``peer.ring_problem``). None
    when the run takes no snapshots in the pod's memory (``training.modes.snapshot_plan``) or
    the recipe is not in ``facts.recipes``. ``config``: the Job's trainer's
    (:func:`job_objects`)."""
    from facts.checkpoint import snapshot_bytes_per_node
    from facts.recipes import RECIPES

    c = config.checkpoint
    plan = snapshot_plan(checkpoint=c, restart=config.resilience.restart, nodes=size.nodes)
    facts = RECIPES.get(size.recipe)
    if plan.tier != "pod_memory" or facts is None:
        return {}
    needed = snapshot_bytes_per_node(params=facts.params, nodes=size.nodes, copies=plan.copies)
    return {"POD_MEMORY_DIR": c.pod_memory_dir, "POD_MEMORY_BYTES": str(int(needed))}


def _env(*, size: OverlaySize, memory_env: dict[str, str]) -> list[dict]:
    values = {
        "JOB_NAME": size.job_name,
        # The launcher's node count, equal to the Job's completions (both from sizes.py).
        "NNODES": str(size.nodes),
        "NPROC_PER_NODE": str(size.nproc_per_node),
        # training.startup_check: a multi-node job without the EFA provider would fall back to
        # TCP sockets and run at a fraction of its speed, so the pod refuses to start.
        "REQUIRE_EFA": "1" if size.nodes > 1 and size.node_type.efa > 0 else "0",
        "RECIPE": size.recipe,
        "DATA_DIR": DATA_DIR,
        "TMPDIR": SCRATCH,
        # training.startup_check: /fsx must be the Lustre claim, writable, before rank 0 trains.
        "FSX_MOUNT": FSX_MOUNT,
        "FSX_FSTYPE": FSX_FSTYPE,
        "TERMINATION_MESSAGE_PATH": TERMINATION_MESSAGE_PATH,
        **memory_env,
    }
    downward = {
        # Unique per Job object: the rendezvous id (a resubmitted Job gets a fresh rendezvous).
        "JOB_UID": "metadata.labels['batch.kubernetes.io/controller-uid']",
        # What the other nodes dial for the process groups (ft_launcher's --local-addr).
        "POD_IP": "status.podIP",
        # Named in the start-up check's messages, the straggler reports and a node's verdict.
        NODE_NAME_ENV: "spec.nodeName",
    }
    return [
        *({"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in downward.items()),
        *({"name": k, "value": v} for k, v in values.items()),
    ]


def _job(
    *,
    size: OverlaySize,
    namespace: str,
    image: str,
    command: list[str],
    memory_env: dict[str, str],
) -> dict:
    """``memory_env``: the pod-memory figures of the Job's own trainer arguments
    (:func:`pod_memory_env`)."""
    node = size.node_type
    placement = pod_placement(size)
    volume_mounts = [
        {"name": "fsx", "mountPath": FSX_MOUNT},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": SCRATCH},
    ]
    container = {
        "name": CONTAINER,
        "image": image,
        "workingDir": "/app",
        "command": ["python", "-m", "training.launch.pod"],
        "args": command,
        "env": _env(size=size, memory_env=memory_env),
        "envFrom": [{"configMapRef": {"name": CONFIG_MAP}}],
        "resources": placement.resources,
        # EFA registers (pins) memory: the provider needs an unlimited memlock.
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
        "volumeMounts": volume_mounts,
        # The start-up check writes its verdict here; any other failure shows its log's tail
        # (the kubelet's FallbackToLogsOnError: the last 2048 bytes or 80 lines).
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # The pod's metrics exporter (training/observe); the scraper keeps this port by name.
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT}],
    }
    prepare = {
        "name": "prepare-data",
        "image": image,
        "workingDir": "/app",
        "command": ["bash", "-c", PREPARE_SCRIPT],
        "env": [{"name": "DATA_DIR", "value": DATA_DIR}],
        "resources": {"requests": {"cpu": "4", "memory": "16Gi"}},
        "volumeMounts": [{"name": "fsx", "mountPath": FSX_MOUNT}],
    }
    pod_spec = {
        "serviceAccountName": SERVICE_ACCOUNT,
        # The token for the cordon of an evicted straggler's node (`node_cordon_objects`).
        "automountServiceAccountToken": True,
        "restartPolicy": "Never",  # required by podFailurePolicy; restarts happen in NVRx
        "subdomain": size.job_name,  # with the headless Service: <job>-<i>.<job> DNS names
        "terminationGracePeriodSeconds": size.grace_seconds,
        # One pod per node follows from requesting every GPU (`pod_placement`).
        "nodeSelector": placement.node_selector,
        "tolerations": placement.tolerations,
        "initContainers": [prepare],
        "containers": [container],
        "volumes": [
            {"name": "fsx", "persistentVolumeClaim": {"claimName": PVC_NAME}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": node.shm}},
            # Scratch (local checkpoints, TMPDIR) on the node's NVMe RAID0, outside any pod's
            # lifetime: a replacement pod on the same node finds the local checkpoints its
            # predecessor wrote (an emptyDir would go with the pod).
            {"name": "scratch", "hostPath": {"path": NODE_SCRATCH, "type": "DirectoryOrCreate"}},
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": size.job_name, "namespace": namespace, "labels": labels(TRAINER)},
        "spec": {
            "completionMode": "Indexed",
            "completions": size.nodes,
            "parallelism": size.nodes,
            "backoffLimit": size.backoff_limit,
            "ttlSecondsAfterFinished": TTL_SECONDS_AFTER_FINISHED,
            # A replacement pod starts only once the old one is gone: no two pods share a
            # hostname (rank), and the old one finishes its final checkpoint first. It is also
            # the only value the API allows with a podFailurePolicy (JobSpec.podReplacementPolicy;
            # kubernetes pkg/apis/batch/validation validatePodReplacementPolicy), so a pod on a
            # lost node is replaced once it is Failed, not when it starts terminating
            # (docs/node-loss.md: what makes it Failed, and how soon).
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {
                # Rules apply in order, the first match wins; no match counts the failure
                # against backoffLimit (kubernetes.io/docs, Job: "Pod failure policy").
                "rules": [
                    # A node that does not fit (training.startup_check): Count, the default
                    # handling, made explicit and first so no later rule can claim the code.
                    # The replacement pod may land on another node; if the scheduler picks
                    # the same one again, backoffLimit bounds the retries (Ignore would not).
                    {
                        "action": "Count",
                        "onExitCodes": {
                            "containerName": CONTAINER,
                            "operator": "In",
                            "values": [exits.NODE_UNFIT],
                        },
                    },
                    # Bad configuration, restart cap, no progress, unfit node software, no
                    # command: a replacement pod would meet the same error (training/exits.py).
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": CONTAINER,
                            "operator": "In",
                            "values": list(exits.RETRY_CANNOT_HELP),
                        },
                    },
                    # Node drain, preemption, eviction: not the job's fault.
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                ]
            },
            "template": {
                "metadata": {"labels": labels(TRAINER)},
                "spec": pod_spec,
            },
        },
    }
