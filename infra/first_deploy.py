"""First-deploy settings and the day-two check: what a later deploy may change in place.

The GPU zone and the capacity settings decide where the file system and the GPU node group
live; changing them replaces those resources. They are kept in `.first-deploy` beside
`.gpu-nodes` (one `key=value` a line): `make deploy` passes them to every later deploy as
`-c key=value` before the user's own ARGS, and copies the synthesized file over it after a
deploy succeeds. The app refuses at synth:

- a first-deploy setting that differs from the kept one, unless named in
  `-c acknowledgeReplacement=<key>[,<key>...]`;
- a deploy that would replace or remove state (infra/replacements.py, against the template of
  the last deploy kept in `.last-deploy.template.json`), unless acknowledged the same way
  (by the setting that causes it, or by the replaced resource's logical id).

Either way it prints what the deploy replaces.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from infra.config import STACK_NAME, ConfigError, StackConfig

SETTINGS_FILE = ".first-deploy"
"""Kept beside `.gpu-nodes` in the repository root (the Makefile names the same file)."""
LAST_TEMPLATE_FILE = ".last-deploy.template.json"
"""The training stack's template of the last successful `make deploy`, for `make diff` and the
check below; the other stacks' templates are kept beside it (KEPT_STACKS)."""
KEPT_STACKS = {"EksFsdpResilientImages": ".last-deploy.images.template.json"}
"""Other stacks of the app whose last templates are kept and diffed too (infra/stack.py)."""
ACK_KEY = "acknowledgeReplacement"
STATE_DIR_KEY = "deployStateDir"
"""Context key of the folder holding the two files (default: the current directory, the
repository root under the CDK CLI); tests point it elsewhere."""

SAFE_WAY = {
    "gpuAvailabilityZone": (
        "a new zone replaces the GPU node group and the FSx file system (the old one is kept and "
        "billed; copy the checkpoints first)"
    ),
    "capacityType": (
        "capacity-block replaces the GPU node group (EKS capacity type); the others roll the "
        "GPU nodes onto the new capacity"
    ),
    "capacityReservationId": "the GPU nodes roll onto the new reservation one at a time",
    "capacityReservationPlacementGroup": "the GPU nodes roll into the new placement group",
}
"""Why each setting is kept: printed with a refusal (the replacements themselves are computed
from the templates, not from this text)."""
FIRST_DEPLOY_KEYS = tuple(SAFE_WAY)


class ReplacementRefused(ConfigError):
    """A refused deploy; `report` lists what it would change (printed before the one line)."""

    def __init__(self, key: str, problem: str, fix: str, *, report: str) -> None:
        super().__init__(key, problem, fix)
        self.report = report


def settings(config: StackConfig) -> dict[str, str]:
    """The first-deploy settings of a validated configuration (`none` for an absent id, which
    infra/config.py reads back as None)."""
    return {
        "gpuAvailabilityZone": config.network.gpu_availability_zone,
        "capacityType": config.gpu.capacity_type,
        "capacityReservationId": config.gpu.capacity_reservation_id or "none",
        "capacityReservationPlacementGroup": config.gpu.reservation_placement_group or "none",
    }


def render(values: Mapping[str, str]) -> str:
    return "".join(f"{key}={values[key]}\n" for key in FIRST_DEPLOY_KEYS)


def parse(text: str) -> dict[str, str]:
    values = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or key not in FIRST_DEPLOY_KEYS:
            raise ConfigError(
                SETTINGS_FILE,
                f"line {number} ({line!r}) is not one of {', '.join(FIRST_DEPLOY_KEYS)}=<value>",
                "restore it from the last deploy's cdk.out/first-deploy",
            )
        values[key] = value.strip()
    return values


def acknowledged(get: Callable[[str], Any]) -> tuple[str, ...]:
    value = get(ACK_KEY)
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(str(v).strip() for v in value)
    return tuple(v.strip() for v in str(value).split(",") if v.strip())


