"""The rendezvous store every training Job's launchers meet in: a one-replica TCPStore with its
PriorityClass, Deployment, disruption budget, NetworkPolicy and Service."""

from __future__ import annotations

from manifests.objects.common import SERVICE_ACCOUNT, TRAINER, labels, priority_class

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
STORE = "rdzv-store"
"""The store's component label."""


def rdzv_store_objects(*, namespace: str, image: str) -> list[dict]:
    """A one-replica TCPStore on the system nodes (never on a GPU node, so a lost training node
    cannot take it along), its Service, which every launcher joins as a client, and what keeps
    it single, in place and private (see each object)."""
    store_labels = labels(STORE)
    return [
        # Scheduler preemption and the kubelet's node-pressure eviction both rank pods by
        # priority: with a class above the trainers' (0), the store is neither preempted for nor
        # evicted before a training pod (kubernetes.io/docs: "Pod Priority and Preemption";
        # "Node-pressure Eviction", which ranks by usage over requests, then priority).
        priority_class(
            name=RDZV_PRIORITY_CLASS,
            component=STORE,
            value=RDZV_PRIORITY,
            preemption_policy="PreemptLowerPriority",
            description="The training jobs' rendezvous store: every running launcher needs it.",
        ),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": RDZV_STORE, "namespace": namespace, "labels": store_labels},
            "spec": {
                "replicas": 1,
                # The old pod goes before the new one starts: a RollingUpdate would serve two
                # independent stores behind one Service for a while, and launchers that meet
                # in different stores never form one rendezvous.
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": store_labels},
                "template": {
                    "metadata": {"labels": store_labels},
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
            "metadata": {"name": RDZV_STORE, "namespace": namespace, "labels": store_labels},
            "spec": {
                "minAvailable": 1,
                "selector": {"matchLabels": store_labels},
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
            "metadata": {"name": RDZV_STORE, "namespace": namespace, "labels": store_labels},
            "spec": {
                "podSelector": {"matchLabels": store_labels},
                "policyTypes": ["Ingress", "Egress"],
                "egress": [],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": labels(TRAINER)}}],
                        "ports": [{"protocol": "TCP", "port": RDZV_STORE_PORT}],
                    }
                ],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": RDZV_STORE, "namespace": namespace, "labels": store_labels},
            "spec": {
                "selector": store_labels,
                "ports": [{"name": "rdzv", "port": RDZV_STORE_PORT, "targetPort": RDZV_STORE_PORT}],
            },
        },
    ]
