"""Cluster actions a trainer pod takes on its own node, through the Kubernetes API.

Two calls: :func:`ready_spares` (how many hot spares could take an evicted node's place now)
and :func:`cordon`, what ``kubectl cordon NODE`` does (kubernetes.io, "Safely Drain a
Node" and the ``kubectl cordon`` reference): ``spec.unschedulable: true`` on the Node, so the
scheduler places no new pod there (its ``NodeUnschedulable`` filter plugin,
kubernetes.io "Scheduling Framework" / "Scheduler Configuration"). The pod supervisor
(``training.launch.pod``) cordons a node the straggler policy evicted before its pod ends, so
the Job's replacement lands elsewhere (a spare, when there is one).

The client is the ``kubernetes`` package with its in-cluster configuration: the pod's
ServiceAccount token and CA that the kubelet mounts at
``/var/run/secrets/kubernetes.io/serviceaccount`` and the API server's address in
``KUBERNETES_SERVICE_HOST``/``_PORT`` (kubernetes.io, "Accessing the Kubernetes API from a
Pod"). The permission is the ``fsdp-trainer`` ServiceAccount's ``patch`` on nodes, narrowed by a
ValidatingAdmissionPolicy to this one field on the caller's own node
(``manifests/objects/cordon.py``, ``node_cordon_objects``).

A cordon that fails (no API, no permission, a refusal) is a warning: the eviction goes on, and
the replacement may then land on the same node. Torch-free; the client is imported only here.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

UNFIT_LABEL = "eks-fsdp-resilient/unfit"
"""The label that says *the product* cordoned this node, and why (one of `REASONS`). The node
fencer (infra/fencer) replaces a node that carries it and is still cordoned once no training pod
runs there; a node a person cordoned (``kubectl cordon``: no label) is never acted on, and a
person keeps a marked node by uncordoning it or removing the label. One owner: the admission
policy (manifests/objects/cordon.py) and the fencer's Deployment (infra/node_fencer.py) read it
here. A label, not an annotation, so ``kubectl get nodes -l eks-fsdp-resilient/unfit`` lists them;
its prefix is no ``kubernetes.io``/``k8s.io`` one (kubernetes.io "Well-Known Labels": reserved)."""
STARTUP_CHECK = "startup-check"
"""Reason: the start-up check found this node's own fault (``NODE_UNFIT``: GPUs, driver, EFA,
a /fsx write that fails or hangs, i.e. the node's Lustre mount)."""
STRAGGLER = "straggler"
"""Reason: the straggler policy evicted this node (``training.launch.pod``)."""
REASONS = (STARTUP_CHECK, STRAGGLER)
"""The reasons a trainer pod may set (the admission policy admits exactly these)."""
LUSTRE_MOUNT = "lustre-mount"
"""Reason: the trainer pod's FSx for Lustre volume never mounted on this node (kubelet
``FailedMount`` for ``FENCER.lustre_mount_s``): set by the node fencer (infra/fencer), not by a
trainer pod, whose container never started there."""
FENCER_REASONS = (LUSTRE_MOUNT,)
"""The reasons the node fencer sets, with its own identity (not the trainer's admission policy)."""


def cordon_patch(reason: str) -> dict[str, Any]:
    """The whole request body: ``kubectl cordon``'s field (``spec.unschedulable: true``) and the
    product's label, in one request, so a node is never marked without being cordoned."""
    if reason not in (*REASONS, *FENCER_REASONS):
        known = ", ".join((*REASONS, *FENCER_REASONS))
        raise ValueError(f"reason: {reason!r}; give one of {known}")
    return {"spec": {"unschedulable": True}, "metadata": {"labels": {UNFIT_LABEL: reason}}}


API_TIMEOUT_S = 10.0
"""One request's connect + read timeout: a pod being evicted does not wait on a slow API."""


SPARE_SELECTOR = (
    "app.kubernetes.io/name=fsdp-train,app.kubernetes.io/component=spare,"
    "app.kubernetes.io/part-of=eks-fsdp-resilient"
)
"""The hot spares' pods (``manifests/objects/spares.py``, ``spare_objects``: the ``fsdp-spares``
Deployment's pod labels; tests/training/resilience/test_straggler_spares.py pins the two)."""
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
"""The pod's namespace, mounted with its ServiceAccount token (kubernetes.io, "Accessing the
Kubernetes API from a Pod": "the namespace ... is placed in ... serviceaccount/namespace")."""


class NodeApi(Protocol):
    """The calls of ``kubernetes.client.CoreV1Api`` used here."""

    def patch_node(self, name: str, body: Any, **kwargs: Any) -> Any: ...

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> Any: ...


def in_cluster() -> bool:
    """True in a pod (the kubelet sets ``KUBERNETES_SERVICE_HOST`` in every container)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def _pod_ready(pod: Any) -> bool:
    conditions = (getattr(pod, "status", None) and pod.status.conditions) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def ready_spares(*, api: NodeApi | None = None, namespace: str | None = None) -> int | None:
    """Hot spare pods that are Ready now (each holds a joined GPU node with the image pulled;
    the scheduler preempts one for a replacement trainer pod, kubernetes.io "Pod Priority and
    Preemption"). None when it cannot be known (no API, no permission): a warning on stderr.
    A spare being deleted (``deletionTimestamp``) is already going to someone else."""
    try:
        if namespace is None:
            with open(NAMESPACE_FILE) as handle:
                namespace = handle.read().strip()
        pods = (api or in_cluster_node_api()).list_namespaced_pod(
            namespace, label_selector=SPARE_SELECTOR, _request_timeout=API_TIMEOUT_S
        )
    except Exception as err:  # any failure: the caller decides without the count
        print(
            f"warning: spares: the ready hot spares could not be counted ({type(err).__name__}: "
            f"{str(err)[:300]})",
            file=sys.stderr,
            flush=True,
        )
        return None
    return sum(
        1
        for pod in pods.items
        if _pod_ready(pod) and getattr(pod.metadata, "deletion_timestamp", None) is None
    )


def in_cluster_node_api() -> NodeApi:
    """``CoreV1Api`` with the pod's in-cluster configuration (raises ``ConfigException`` when
    the pod has no token or no API server address)."""
    from kubernetes import client, config

    config.load_incluster_config()
    return client.CoreV1Api()


def cordon(node: str, *, reason: str, api: NodeApi | None = None) -> bool:
    """Mark `node` unschedulable and unfit for `reason` (`cordon_patch`). True when the API
    server accepted it; False (and a warning on stderr) when it could not be done, which never
    stops the caller."""
    body = cordon_patch(reason)
    if not node:
        print("warning: cordon: this pod does not know its node (NODE_NAME)", file=sys.stderr)
        return False
    try:
        (api or in_cluster_node_api()).patch_node(node, body, _request_timeout=API_TIMEOUT_S)
    except Exception as err:  # any failure: the eviction goes on without the cordon
        print(
            f"warning: cordon: node {node} was not cordoned ({type(err).__name__}: "
            f"{str(err)[:300]}); a replacement pod may land on it again",
            file=sys.stderr,
            flush=True,
        )
        return False
    print(
        f"cordoned node {node} (spec.unschedulable=true, {UNFIT_LABEL}={reason}): the node "
        "fencer replaces it once no training pod runs there",
        file=sys.stderr,
        flush=True,
    )
    return True
