"""The trainer's one write permission on the cluster: cordoning its own node (a ClusterRole, its
binding, and the admission policy that narrows it)."""

from __future__ import annotations

from manifests.objects.common import SERVICE_ACCOUNT, TRAINER, labels
from ops.cordon import REASONS, UNFIT_LABEL

NODE_CORDON = "fsdp-trainer-cordon"
"""The ClusterRole, its binding and the admission policy that let a trainer pod cordon its node."""
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
"""The user-info extra that the API server adds for a pod-bound ServiceAccount token: the pod's
node (k8s.io/apiserver ``serviceaccount.NodeNameKey``; GA with ServiceAccountTokenPodNodeInfo
in 1.32)."""


def node_cordon_objects(*, namespace: str) -> list[dict]:
    """The trainer's one permission on the cluster: cordoning the node its pod runs on, when the
    straggler policy evicts that node (`ops.cordon.cordon`), so the Job's replacement
    lands elsewhere.

    RBAC cannot say which node or which field: a ClusterRole grants ``patch`` on every Node
    (nodes are cluster-scoped, and node names are unknown when this is rendered). No ``get``
    or ``list``: the cordon is one PATCH. A ValidatingAdmissionPolicy (admissionregistration
    v1, GA in 1.30) narrows it: a node update by this ServiceAccount is admitted only when it
    is the caller's own node (the token's ``node-name`` extra) and it sets
    ``spec.unschedulable`` to true with the product's unfit label (``ops.cordon.UNFIT_LABEL``,
    one of its reasons: what tells the node fencer this cordon is the product's) and changes no
    other label, no annotation, taint or other spec field. ``nodes/status`` is another resource
    and is not granted."""
    user = f"system:serviceaccount:{namespace}:{SERVICE_ACCOUNT}"
    trainer_labels = labels(TRAINER)

    def same(path: str, empty: str) -> str:
        return (
            f"(has(object.{path}) ? object.{path} : {empty}) == "
            f"(has(oldObject.{path}) ? oldObject.{path} : {empty})"
        )

    # Every writable Node spec field but `unschedulable` (`configSource` is gone with dynamic
    # kubelet configuration, 1.24).
    spec_fields = {"podCIDR": "''", "podCIDRs": "[]", "providerID": "''", "taints": "[]"}
    new_labels = "(has(object.metadata.labels) ? object.metadata.labels : {})"
    old_labels = "(has(oldObject.metadata.labels) ? oldObject.metadata.labels : {})"
    reasons = "[" + ", ".join(f"'{r}'" for r in REASONS) + "]"
    # Every label but the unfit one as it was: none added, changed or removed (`all` over a
    # map iterates its keys, cel-spec "Macros").
    other_labels_kept = (
        f"{new_labels}.all(k, k == '{UNFIT_LABEL}' || "
        f"(k in {old_labels} && {old_labels}[k] == {new_labels}[k])) && "
        f"{old_labels}.all(k, k == '{UNFIT_LABEL}' || k in {new_labels})"
    )
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NODE_CORDON, "labels": trainer_labels},
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NODE_CORDON, "labels": trainer_labels},
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
            "metadata": {"name": NODE_CORDON, "labels": trainer_labels},
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
                            "has(object.spec.unschedulable) && object.spec.unschedulable && "
                            f"'{UNFIT_LABEL}' in {new_labels} && "
                            f"{new_labels}['{UNFIT_LABEL}'] in {reasons}"
                        ),
                        "message": (
                            "a trainer pod may only set spec.unschedulable to true, with the "
                            f"label {UNFIT_LABEL}=<{'|'.join(REASONS)}>"
                        ),
                    },
                    {
                        "expression": " && ".join(
                            [
                                other_labels_kept,
                                same("metadata.annotations", "{}"),
                                same("metadata.ownerReferences", "[]"),
                                same("metadata.finalizers", "[]"),
                                *(
                                    same(f"spec.{name}", empty)
                                    for name, empty in spec_fields.items()
                                ),
                            ]
                        ),
                        "message": (
                            "a trainer pod may change no field but spec.unschedulable and "
                            f"the {UNFIT_LABEL} label"
                        ),
                    },
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": NODE_CORDON, "labels": trainer_labels},
            "spec": {"policyName": NODE_CORDON, "validationActions": ["Deny"]},
        },
    ]
