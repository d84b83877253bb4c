"""Immutable Kubernetes fields: the Kubernetes counterpart of CloudFormation's create-only
properties, for the objects the stack applies through aws_eks_v2's kubectl custom resource.

The kubectl handler's Update runs `kubectl apply` of the new manifest (aws-cdk-lib
custom-resource-handlers, aws-eks-v2 kubectl-handler/apply); an update that changes an immutable
field is refused by the API server's update validation (422 Invalid), the custom resource fails
and CloudFormation rolls the whole stack back. So such a change cannot be deployed in place: the
object must be deleted first (`kubectl delete`), and the deploy then creates it anew
(`kubectl apply` creates a missing object).

IMMUTABLE_FIELDS lists, per kind, the fields the API server refuses to change on update, each
with the validation function that refuses it (kubernetes/kubernetes, pkg/apis/<group>/validation/
validation.go, `Validate<Kind>Update`); MUTABLE_KINDS the kinds whose update validation refuses
no spec field. A kind in neither is unknown here: `check_known` fails on it, so a new kind in the
stack's manifests is looked up before it ships.

The comparison is between the two manifests the stack applies (last deploy's and this one's),
as kubectl apply's three-way merge sends it: a field set in the old manifest and absent from the
new one is removed by the patch, so it counts as a change too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_ABSENT = object()


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return _ABSENT
        obj = obj[key]
    return obj


@dataclass(frozen=True)
class ImmutableField:
    """One field of one kind that an update may not change."""

    kind: str
    path: tuple[str, ...]
    """Keys from the object's root (`("spec", "selector")`; `("value",)` for a PriorityClass)."""
    source: str
    """The Kubernetes update validation that refuses the change."""
    changed: Callable[[Mapping[str, Any], Mapping[str, Any]], bool] | None = None
    """Whether old -> new changes the field as the API server sees it; None: the values at
    `path` differ (absent counts as a value)."""

    def is_changed(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
        if self.changed is not None:
            return self.changed(old, new)
        return _get(old, self.path) != _get(new, self.path)


def _service_cluster_ip(path: tuple[str, ...]) -> Callable[[Mapping, Mapping], bool]:
    """clusterIP/clusterIPs may not change (nor a headless `None` be unset), except when the
    type changes to or from ExternalName (API reference, ServiceSpec.clusterIP: "This field may
    not be changed through updates unless the type field is also being changed to
    ExternalName ... or the type field is being changed from ExternalName")."""

    def changed(old: Mapping, new: Mapping) -> bool:
        types = {_get(old, ("spec", "type")), _get(new, ("spec", "type"))}
        if "ExternalName" in types:
            return False
        return _get(old, path) != _get(new, path)

    return changed


def _claim_spec_changed(old: Mapping, new: Mapping) -> bool:
    """A claim's spec except `resources.requests` and `volumeAttributesClassName`
    (ValidatePersistentVolumeClaimUpdate: "spec is immutable after creation except
    resources.requests and volumeAttributesClassName for bound claims")."""

    def rest(obj: Mapping) -> dict:
        spec = dict(obj.get("spec") or {})
        spec.pop("volumeAttributesClassName", None)
        resources = dict(spec.pop("resources", None) or {})
        resources.pop("requests", None)
        return {**spec, "resources": resources}

    return rest(old) != rest(new)


def _claim_storage_shrinks(old: Mapping, new: Mapping) -> bool:
    """A smaller storage request (ValidatePersistentVolumeClaimUpdate: "field can not be less
    than status.capacity"/previous value; growth alone passes validation, and is then up to the
    PersistentVolumeClaimResize admission plugin and the StorageClass's allowVolumeExpansion)."""
    from kubernetes.utils import parse_quantity  # the client's own quantity parser

    path = ("spec", "resources", "requests", "storage")
    before, after = _get(old, path), _get(new, path)
    if before is _ABSENT or after is _ABSENT:
        return before is not after
    return parse_quantity(after) < parse_quantity(before)


def _static_claim_resized(old: Mapping, new: Mapping) -> bool:
    """A changed storage request of a claim with no StorageClass (a static claim, as the stack's
    FSx claim is): the PersistentVolumeClaimResize admission plugin, on by default, admits a
    resize only for "dynamically provisioned pvc" whose StorageClass allows expansion
    (plugin/pkg/admission/storage/persistentvolume/resize)."""
    path = ("spec", "resources", "requests", "storage")
    static = _get(old, ("spec", "storageClassName")) in ("", None, _ABSENT)
    return static and _get(old, path) != _get(new, path)


def _pv_node_affinity_changed(old: Mapping, new: Mapping) -> bool:
    """A volume's node affinity may be set once, never changed (ValidatePersistentVolumeUpdate;
    changing it needs the MutablePVNodeAffinity feature gate, alpha and off)."""
    before = _get(old, ("spec", "nodeAffinity"))
    return before is not _ABSENT and before != _get(new, ("spec", "nodeAffinity"))


def _immutable_data(old: Mapping, new: Mapping) -> bool:
    """With `immutable: true` a ConfigMap's or Secret's data is fixed, and `immutable` cannot be
    unset (ValidateConfigMapUpdate / ValidateSecretUpdate: "field is immutable when `immutable`
    is set")."""
    if old.get("immutable") is not True:
        return False
    fields = ("immutable", "data", "binaryData", "stringData")
    return any(old.get(f) != new.get(f) for f in fields)


def _with_default(path: tuple[str, ...], default: Any) -> Callable[[Mapping, Mapping], bool]:
    """The field differs once an absent value reads as the server's default (the stored object
    holds the default, so setting it explicitly is no change)."""

    def value(obj: Mapping) -> Any:
        found = _get(obj, path)
        return default if found is _ABSENT else found

    return lambda old, new: value(old) != value(new)


def _job_completions_changed(old: Mapping, new: Mapping) -> bool:
    """A Job's completions may not change, except for an Indexed Job whose new completions equal
    its new parallelism (elastic Indexed Jobs; pkg/apis/batch/validation validateCompletions:
    "can only be modified in tandem with spec.parallelism")."""
    before, after = _get(old, ("spec", "completions")), _get(new, ("spec", "completions"))
    if before == after:
        return False
    indexed = _get(new, ("spec", "completionMode")) == "Indexed"
    return not (indexed and after == _get(new, ("spec", "parallelism")))


_CORE = "pkg/apis/core/validation/validation.go"
_APPS = "pkg/apis/apps/validation/validation.go"
_BATCH = "pkg/apis/batch/validation/validation.go"
_RBAC = "pkg/apis/rbac/validation/validation.go"
_SCHEDULING = "pkg/apis/scheduling/validation/validation.go"
_STORAGE = "pkg/apis/storage/validation/validation.go"

IMMUTABLE_FIELDS: tuple[ImmutableField, ...] = (
    ImmutableField("PriorityClass", ("value",), f"{_SCHEDULING} ValidatePriorityClassUpdate"),
    ImmutableField(
        "PriorityClass",
        ("preemptionPolicy",),
        f"{_SCHEDULING} ValidatePriorityClassUpdate",
        # Unset defaults to PreemptLowerPriority (pkg/apis/scheduling/v1 defaults.go).
        _with_default(("preemptionPolicy",), "PreemptLowerPriority"),
    ),
    ImmutableField(
        "Service",
        ("spec", "clusterIP"),
        f"{_CORE} ValidateServiceUpdate",
        _service_cluster_ip(("spec", "clusterIP")),
    ),
    ImmutableField(
        "Service",
        ("spec", "clusterIPs"),
        f"{_CORE} ValidateServiceUpdate",
        _service_cluster_ip(("spec", "clusterIPs")),
    ),
    # apps/v1: the selector is refused by the registry's strategy, not by Validate*Update (which
    # still admits it for extensions/v1beta1): pkg/registry/apps/<kind>/strategy.go
    # ValidateUpdate, "disallow mutation of selector" for every group version but the old beta
    # ones ("Label selector updates", kubernetes.io/docs/concepts/workloads/controllers/deployment).
    ImmutableField(
        "Deployment",
        ("spec", "selector"),
        "pkg/registry/apps/deployment/strategy.go ValidateUpdate",
    ),
    ImmutableField(
        "DaemonSet", ("spec", "selector"), "pkg/registry/apps/daemonset/strategy.go ValidateUpdate"
    ),
    ImmutableField(
        "ReplicaSet",
        ("spec", "selector"),
        "pkg/registry/apps/replicaset/strategy.go ValidateUpdate",
    ),
    # A StatefulSet's spec is immutable but for replicas, ordinals, template, updateStrategy,
    # revisionHistoryLimit, persistentVolumeClaimRetentionPolicy and minReadySeconds.
    *(
        ImmutableField("StatefulSet", ("spec", f), f"{_APPS} ValidateStatefulSetUpdate")
        for f in ("selector", "serviceName", "volumeClaimTemplates", "podManagementPolicy")
    ),
    # A Job's pod template is immutable (except a few scheduling directives of a suspended Job
    # that never ran, which the stack never relies on); so are its selector, completion mode,
    # failure and success policies and per-index backoff.
    *(
        ImmutableField("Job", ("spec", f), f"{_BATCH} ValidateJobSpecUpdate")
        for f in (
            "selector",
            "template",
            "completionMode",
            "podFailurePolicy",
            "successPolicy",
            "backoffLimitPerIndex",
            "managedBy",
        )
    ),
    ImmutableField(
        "Job", ("spec", "completions"), f"{_BATCH} validateCompletions", _job_completions_changed
    ),
    # The volume source (every PersistentVolumeSource member) and the volume mode; capacity,
    # access modes, class, mount options and reclaim policy may change.
    *(
        ImmutableField("PersistentVolume", ("spec", f), f"{_CORE} ValidatePersistentVolumeUpdate")
        for f in (
            *("awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "csi", "fc"),
            *("flexVolume", "flocker", "gcePersistentDisk", "glusterfs", "hostPath", "iscsi"),
            *("local", "nfs", "photonPersistentDisk", "portworxVolume", "quobyte", "rbd"),
            *("scaleIO", "storageos", "vsphereVolume", "volumeMode"),
        )
    ),
    ImmutableField(
        "PersistentVolume",
        ("spec", "nodeAffinity"),
        f"{_CORE} ValidatePersistentVolumeUpdate",
        _pv_node_affinity_changed,
    ),
    ImmutableField(
        "PersistentVolumeClaim",
        ("spec",),
        f"{_CORE} ValidatePersistentVolumeClaimUpdate",
        _claim_spec_changed,
    ),
    ImmutableField(
        "PersistentVolumeClaim",
        ("spec", "resources", "requests", "storage"),
        f"{_CORE} ValidatePersistentVolumeClaimUpdate",
        _claim_storage_shrinks,
    ),
    ImmutableField(
        "PersistentVolumeClaim",
        ("spec", "resources", "requests", "storage"),
        "plugin/pkg/admission/storage/persistentvolume/resize (PersistentVolumeClaimResize)",
        _static_claim_resized,
    ),
    *(
        ImmutableField("StorageClass", (f,), f"{_STORAGE} ValidateStorageClassUpdate")
        for f in ("provisioner", "parameters", "reclaimPolicy", "volumeBindingMode")
    ),
    ImmutableField("RoleBinding", ("roleRef",), f"{_RBAC} ValidateRoleBindingUpdate"),
    ImmutableField("ClusterRoleBinding", ("roleRef",), f"{_RBAC} ValidateClusterRoleBindingUpdate"),
    ImmutableField("ConfigMap", ("data",), f"{_CORE} ValidateConfigMapUpdate", _immutable_data),
    ImmutableField("Secret", ("data",), f"{_CORE} ValidateSecretUpdate", _immutable_data),
    # ValidateSecretUpdate: `type` "field is immutable"; unset defaults to Opaque
    # (pkg/apis/core/v1 defaults.go SetDefaults_Secret).
    ImmutableField(
        "Secret", ("type",), f"{_CORE} ValidateSecretUpdate", _with_default(("type",), "Opaque")
    ),
)

MUTABLE_KINDS: Mapping[str, str] = {
    "Namespace": f"{_CORE} ValidateNamespaceUpdate (spec.finalizers only via /finalize)",
    "ServiceAccount": f"{_CORE} ValidateServiceAccountUpdate",
    "ConfigMap": f"{_CORE} ValidateConfigMapUpdate (mutable unless immutable: true)",
    "Secret": f"{_CORE} ValidateSecretUpdate (mutable unless immutable: true)",
    "PodDisruptionBudget": "pkg/apis/policy/validation ValidatePodDisruptionBudgetUpdate "
    "(policy/v1: every spec field may change)",
    "NetworkPolicy": "pkg/apis/networking/validation ValidateNetworkPolicyUpdate",
    "Role": f"{_RBAC} ValidateRoleUpdate",
    "ClusterRole": f"{_RBAC} ValidateClusterRoleUpdate",
    "ValidatingAdmissionPolicy": "pkg/apis/admissionregistration/validation "
    "ValidateValidatingAdmissionPolicyUpdate (validates the new spec only)",
    "ValidatingAdmissionPolicyBinding": "pkg/apis/admissionregistration/validation "
    "ValidateValidatingAdmissionPolicyBindingUpdate (validates the new spec only)",
}
"""Kinds with no immutable spec field (name and namespace are immutable for every kind; a
changed name is a delete plus a create in infra/replacements.py already)."""

KNOWN_KINDS = frozenset({f.kind for f in IMMUTABLE_FIELDS} | set(MUTABLE_KINDS))


def changed_immutable_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, ...]:
    """The immutable fields that `old` -> `new` (two manifests of one object) changes, each as
    `<field> is immutable`, with the command that makes the change deployable; () if none."""
    kind = new.get("kind") or old.get("kind")
    changed = [f for f in IMMUTABLE_FIELDS if f.kind == kind and f.is_changed(old, new)]
    if not changed:
        return ()
    meta = new.get("metadata", {})
    where = f" -n {meta['namespace']}" if meta.get("namespace") else ""
    delete = f"kubectl delete {str(kind).lower()} {meta.get('name')}{where}"
    volume = _get(old, ("spec", "volumeName"))
    if kind == "PersistentVolumeClaim" and isinstance(volume, str) and volume:
        # A retained volume keeps its old claim's reference and binds no new claim: its object
        # goes too (the storage behind it stays; the deploy creates both again).
        delete += f" && kubectl delete persistentvolume {volume}"
    paths = dict.fromkeys(".".join(f.path) for f in changed)
    how = f"delete it first: {delete}"
    if kind == "PersistentVolumeClaim":
        # A claim a pod uses stays Terminating until the pod is gone (the
        # kubernetes.io/pvc-protection finalizer: Kubernetes docs, Persistent Volumes,
        # "Storage Object in Use Protection"), so the delete would hang behind the Job.
        how = (
            "stop the Job that mounts it first (make eks-stop: a claim in use stays Terminating, "
            f"the kubernetes.io/pvc-protection finalizer), then delete it: {delete}"
        )
    return (*(f"{p} is immutable" for p in paths), how)


def check_known(kinds: Iterable[str]) -> None:
    """Raise ValueError naming every kind this module has not looked up."""
    unknown = sorted(set(kinds) - KNOWN_KINDS)
    if unknown:
        raise ValueError(
            f"infra/k8s_immutable.py does not know the kinds {', '.join(unknown)}: add their "
            "immutable fields (IMMUTABLE_FIELDS) or list them in MUTABLE_KINDS, with the "
            "Kubernetes update validation as the source"
        )
