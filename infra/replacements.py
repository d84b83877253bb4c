"""What CloudFormation would replace: two synthesized templates in, a list of changes out.

Offline stand-in for the replacement column of `cdk diff` (which needs AWS): a resource is
replaced when

- a create-only property changes (`createOnlyProperties` of the resource type's schema, as
  cfn-lint ships it: `cfnlint.schema.PROVIDER_SCHEMA_MANAGER`; no hand-kept list), counting a
  value that changes because it refers (Ref, Fn::GetAtt, Fn::Sub) to a replaced resource;
- its logical id disappears (a changed logical id is a delete plus a create).

The Kubernetes objects that aws_eks_v2 applies through its kubectl custom resource
(`Custom::AWSCDK-EKS-KubernetesResource`) have no schema: the kubectl handler's Update runs
`kubectl apply` of the new manifest (aws-cdk-lib custom-resource-handlers, aws-eks-v2
kubectl-handler/apply), so each object is compared on its own: a PersistentVolume or claim whose
spec changes cannot be applied (their source and binding are immutable), and a Deployment whose
pod template changes restarts its pods.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from infra import k8s_immutable

# Resources that hold state a replacement loses or strands: checkpoints (FSx), the control plane
# and everything in it (cluster), running nodes (node groups), images (ECR), encryption keys.
STATEFUL_TYPES: Mapping[str, str] = {
    "AWS::FSx::FileSystem": "FSx file system",
    "AWS::EKS::Cluster": "EKS cluster",
    "AWS::EKS::Nodegroup": "node group",
    "AWS::ECR::Repository": "ECR repository",
    "AWS::KMS::Key": "KMS key",
    # Not data, but a loss nobody would notice: the file system's S3 link (imports/exports stop)
    # and the on-call address (a new subscription must be confirmed from the mailbox again).
    "AWS::FSx::DataRepositoryAssociation": "FSx S3 link",
    "AWS::SNS::Subscription": "alert subscription",
}
MANIFEST_TYPE = "Custom::AWSCDK-EKS-KubernetesResource"
# Kubernetes objects whose change or removal loses state: the claim on the file system (and its
# volume), and a namespace (deleting it deletes everything in it).
STATEFUL_KINDS = ("PersistentVolume", "PersistentVolumeClaim", "Namespace")
# Objects whose pod template change restarts running pods.
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")

# Attributes that change when a resource is updated in place (not only when it is replaced).
VERSION_ATTRIBUTES = ("LatestVersionNumber", "DefaultVersionNumber")

Action = Literal["replace", "remove", "add", "update"]


@dataclass(frozen=True)
class Change:
    """One resource (or Kubernetes object) that a deploy would touch."""

    logical_id: str
    """CloudFormation logical id; `<id>/<Kind>/<name>` for a Kubernetes object."""
    type: str
    """CloudFormation type, or the Kubernetes kind."""
    action: Action
    reasons: tuple[str, ...] = ()
    """Why: the create-only properties that changed, `logical id`, `pod template`, `spec`."""
    stateful: bool = False
    """A replacement or removal of this loses or strands state (see STATEFUL_TYPES/KINDS)."""

    @property
    def destructive(self) -> bool:
        """Replaced or removed (an update of a stateful Kubernetes object counts: it cannot be
        applied in place)."""
        if self.type in STATEFUL_KINDS:
            return self.action in ("replace", "remove", "update")
        return self.action in ("replace", "remove")

    def line(self) -> str:
        why = f" ({', '.join(self.reasons)})" if self.reasons else ""
        if self.type == "AWS::EC2::LaunchTemplate" and self.action == "update":
            # A new template version makes EKS replace every node of the node group that uses
            # it (EKS user guide, managed-node-update-behavior.html): running pods are drained.
            why += " -> its node group's nodes are replaced, one at a time"
        mark = "!" if self.stateful and self.destructive else " "
        return f"{mark} {self.action:<7} {self.logical_id} [{self.type}]{why}"


@cache
def create_only_paths(resource_type: str, region: str) -> tuple[tuple[str, ...], ...]:
    """The create-only property paths of `resource_type` (each a tuple of keys below
    Properties), from the schema cfn-lint ships; () for a type without a schema (custom)."""
    from cfnlint.schema import PROVIDER_SCHEMA_MANAGER

    try:
        schema = PROVIDER_SCHEMA_MANAGER.get_resource_schema(region, resource_type).schema
    except Exception:  # cfn-lint raises ResourceNotFoundError for custom and unknown types
        return ()
    paths = []
    for pointer in schema.get("createOnlyProperties", []):
        parts = pointer.split("/")[2:]  # "/properties/A/B" -> ["A", "B"]
        # A path through a list ("*"): compare the whole list.
        if "*" in parts:
            parts = parts[: parts.index("*")]
        paths.append(tuple(parts))
    return tuple(paths)


def _get(value: Any, path: Iterable[str]) -> Any:
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _flatten(value: Any, replaced: frozenset[str]) -> Any:
    """Intrinsics as comparable text: a reference to a replaced resource becomes a different
    text, since its physical id or attribute changes with the replacement."""

    def mark(target: str) -> str:
        return "~replaced" if target in replaced else ""

    if isinstance(value, dict) and len(value) == 1:
        ((key, arg),) = value.items()
        if key == "Ref" and isinstance(arg, str):
            return f"${{{arg}{mark(arg)}}}"
        if key == "Fn::GetAtt" and isinstance(arg, list) and arg:
            return f"${{{arg[0]}.{arg[1]}{mark(arg[0]) or mark(f'{arg[0]}.{arg[1]}')}}}"
        if key == "Fn::Join" and isinstance(arg, list) and len(arg) == 2:
            parts = [_flatten(p, replaced) for p in arg[1]]
            if all(isinstance(p, str) for p in parts):
                return str(arg[0]).join(parts)
            return {"Fn::Join": [arg[0], parts]}
        if key == "Fn::Sub":
            text = arg if isinstance(arg, str) else arg[0]
            for target in replaced:
                if "${" + target + "}" in text or "${" + target + "." in text:
                    text += f"~{target}~replaced"
            if not isinstance(arg, str):
                text += json.dumps(_flatten(arg[1], replaced), sort_keys=True)
            return text
    if isinstance(value, dict):
        return {k: _flatten(v, replaced) for k, v in value.items()}
    if isinstance(value, list):
        return [_flatten(v, replaced) for v in value]
    return value


def _kubernetes_objects(resource: Mapping[str, Any], replaced: frozenset[str]) -> dict:
    """The objects of one kubectl manifest resource, keyed by (kind, namespace, name)."""
    manifest = _flatten(resource.get("Properties", {}).get("Manifest"), replaced)
    if not isinstance(manifest, str):
        return {}
    objects = json.loads(manifest)
    return {
        (o.get("kind"), o.get("metadata", {}).get("namespace", ""), o["metadata"]["name"]): o
        for o in objects
    }


def _kubernetes_changes(
    logical_id: str, before: Mapping, after: Mapping, replaced: frozenset[str]
) -> list[Change]:
    old = _kubernetes_objects(before, frozenset())
    new = _kubernetes_objects(after, replaced)
    changes = []
    for key in sorted(old.keys() | new.keys(), key=str):
        kind, _, name = key
        oid = f"{logical_id}/{kind}/{name}"
        stateful = kind in STATEFUL_KINDS
        if key not in new:
            changes.append(Change(oid, kind, "remove", stateful=stateful))
        elif key not in old:
            changes.append(Change(oid, kind, "add"))
        elif immutable := k8s_immutable.changed_immutable_fields(old[key], new[key]):
            # kubectl apply would fail (and roll the stack back): refused like a replacement.
            changes.append(Change(oid, kind, "replace", immutable, stateful=True))
        elif old[key] != new[key]:
            reasons = tuple(
                field
                for field in ("spec", "data", "metadata")
                if old[key].get(field) != new[key].get(field)
            )
            if kind in WORKLOAD_KINDS and _get(old[key], ("spec", "template")) != _get(
                new[key], ("spec", "template")
            ):
                reasons = ("pod template", *reasons)
            changes.append(Change(oid, kind, "update", reasons, stateful=stateful))
    return changes


def diff(before: Mapping[str, Any], after: Mapping[str, Any], *, region: str) -> list[Change]:
    """Every resource a deploy of `after` over a stack holding `before` would touch."""
    old = before.get("Resources", {})
    new = after.get("Resources", {})
    replaced: set[str] = {lid for lid in old if lid not in new}  # a changed logical id too
    # Replacements propagate through references: iterate until no new one appears.
    while True:
        frozen = frozenset(replaced)
        grown = False
        for lid in old.keys() & new.keys():
            if lid in replaced:
                continue
            rtype = new[lid].get("Type", "")
            if old[lid].get("Type") != rtype:
                replaced.add(lid)
                grown = True
                continue
            props_old = _flatten(old[lid].get("Properties", {}), frozenset())
            props_new = _flatten(new[lid].get("Properties", {}), frozen)
            for path in create_only_paths(rtype, region):
                if _get(props_old, path) != _get(props_new, path):
                    replaced.add(lid)
                    grown = True
                    break
        if not grown:
            break
    # An updated launch template gets a new version number: what uses it is updated too.
    new_versions = {
        f"{lid}.{attribute}"
        for lid in old.keys() & new.keys()
        if new[lid].get("Type") == "AWS::EC2::LaunchTemplate"
        and _flatten(old[lid].get("Properties"), frozenset())
        != _flatten(new[lid].get("Properties"), frozenset(replaced))
        for attribute in VERSION_ATTRIBUTES
    }
    frozen = frozenset(replaced | new_versions)
    changes: list[Change] = []
    for lid in sorted(old.keys() | new.keys()):
        rtype = (new.get(lid) or old.get(lid) or {}).get("Type", "")
        stateful = rtype in STATEFUL_TYPES
        if lid not in new:
            changes.append(Change(lid, rtype, "remove", ("logical id",), stateful))
            continue
        if lid not in old:
            changes.append(Change(lid, rtype, "add"))
            continue
        if rtype == MANIFEST_TYPE and lid not in replaced:
            changes += _kubernetes_changes(lid, old[lid], new[lid], frozen)
            continue
        props_old = _flatten(old[lid].get("Properties", {}), frozenset())
        props_new = _flatten(new[lid].get("Properties", {}), frozen)
        if lid in replaced:
            reasons = tuple(
                "/".join(path)
                for path in create_only_paths(rtype, region)
                if _get(props_old, path) != _get(props_new, path)
            )
            changes.append(Change(lid, rtype, "replace", reasons or ("type",), stateful))
            if rtype == MANIFEST_TYPE:  # every object deleted and created again
                changes += [
                    Change(f"{lid}/{k[0]}/{k[2]}", k[0], "remove", stateful=k[0] in STATEFUL_KINDS)
                    for k in _kubernetes_objects(old[lid], frozenset())
                ]
        elif props_old != props_new:
            changed = tuple(
                sorted(
                    k
                    for k in props_old.keys() | props_new.keys()
                    if props_old.get(k) != props_new.get(k)
                )
            )
            changes.append(Change(lid, rtype, "update", changed, stateful))
    return changes


def output_changed(before: Mapping[str, Any], after: Mapping[str, Any], name: str) -> bool:
    """Whether the stack output `name` (e.g. the trainer's ImageUri) changes."""
    return before.get("Outputs", {}).get(name) != after.get("Outputs", {}).get(name)


def destructive(changes: Iterable[Change]) -> list[Change]:
    """The changes that replace or remove state: CloudFormation resources first (they cause
    the Kubernetes objects' changes)."""
    found = [c for c in changes if c.stateful and c.destructive]
    return sorted(found, key=lambda c: c.type in STATEFUL_KINDS)


def summary(changes: Iterable[Change]) -> str:
    """What a deploy would do, one line per resource; `!` marks lost or stranded state."""
    changes = [c for c in changes if c.action != "add"] + [c for c in changes if c.action == "add"]
    if not changes:
        return "no change"
    return "\n".join(c.line() for c in changes)