def changed_settings(kept: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    return [key for key in FIRST_DEPLOY_KEYS if key in kept and kept[key] != now[key]]


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
    """The day-two report of a synthesized template; raises ConfigError (one line naming the
    setting or resource and the safe way) when the deploy must be refused.

    `kept` / `last_template`: the first-deploy settings and template of the last deploy (None
    before the first deploy: nothing to compare, nothing refused). `other_stacks`: the app's
    other stacks, name -> (last template, template); their resources are named `stack.id`.
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

    for key in changed_settings(kept or {}, now):
        if key not in acknowledged:
            raise ReplacementRefused(
                key,
                f"{now[key]} is not the first deploy's {kept[key]} (kept in {SETTINGS_FILE}): "
                f"{SAFE_WAY[key]}",
                f"leave it out to keep {kept[key]}, or accept with "
                f'-c {ACK_KEY}={key} after `make diff ARGS="-c {key}={now[key]}"`',
                report=report,
            )
    _capacity_block_rolls_only_at_zero(changes, last_template or {}, template, report=report)
    if any(key in acknowledged for key in changed_settings(kept or {}, now)):
        return report  # an acknowledged setting accepts what the printed report lists
    refused = [
        c
        for c in replacements.destructive(changes)
        if c.logical_id.split("/")[0] not in acknowledged
    ]
    if refused:
        first = refused[0]
        ids = ",".join(dict.fromkeys(c.logical_id.split("/")[0] for c in refused))
        raise ReplacementRefused(
            first.logical_id,
            f"this deploy would {first.action} the {first.type} "
            f"({', '.join(first.reasons) or 'changed'})"
            + (f" and {len(refused) - 1} more" if len(refused) > 1 else ""),
            f"undo the change, or accept with -c {ACK_KEY}={ids}",
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


def state_dir(get: Callable[[str], Any]) -> Path:
    return Path(get(STATE_DIR_KEY) or ".")


def load_kept(
    folder: Path,
) -> tuple[dict[str, str] | None, dict[str, Any] | None, dict[str, dict[str, Any] | None]]:
    """The kept settings, training-stack template and other stacks' templates of the last
    deploy (None where absent)."""

    def read(name: str) -> dict[str, Any] | None:
        path = folder / name
        return json.loads(path.read_text()) if path.exists() else None

    settings_path = folder / SETTINGS_FILE
    kept = parse(settings_path.read_text()) if settings_path.exists() else None
    others = {stack: read(name) for stack, name in KEPT_STACKS.items()}
    return kept, read(LAST_TEMPLATE_FILE), others


def keep(*, assembly: Path, folder: Path, stack_name: str) -> None:
    """After a deploy succeeded: keep its settings and templates for the next deploy. Each file
    is written beside its target and renamed over it, so none is ever half written."""
    files = {
        SETTINGS_FILE: assembly / SETTINGS_FILE.lstrip("."),
        LAST_TEMPLATE_FILE: assembly / f"{stack_name}.template.json",
        **{name: assembly / f"{stack}.template.json" for stack, name in KEPT_STACKS.items()},
    }
    missing = [str(source) for source in files.values() if not source.exists()]
    if missing:
        raise ConfigError(
            "assembly", f"{', '.join(missing)} missing", "deploy again with `make deploy`"
        )
    for name, source in files.items():
        partial = folder / f"{name}.partial"
        partial.write_bytes(source.read_bytes())
        os.replace(partial, folder / name)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m infra.first_deploy keep cdk.out`: what `make deploy` runs after a deploy."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m infra.first_deploy")
    parser.add_argument("command", choices=["keep"])
    parser.add_argument("assembly", type=Path)
    parser.add_argument("--state-dir", type=Path, default=Path("."))
    parser.add_argument("--stack", default=STACK_NAME)
    args = parser.parse_args(argv)
    try:
        keep(assembly=args.assembly, folder=args.state_dir, stack_name=args.stack)
    except ConfigError as err:
        print(f"Not kept: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
