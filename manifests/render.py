"""Render the training job's Kubernetes objects: the one place the manifests are built.

Three users, one source (`sizes.py` + the builders below):
- the CDK app (`infra/`) calls `shared_objects(...)` and `job_objects(...)` and hands the dicts
  to `cluster.add_manifest`; arguments may be CDK tokens, used here as opaque strings;
- `python -m training.launch.eks` applies `job_objects(...)` with the kubernetes client;
- kubectl users run `kubectl apply -k manifests/overlays/<name>`; those YAML files are
  generated from the same builders by `python -m manifests.kustomize write` (placeholders for
  the image and FSx ids), and a test fails when they drift.
`spare_objects(...)` (an overlay's hot spares) is in the kustomize overlays, and the launcher
applies it before the Job (`training.launch.eks.submit`); the CDK app does not (docs/node-loss.md).

Pure Python + PyYAML: no kubectl, no cluster, no AWS.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from manifests.sizes import RESTART_MODES, SIZES, OverlaySize
from training import exits
from training.command import Rendezvous, launcher_command
from training.config import JobConfig
from training.modes import snapshot_plan
from training.observe.catalog import METRICS_PORT, METRICS_PORT_NAME
from training.overrides import build_config
from training.runlog.verdict import NODE_NAME_ENV

PROJECT = "eks-fsdp-resilient"
"""Part-of label and the server-side apply field manager."""
KUBERNETES_VERSION = "1.35.0"
"""The Kubernetes API schema the objects are validated against (kubernetes-validate's newest);
not the cluster's version, which is infra/config.py's `kubernetesVersion`."""
OVERLAYS: tuple[str, ...] = tuple(SIZES)

SERVICE_ACCOUNT = "fsdp-trainer"
CONFIG_MAP = "fsdp-config"
PV_NAME = "fsdp-fsx"
PVC_NAME = "fsx-claim"
CONTAINER = "trainer"
FSX_MOUNT = "/fsx"
FSX_FSTYPE = "lustre"
"""What the start-up check expects at FSX_MOUNT (fsx.csi.aws.com mounts FSx for Lustre)."""
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""The container's terminationMessagePath (the kubelet's default, set explicitly): the start-up
check writes its verdict, naming the node, there."""
DATA_DIR = f"{FSX_MOUNT}/data/stdlib"
RDZV_STORE = "fsdp-rdzv"
"""The rendezvous store's Deployment and Service (shared by every training Job)."""
RDZV_STORE_PORT = 29400
RDZV_STORE_COMMAND = ("python", "-m", "training.launch.rdzv_store")
"""What the store's image runs, in /app: the trainer's image, or a small one of its own that
holds `python` with torch (a CPU build is enough) and RDZV_STORE_FILES under /app."""
RDZV_STORE_FILES = (
    "training/__init__.py",
    "training/launch/__init__.py",
    "training/launch/rdzv_store.py",
)
"""Every repository file the store imports (tests/training/test_rdzv_store.py runs the command
with these files alone): a store image built from them changes only when they do."""
RDZV_PRIORITY_CLASS = "fsdp-rdzv-store"
RDZV_PRIORITY = 1_000_000
"""Above every pod without a class (0); below the system-*-critical classes (2e9)."""
TRAINER = "trainer"
"""The component label of the training Job's pods (and the preflight Job's): the store's
NetworkPolicy admits exactly these."""
FSX_NOMINAL_SIZE = "4800Gi"
"""The FSx PersistentVolume's capacity and its claim's request: a fixed nominal size, never the
file system's. Kubernetes binds a claim to a volume whose capacity is at least the request and
does not resize a statically bound claim (the PersistentVolumeClaimResize admission plugin
refuses claims that were not dynamically provisioned; a smaller request is refused too), so a
size that followed FSx growth would fail the stack update after CloudFormation had grown the
file system. 4800 GiB is what the stack deployed by default (cdk.json `fsxStorageCapacityGiB`)
before the size left the claim, so a stack first deployed with the default keeps its claim as
it is. Never change it: every deployed claim carries it. The real size is in FSx and in the
ConfigMap (FSX_STORAGE_CAPACITY); the FSx CSI driver ignores a static volume's capacity (its
static-provisioning example: aws-fsx-csi-driver, examples/kubernetes/static_provisioning)."""
SPARES = "fsdp-spares"
"""The hot spares' Deployment: placeholder pods that hold spare GPU nodes (spare_objects)."""
SPARE = "spare"
"""The spares' component label (and their container's name)."""
SPARE_PRIORITY_CLASS = "fsdp-spare"
SPARE_PRIORITY = -100
"""Below every pod without a class (0, the trainers'): the scheduler preempts a spare to place
a trainer pod that fits nowhere else (kubernetes.io/docs: "Pod Priority and Preemption"). A
negative value is what the cluster autoscaler's over-provisioning placeholders use (its FAQ,
"How can I configure overprovisioning with Cluster Autoscaler?")."""
SPARE_COMMAND = ("sleep", "infinity")
"""What a spare runs in the trainer's image: nothing, so the image is pulled and the node is
held. As PID 1 it ignores SIGTERM, so its grace period is 0: a preempted spare frees its node
at once."""
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

# Placeholders in the committed kustomize YAML (the Python renderer gets the real values).
DEFAULT_NAMESPACE = "training"
IMAGE_NAME = "trainer"
STORE_IMAGE_NAME = "rdzv-store"
"""The store's image name in the kustomize base: its own `images:` entry (the trainer's image
by default, or the store's own image where the stack builds one)."""
PLACEHOLDER_IMAGE_REPO = "ACCOUNT.dkr.ecr.REGION.amazonaws.com/eks-fsdp-resilient"
PLACEHOLDER_IMAGE_TAG = "latest"
PLACEHOLDER_IMAGE = f"{PLACEHOLDER_IMAGE_REPO}:{PLACEHOLDER_IMAGE_TAG}"
PLACEHOLDER_FSX = {
    "file_system_id": "fs-0123456789abcdef0",
    "dns_name": "fs-0123456789abcdef0.fsx.REGION.amazonaws.com",
    "mount_name": "abcdefgh",
    "storage_capacity_gib": 1200,
}

# The EFA + NCCL environment every rank gets (via the ConfigMap: tune it without a new image).
EFA_NCCL_ENV = {
    "FI_PROVIDER": "efa",  # libfabric over EFA, never TCP sockets
    "FI_EFA_USE_DEVICE_RDMA": "1",  # GPUDirect RDMA on p5
    "FI_EFA_FORK_SAFE": "1",  # data loader workers fork
    "NCCL_DEBUG": "WARN",
    "NCCL_SOCKET_IFNAME": "^lo,docker",  # bootstrap over the pod's interface
    "NCCL_CROSS_NIC": "1",
    # A failed collective tears the process down (1) or raises (3): either way NVRx restarts it.
    # NVRx's in-process restart documents 3 ("tear down, but do not rethrow") as what it needs,
    # plus no NVLink SHARP (its abort cannot release NVLS buffers) and no rethrown CUDA errors.
    # Source: NVRx docs, "inprocess" usage guide / known issues.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}

# Data shards on FSx, prepared once: index 0 builds them in a temporary directory and renames it
# into place (atomic on Lustre); the other pods wait for meta.json.
SCRIPTS_DIR = Path(__file__).resolve().parent / "scripts"
PREPARE_SCRIPT = (SCRIPTS_DIR / "prepare-data.sh").read_text()
"""The init container's script (a real shell file, so shellcheck can read it)."""


def _labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "fsdp-train",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": PROJECT,
    }


def size_of(overlay: str) -> OverlaySize:
    """The sizes row of `overlay`; ValueError naming the allowed overlays."""
    try:
        return SIZES[overlay]
    except KeyError:
        raise ValueError(
            f"unknown overlay {overlay!r}: choose one of {', '.join(OVERLAYS)}"
        ) from None


# --- shared objects: deployed with every `cdk deploy` -----------------------------------------


def shared_objects(
    *,
    namespace: str,
    file_system_id: str,
    dns_name: str,
    mount_name: str,
    storage_capacity_gib: int,
    image: str,
    store_image: str | None = None,
) -> list[dict]:
    """Namespace, FSx PV + PVC, ServiceAccount, ConfigMap and the rendezvous store: what every
    training job needs. `store_image` runs the rendezvous store (default: `image`, the
    trainer's, which has torch); a store image of its own keeps the store's pod unchanged
    when the trainer's image changes. `storage_capacity_gib` goes to the ConfigMap only."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "labels": _labels("namespace")},
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {
                "name": SERVICE_ACCOUNT,
                "namespace": namespace,
                "labels": _labels(TRAINER),
            },
            # No token by default (the rendezvous store and the spares' placeholders use
            # this account too and call no API); the trainer's pod asks for one, for the
            # cordon (`node_cordon_objects`).
            "automountServiceAccountToken": False,
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": CONFIG_MAP, "namespace": namespace, "labels": _labels("config")},
            "data": {
                **EFA_NCCL_ENV,
                # The stack's FSx file system; the kustomize base copies the ids into the PV.
                # The size is for people and tools: the PV and PVC carry FSX_NOMINAL_SIZE.
                "FSX_FILE_SYSTEM_ID": file_system_id,
                "FSX_DNS_NAME": dns_name,
                "FSX_MOUNT_NAME": mount_name,
                "FSX_STORAGE_CAPACITY": f"{storage_capacity_gib}Gi",
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": PV_NAME, "labels": _labels("storage")},
            "spec": {
                "capacity": {"storage": FSX_NOMINAL_SIZE},
                "volumeMode": "Filesystem",
                "accessModes": ["ReadWriteMany"],
                # Static provisioning: the file system belongs to the stack, never to a claim.
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "mountOptions": ["flock"],
                "csi": {
                    "driver": "fsx.csi.aws.com",
                    "volumeHandle": file_system_id,
                    "volumeAttributes": {"dnsname": dns_name, "mountname": mount_name},
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": PVC_NAME, "namespace": namespace, "labels": _labels("storage")},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": PV_NAME,
                "resources": {"requests": {"storage": FSX_NOMINAL_SIZE}},
            },
        },
        *_rdzv_store(namespace=namespace, image=store_image or image),
        *node_cordon_objects(namespace=namespace),
        *spare_reader_objects(namespace=namespace),
    ]


NODE_CORDON = "fsdp-trainer-cordon"
"""The ClusterRole, its binding and the admission policy that let a trainer pod cordon its node."""
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
"""The user-info extra that the API server adds for a pod-bound ServiceAccount token: the pod's
node (k8s.io/apiserver ``serviceaccount.NodeNameKey``; GA with ServiceAccountTokenPodNodeInfo
in 1.32)."""


SPARE_READER = "fsdp-trainer-spares"
"""The Role and RoleBinding that let a trainer pod count the Ready hot spares."""


def spare_reader_objects(*, namespace: str) -> list[dict]:
    """``list`` on the pods of the Job's own namespace: before the straggler policy evicts a
    node, rank 0 counts the Ready hot spares (`training.cluster.ready_spares`); with none, the
    eviction waits (an evicted pod's replacement would stay Pending and park the job until the
    rendezvous' join timeout). Read-only, one namespace."""
    labels = _labels(TRAINER)
    meta = {"name": SPARE_READER, "namespace": namespace, "labels": labels}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": SPARE_READER,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}
            ],
        },
    ]


