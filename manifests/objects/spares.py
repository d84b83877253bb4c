"""An overlay's hot spares: placeholder pods that hold spare GPU nodes, and the trainer's
permission to count them."""

from __future__ import annotations

from manifests.objects.common import SERVICE_ACCOUNT, TRAINER, labels, priority_class, size_of
from manifests.objects.job import pod_placement

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
SPARE_READER = "fsdp-trainer-spares"
"""The Role and RoleBinding that let a trainer pod count the Ready hot spares."""


def spare_reader_objects(*, namespace: str) -> list[dict]:
    """``list`` on the pods of the Job's own namespace: before the straggler policy evicts a
    node, rank 0 counts the Ready hot spares (`ops.cordon.ready_spares`); with none, the
    eviction waits (an evicted pod's replacement would stay Pending and park the job until the
    rendezvous' join timeout). Read-only, one namespace."""
    meta = {"name": SPARE_READER, "namespace": namespace, "labels": labels(TRAINER)}
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


def spare_objects(*, overlay: str, namespace: str, image: str) -> list[dict]:
    """The PriorityClass and the Deployment of `overlay`'s hot spares: `spares` placeholder
    pods, each holding one whole GPU node (the trainer pod's own requests, node selector and
    tolerations: `pod_placement`) with the trainer's image pulled, running `sleep`.

    A replacement trainer pod that fits on no free node preempts one (its class is below the
    trainers'), and the node is free the moment the placeholder is killed (grace 0); the
    Deployment's new placeholder then waits, Pending, for the node that repair brings back,
    and pulls the image there. Nothing else lands on a spare: the GPU nodes' NoSchedule taint
    keeps off every pod that does not tolerate it, and the placeholder holds every GPU, EFA
    interface and huge page of the node, so only a pod that may preempt it (priority above
    SPARE_PRIORITY: the training and preflight Jobs) can take its place. A spare never
    preempts anything itself (preemptionPolicy Never)."""
    size = size_of(overlay)
    placement = pod_placement(size)
    spare_labels = labels(SPARE)
    return [
        priority_class(
            name=SPARE_PRIORITY_CLASS,
            component=SPARE,
            value=SPARE_PRIORITY,
            preemption_policy="Never",
            description="Hot spare placeholders: any training pod preempts them.",
        ),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": SPARES, "namespace": namespace, "labels": spare_labels},
            "spec": {
                "replicas": size.spares,
                # A new image rolls one spare at a time and never needs a node more than the
                # group holds.
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
                },
                "selector": {"matchLabels": spare_labels},
                "template": {
                    "metadata": {"labels": spare_labels},
                    "spec": {
                        "serviceAccountName": SERVICE_ACCOUNT,
                        "priorityClassName": SPARE_PRIORITY_CLASS,
                        "terminationGracePeriodSeconds": 0,
                        "enableServiceLinks": False,
                        "nodeSelector": placement.node_selector,
                        "tolerations": placement.tolerations,
                        # One spare per node, stated, though every GPU request already says it.
                        "affinity": {
                            "podAntiAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": [
                                    {
                                        "labelSelector": {"matchLabels": spare_labels},
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
                                "resources": placement.resources,
                            }
                        ],
                    },
                },
            },
        },
    ]
