"""The day-two check: what a deploy changes against the deployed stack, and what it refuses.

app.py's guard (infra/deployed.py) reads the deployed stack back at synth (its template and
the settings it was deployed with), keeps every setting the user does not give again,
synthesizes, and then this module compares the new template with the deployed one
(infra/replacements.py) and refuses, in one line naming each change and the safe way:

- a changed guarded setting (SAFE_WAY: the GPU zone, capacity, admin access, public endpoint,
  FSx size), each unless named in `-c acknowledgeReplacement=<key>[,<key>...]`;
- each replacement or removal of state, unless its own logical id is acknowledged the same way
  (one acknowledgement per change: acknowledging a setting never accepts another change);
- with no acknowledgement possible: an FSx size below the deployed one (FSx never shrinks), a
  zone move while GPU nodes run (their placement group is single-zone), a Capacity Block update
  with nodes (EKS).

Either way it prints what the deploy replaces, removes, updates and keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from infra.config import ConfigError, StackConfig

ACK_KEY = "acknowledgeReplacement"

SAFE_WAY = {
    "gpuAvailabilityZone": (
        "a new zone replaces the GPU node group and the FSx file system (the old one is kept and "
        "billed; copy the checkpoints first: docs/day-two.md, Moving the GPU zone)"
    ),
    "capacityType": (
        "capacity-block replaces the GPU node group (EKS capacity type); the others roll the "
        "GPU nodes onto the new capacity"
    ),
    "capacityReservationId": "the GPU nodes roll onto the new reservation one at a time",
    "capacityReservationPlacementGroup": "the GPU nodes roll into the new placement group",
    "adminPrincipalArn": (
        "the deployed principal loses its cluster-admin access entry (kubectl with it stops)"
    ),
    "endpointAllowedCidrs": (
        "addresses no longer listed lose the public API endpoint (kubectl from there stops)"
    ),
    "fsxStorageCapacityGiB": (
        "FSx storage only grows: the larger size is billed from then on and cannot be undone"
    ),
}
"""Settings whose change needs its own acknowledgement, and why (printed with a refusal; the
replacements themselves are computed from the templates, not from this text)."""
GUARDED_KEYS = tuple(SAFE_WAY)


class ReplacementRefused(ConfigError):
    """A refused deploy; `report` lists what it would change (printed before the one line)."""

    def __init__(self, key: str, problem: str, fix: str, *, report: str) -> None:
        super().__init__(key, problem, fix)
        self.report = report


def settings(config: StackConfig) -> dict[str, str]:
    """The guarded settings and the node count of a validated configuration, as comparable
    text (`none` for an absent value)."""
    return {
        "gpuAvailabilityZone": config.network.gpu_availability_zone,
        "capacityType": config.gpu.capacity_type,
        "capacityReservationId": config.gpu.capacity_reservation_id or "none",
        "capacityReservationPlacementGroup": config.gpu.reservation_placement_group or "none",
        "adminPrincipalArn": config.cluster.admin_principal_arn or "none",
        "endpointAllowedCidrs": ",".join(sorted(config.cluster.endpoint_allowed_cidrs)) or "none",
        "fsxStorageCapacityGiB": str(config.fsx.storage_capacity_gib),
        "gpuNodesDesired": str(config.gpu.desired_size),
    }


def acknowledged(get: Callable[[str], Any]) -> tuple[str, ...]:
    value = get(ACK_KEY)
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(str(v).strip() for v in value)
    return tuple(v.strip() for v in str(value).split(",") if v.strip())


def changed_settings(kept: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    return [key for key in GUARDED_KEYS if key in kept and key in now and kept[key] != now[key]]


def _refuse_without_acknowledgement(
    kept: Mapping[str, str], now: Mapping[str, str], *, report: str
) -> None:
    """Changes no acknowledgement makes safe: refused with the steps that work."""
    size = "fsxStorageCapacityGiB"
    if size in kept and size in now and int(now[size]) < int(kept["fsxStorageCapacityGiB"]):
        raise ReplacementRefused(
            "fsxStorageCapacityGiB",
            f"{now['fsxStorageCapacityGiB']} GiB is below the deployed "
            f"{kept['fsxStorageCapacityGiB']} GiB; FSx storage never shrinks (UpdateFileSystem: "
            "the new capacity must be greater than the current)",
            f"leave it out to keep {kept['fsxStorageCapacityGiB']}",
            report=report,
        )
    zone = "gpuAvailabilityZone"
    nodes = max(int(kept.get("gpuNodesDesired", "0")), int(now.get("gpuNodesDesired", "0")))
    if zone in kept and zone in now and kept[zone] != now[zone] and nodes:
        raise ReplacementRefused(
            zone,
            f"moving the GPU nodes from {kept[zone]} to {now[zone]} with {nodes} nodes: the new "
            "group's instances would join a placement group whose instances still run in the "
            "old zone (EC2: a cluster placement group spans one zone; InvalidPlacementGroup.InUse)",
            "make eks-stop; make gpu-nodes NODES=0 (a deploy of its own); then the zone move at "
            "0 nodes (docs/day-two.md, Moving the GPU zone); then make gpu-nodes OVERLAY=<size>",
            report=report,
        )


def check(
    *,
    kept: Mapping[str, str] | None,
    now: Mapping[str, str],
    last_template: Mapping[str, Any] | None,
    template: Mapping[str, Any],
    acknowledged: Sequence[str],
    region: str,
    other_stacks: Mapping[str, tuple[Mapping[str, Any] | None, Mapping[str, Any]]] | None = None,
) -> str:
    """The day-two report of a synthesized template; raises ReplacementRefused (one line naming
    each refused change and the safe way) when the deploy must be refused.

    `kept` / `last_template`: the deployed stack's settings (`settings()` of its configuration)
    and template (None when no stack is deployed: nothing to compare, nothing refused).
    `other_stacks`: the app's other stacks, name -> (deployed template, template); their
    resources are named `stack.id`.
    """
    import dataclasses

    from infra import replacements  # cfn-lint's schemas: loaded only when there is a diff

    changes = replacements.diff(last_template, template, region=region) if last_template else []
    for stack, (before, after) in (other_stacks or {}).items():
        if before is not None:
            changes += [
                dataclasses.replace(c, logical_id=f"{stack}.{c.logical_id}")
                for c in replacements.diff(before, after, region=region)
            ]
    first = last_template is None and all(b is None for b, _ in (other_stacks or {}).values())
    report = "first deploy" if first else replacements.summary(changes)

    kept = kept or {}
    _refuse_without_acknowledgement(kept, now, report=report)
    _capacity_block_rolls_only_at_zero(changes, last_template or {}, template, report=report)
    # Each guarded setting and each lost resource needs its own acknowledgement.
    refused = [
        (key, f"change {key} from {kept[key]} to {now[key]}: {SAFE_WAY[key]}")
        for key in changed_settings(kept, now)
        if key not in acknowledged
    ]
    refused += [
        (
            c.logical_id,
            f"{c.action} the {c.type} {c.logical_id} ({', '.join(c.reasons) or 'changed'})",
        )
        for c in replacements.destructive(changes)
        if c.logical_id not in acknowledged
    ]
    if refused:
        key = refused[0][0]
        raise ReplacementRefused(
            key if key in SAFE_WAY else refused[0][0],
            "this deploy would " + "; ".join(what for _, what in refused),
            "undo the change, or accept each with "
            f"-c {ACK_KEY}={','.join(dict.fromkeys(k for k, _ in refused))}",
            report=report,
        )
    return report


# Node group properties that UpdateNodegroupConfig changes in place; any other change
# (Version, ReleaseVersion, LaunchTemplate) is a rolling update of every node.
IN_PLACE_NODEGROUP_PROPERTIES = frozenset(
    {"ScalingConfig", "Labels", "Taints", "Tags", "UpdateConfig", "NodeRepairConfig"}
)
CAPACITY_BLOCK_GUIDE = (
    "EKS user guide, capacity-blocks-mng.html: 'When upgrading managed node groups with "
    "Capacity Blocks, make sure that the desired size of the node group is set to 0'"
)


def _desired(template: Mapping[str, Any], logical_id: str) -> int:
    resource = template.get("Resources", {}).get(logical_id, {})
    size = resource.get("Properties", {}).get("ScalingConfig", {}).get("DesiredSize", 0)
    return int(size) if isinstance(size, int | str) and str(size).isdigit() else 0


def _capacity_block_rolls_only_at_zero(
    changes: Sequence[Any], before: Mapping[str, Any], after: Mapping[str, Any], *, report: str
) -> None:
    """A Capacity Block node group is updated (new version, new launch template) only with no
    nodes, before and after the deploy; scaling itself is one deploy, the update another."""
    for change in changes:
        if change.type != "AWS::EKS::Nodegroup" or change.action != "update":
            continue
        props = after["Resources"][change.logical_id]["Properties"]
        rolling = set(change.reasons) - IN_PLACE_NODEGROUP_PROPERTIES
        if props.get("CapacityType") != "CAPACITY_BLOCK" or not rolling:
            continue
        nodes = max(_desired(before, change.logical_id), _desired(after, change.logical_id))
        if nodes:
            raise ReplacementRefused(
                "gpuNodesDesired",
                f"this deploy rolls the Capacity Block node group ({', '.join(sorted(rolling))}) "
                f"with {nodes} nodes; EKS updates such a group only at 0 nodes "
                f"({CAPACITY_BLOCK_GUIDE})",
                "make eks-stop; make gpu-nodes NODES=0 in a deploy of its own (this change "
                "left out); deploy the change at 0 nodes; then make gpu-nodes NODES=<n>",
                report=report,
            )


def keeps_creator_admin(last_template: Mapping[str, Any] | None) -> bool:
    """Whether the deployed cluster was created with the creator's bootstrap admin access
    (`AccessConfig.BootstrapClusterCreatorAdminPermissions` absent or true): a create-only
    property, so such a cluster keeps it instead of being replaced. docs/day-two.md says how to
    remove that access entry by hand."""
    if last_template is None:
        return False
    for resource in last_template.get("Resources", {}).values():
        if resource.get("Type") == "AWS::EKS::Cluster":
            access = resource.get("Properties", {}).get("AccessConfig", {})
            return access.get("BootstrapClusterCreatorAdminPermissions", True) is not False
    return False