def node_cordon_objects(*, namespace: str) -> list[dict]:
    """The trainer's one permission on the cluster: cordoning the node its pod runs on, when the
    straggler policy evicts that node (`training.cluster.cordon`), so the Job's replacement
    lands elsewhere.

    RBAC cannot say which node or which field: a ClusterRole grants ``patch`` on every Node
    (nodes are cluster-scoped, and node names are unknown when this is rendered). No ``get``
    or ``list``: the cordon is one PATCH. A ValidatingAdmissionPolicy (admissionregistration
    v1, GA in 1.30) narrows it: a node update by this ServiceAccount is admitted only when it
    is the caller's own node (the token's ``node-name`` extra) and it sets
    ``spec.unschedulable`` to true and changes no label, annotation, taint or other spec field.
    ``nodes/status`` is another resource and is not granted."""
    user = f"system:serviceaccount:{namespace}:{SERVICE_ACCOUNT}"
    labels = _labels(TRAINER)

    def same(path: str, empty: str) -> str:
        return (
            f"(has(object.{path}) ? object.{path} : {empty}) == "
            f"(has(oldObject.{path}) ? oldObject.{path} : {empty})"
        )

    # Every writable Node spec field but `unschedulable` (`configSource` is gone with dynamic
    # kubelet configuration, 1.24).
    spec_fields = {"podCIDR": "''", "podCIDRs": "[]", "providerID": "''", "taints": "[]"}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NODE_CORDON, "labels": labels},
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NODE_CORDON, "labels": labels},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": NODE_CORDON,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}
            ],
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": NODE_CORDON, "labels": labels},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["UPDATE"],  # a PATCH is admitted as an UPDATE
                            "resources": ["nodes"],
                        }
                    ]
                },
                "matchConditions": [
                    {"name": "trainer", "expression": f"request.userInfo.username == '{user}'"}
                ],
                "validations": [
                    {
                        "expression": (
                            f"'{NODE_NAME_EXTRA}' in request.userInfo.extra && "
                            f"request.userInfo.extra['{NODE_NAME_EXTRA}'] == "
                            "[object.metadata.name]"
                        ),
                        "message": "a trainer pod may cordon only the node it runs on",
                    },
                    {
                        "expression": (
                            "has(object.spec.unschedulable) && object.spec.unschedulable"
                        ),
                        "message": "a trainer pod may only set spec.unschedulable to true",
                    },
                    {
                        "expression": " && ".join(
                            [
                                same("metadata.labels", "{}"),
                                same("metadata.annotations", "{}"),
                                same("metadata.ownerReferences", "[]"),
                                same("metadata.finalizers", "[]"),
                                *(
                                    same(f"spec.{name}", empty)
                                    for name, empty in spec_fields.items()
                                ),
                            ]
                        ),
                        "message": "a trainer pod may change no field but spec.unschedulable",
                    },
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": NODE_CORDON, "labels": labels},
            "spec": {"policyName": NODE_CORDON, "validationActions": ["Deny"]},
        },
    ]


def _rdzv_store(*, namespace: str, image: str) -> list[dict]:
    """A one-replica TCPStore on the system nodes (never on a GPU node, so a lost training node
    cannot take it along), its Service, which every launcher joins as a client, and what keeps
    it single, in place and private (see each object)."""
    labels = _labels("rdzv-store")
    return [
        # Scheduler preemption and the kubelet's node-pressure eviction both rank pods by
        # priority: with a class above the trainers' (0), the store is neither preempted for nor
        # evicted before a training pod (kubernetes.io/docs: "Pod Priority and Preemption";
        # "Node-pressure Eviction", which ranks by usage over requests, then priority).
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": RDZV_PRIORITY_CLASS, "labels": labels},
            "value": RDZV_PRIORITY,
            "globalDefault": False,
            "preemptionPolicy": "PreemptLowerPriority",
            "description": "The training jobs' rendezvous store: every running launcher needs it.",
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": RDZV_STORE, "namespace": namespace, "labels": labels},
            "spec": {
                "replicas": 1,
                # The old pod goes before the new one starts: a RollingUpdate would serve two
                # independent stores behind one Service for a while, and launchers that meet
                # in different stores never form one rendezvous.
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": SERVICE_ACCOUNT,
                        "priorityClassName": RDZV_PRIORITY_CLASS,
                        "affinity": {
                            "nodeAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": {
                                    "nodeSelectorTerms": [
                                        {
                                            "matchExpressions": [
                                                {
                                                    "key": "nvidia.com/gpu.present",
                                                    "operator": "DoesNotExist",
                                                }
                                            ]
                                        }
                                    ]
                                }
                            }
                        },
                        "containers": [
                            {
                                "name": "store",
                                "image": image,
                                "workingDir": "/app",
                                "command": list(RDZV_STORE_COMMAND),
                                "args": [f"--port={RDZV_STORE_PORT}"],
                                "ports": [{"name": "rdzv", "containerPort": RDZV_STORE_PORT}],
                                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                                "readinessProbe": {
                                    "tcpSocket": {"port": RDZV_STORE_PORT},
                                    "periodSeconds": 5,
                                },
                            }
                        ],
                    },
                },
            },
        },
        # No voluntary eviction (`kubectl drain`, an autoscaler's scale-down) takes the one
        # store down: with minAvailable equal to the replicas, a drain of its node waits
        # (kubernetes.io/docs: "Specifying a Disruption Budget for your Application"). A
        # store that is not ready can still be evicted (unhealthyPodEvictionPolicy), and a
        # managed node group version update forces its way through after its drain attempts
        # (the node group's force update, on by default in aws_eks_v2).
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": RDZV_STORE, "namespace": namespace, "labels": labels},
            "spec": {
                "minAvailable": 1,
                "selector": {"matchLabels": labels},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        },
        # The store has no authentication: only the training Jobs' pods (and the preflight's,
        # whose pod template is the training Job's) reach its port. Kubelet probes come from
        # the node, which a NetworkPolicy always admits (kubernetes.io/docs: "Network
        # Policies"). Egress: none. The store only answers connections made to it (replies on an
        # admitted connection are allowed, policies being stateful), so it needs no outbound
        # traffic, and denying it keeps the pod off the node's IMDS (the system nodes' hop
        # limit is 2; docs/day-two.md). Enforced only where the CNI enforces policies (the VPC
        # CNI with its network policy agent turned on).
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": RDZV_STORE, "namespace": namespace, "labels": labels},
            "spec": {
                "podSelector": {"matchLabels": labels},
                "policyTypes": ["Ingress", "Egress"],
                "egress": [],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": _labels(TRAINER)}}],
                        "ports": [{"protocol": "TCP", "port": RDZV_STORE_PORT}],
                    }
                ],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": RDZV_STORE, "namespace": namespace, "labels": labels},
            "spec": {
                "selector": labels,
                "ports": [{"name": "rdzv", "port": RDZV_STORE_PORT, "targetPort": RDZV_STORE_PORT}],
            },
        },
    ]


# --- the job: headless Service + Indexed Job ---------------------------------------------------


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
    config = _job_config(size=size, args=args)
    return [
        _service(size=size, namespace=namespace),
        _job(
            size=size,
            namespace=namespace,
            image=image,
            command=_launcher(size=size, namespace=namespace, args=args, config=config),
            memory_env=pod_memory_env(size=size, config=config),
        ),
    ]


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
        "metadata": {"name": size.job_name, "namespace": namespace, "labels": _labels("rdzv")},
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
    # Extended resources (GPU, EFA) and huge pages need requests == limits.
    devices = {
        "nvidia.com/gpu": str(node.gpus),
        "vpc.amazonaws.com/efa": str(node.efa),
        "hugepages-2Mi": node.hugepages_2mi,
    }
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
        "resources": {
            "requests": {"cpu": node.cpu, "memory": node.memory, **devices},
            "limits": dict(devices),
        },
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
        # One pod per node follows from requesting every GPU; the selector picks the node type.
        "nodeSelector": {"node.kubernetes.io/instance-type": node.name},
        "tolerations": [
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
        "metadata": {"name": size.job_name, "namespace": namespace, "labels": _labels(TRAINER)},
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
                "metadata": {"labels": _labels(TRAINER)},
                "spec": pod_spec,
            },
        },
    }


# --- hot spares: placeholder pods that hold spare nodes ---------------------------------------


def spare_objects(*, overlay: str, namespace: str, image: str) -> list[dict]:
    """The PriorityClass and the Deployment of `overlay`'s hot spares: `spares` placeholder
    pods, each holding one whole GPU node (the trainer pod's own requests, node selector and
    tolerations, copied from the Job) with the trainer's image pulled, running `sleep`.

    A replacement trainer pod that fits on no free node preempts one (its class is below the
    trainers'), and the node is free the moment the placeholder is killed (grace 0); the
    Deployment's new placeholder then waits, Pending, for the node that repair brings back,
    and pulls the image there. Nothing else lands on a spare: the GPU nodes' NoSchedule taint
    keeps off every pod that does not tolerate it, and the placeholder holds every GPU, EFA
    interface and huge page of the node, so only a pod that may preempt it (priority above
    SPARE_PRIORITY: the training and preflight Jobs) can take its place. A spare never
    preempts anything itself (preemptionPolicy Never)."""
    size = size_of(overlay)
    job = next(
        o
        for o in job_objects(overlay=overlay, namespace=namespace, image=image)
        if o["kind"] == "Job"
    )
    pod = job["spec"]["template"]["spec"]
    (trainer,) = [c for c in pod["containers"] if c["name"] == CONTAINER]
    labels = _labels(SPARE)
    return [
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": SPARE_PRIORITY_CLASS, "labels": labels},
            "value": SPARE_PRIORITY,
            "globalDefault": False,
            "preemptionPolicy": "Never",
            "description": "Hot spare placeholders: any training pod preempts them.",
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": SPARES, "namespace": namespace, "labels": labels},
            "spec": {
                "replicas": size.spares,
                # A new image rolls one spare at a time and never needs a node more than the
                # group holds.
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
                },
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": SERVICE_ACCOUNT,
                        "priorityClassName": SPARE_PRIORITY_CLASS,
                        "terminationGracePeriodSeconds": 0,
                        "enableServiceLinks": False,
                        "nodeSelector": dict(pod["nodeSelector"]),
                        "tolerations": [dict(t) for t in pod["tolerations"]],
                        # One spare per node, stated, though every GPU request already says it.
                        "affinity": {
                            "podAntiAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": [
                                    {
                                        "labelSelector": {"matchLabels": labels},
                                        "topologyKey": "kubernetes.io/hostname",
                                    }
                                ]
                            }
                        },
                        "containers": [
                            {
                                "name": SPARE,
                                "image": image,
                                "command": list(SPARE_COMMAND),
                                "resources": {k: dict(v) for k, v in trainer["resources"].items()},
                            }
                        ],
                    },
                },
            },
        },
    ]


# --- the committed kustomize tree, generated from the builders above ---------------------------

MANIFESTS_DIR = Path(__file__).resolve().parent
BASE_OVERLAY = "smoke"  # the base carries this size; each overlay patches the differences


def placeholder_objects(*, overlay: str) -> list[dict]:
    """What `kubectl kustomize manifests/overlays/<overlay>` yields (placeholders included)."""
    return [
        *shared_objects(namespace=DEFAULT_NAMESPACE, image=PLACEHOLDER_IMAGE, **PLACEHOLDER_FSX),
        *job_objects(overlay=overlay, namespace=DEFAULT_NAMESPACE, image=PLACEHOLDER_IMAGE),
        *spare_objects(overlay=overlay, namespace=DEFAULT_NAMESPACE, image=PLACEHOLDER_IMAGE),
    ]


def to_yaml(doc: Any) -> str:
    import yaml

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # a shared labels dict is written out, not as &id001 / *id001

    def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100)
