"""Day two: every docs/eks.md deploy step after the first deploy, from a clone with no local state.

    .venv/bin/pytest tests/infra/test_day_two.py              # ~10 min on 2 loaded cores
    .venv/bin/pytest tests/infra/test_day_two.py -m "not slow" # in-process, ~3 min

The deployed stack is the one source of deploy state. Each step starts from a deployed template
(a first deploy synthesized here, or a committed fixture of an earlier version's stack), reads
its settings back the way app.py does (infra/deployed.py: the stack's DeploySettings parameter,
or the resources of a stack from before it), layers the step's `-c` values on top, synthesizes,
and diffs (infra/replacements.py, the code every synth runs). The slow tests run app.py itself,
and `make diff` through the pinned CDK CLI, against an emulated CloudFormation on localhost
(tests/infra/cfn_emulator.py) reached through the real AWS CLI, as a user's clone would.
What cannot run here: CloudFormation itself (a replacement it decides from the live stack) and
the kubectl handler.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from cfn_emulator import emulated_cloudformation, no_credentials_env
from infra_synth import CDK_JSON_CONTEXT, mask_asset_hashes, synth
from support import cdk_cli_reason, requires, requires_aws_cli

from infra import deployed, first_deploy, guard, replacements
from infra.config import STACK_NAME, load_config
from infra.stack import IMAGES_STACK_NAME, build_stacks
from manifests.render import OVERLAYS
from manifests.sizes import SIZES

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
REGION = CDK_JSON_CONTEXT["region"]
RESERVATION = "cr-0123456789abcdef0"
ADMIN = "arn:aws:iam::123456789012:role/Admin"
NODE_COUNTS = {name: size.node_count for name, size in SIZES.items()}
needs_aws_cli = requires_aws_cli()  # the deployed stack read through the real AWS CLI

# docs/eks.md's first deploy: an admin role and the laptop's address on the public endpoint.
FIRST_DEPLOY = {"adminPrincipalArn": ADMIN, "endpointAllowedCidrs": "203.0.113.7/32"}

# docs/eks.md's steps after the first deploy: (the `-c` values given, acknowledgements needed).
STEPS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "gpu-nodes": ({"gpuNodesDesired": "2"}, ()),
    "gpu-nodes-overlay": ({"overlay": "2node"}, ()),
    "reservation": (
        {"capacityType": "capacity-reservation", "capacityReservationId": RESERVATION},
        ("capacityType", "capacityReservationId"),
    ),
    "fsx-growth": ({"fsxStorageCapacityGiB": "9600"}, ("fsxStorageCapacityGiB",)),
    "fsx-throughput": ({"fsxThroughputPerUnit": "500"}, ()),
    "kubernetes-version": ({"kubernetesVersion": "1.37"}, ()),
}


@pytest.fixture
def newer_kubernetes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Kubernetes version after 1.36: aws-cdk-lib 2.275 has no kubectl layer for one yet, so
    the bump is synthesized with eks_v2's `KubernetesVersion.of` and today's layer (the layer
    is a Lambda layer of the kubectl handler, never a create-only property)."""
    from aws_cdk import aws_eks_v2 as eks

    from infra import cluster, config

    monkeypatch.setattr(config, "SUPPORTED_KUBERNETES_VERSIONS", ("1.36", "1.37"))
    layer = cluster._VERSIONS["1.36"][1]
    monkeypatch.setattr(
        cluster,
        "_VERSIONS",
        {**cluster._VERSIONS, "1.37": (eks.KubernetesVersion.of("1.37"), layer)},
    )


@pytest.fixture(scope="session")
def first_template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The stack as the README's first deploy leaves it (its DeploySettings included)."""
    return synth(FIRST_DEPLOY, outdir=tmp_path_factory.mktemp("first"))[0]


def _context(deployed_template: dict[str, Any] | None, given: dict[str, Any]) -> dict[str, Any]:
    """app.py's context: cdk.json, under the deployed settings, under the given `-c` values."""
    kept, _ = deployed.kept_settings(deployed_template)
    given = dict(given)
    use_default = deployed.split_list(given.pop(deployed.USE_DEFAULT_KEY, None))
    return deployed.layered(
        defaults=CDK_JSON_CONTEXT, kept=kept, given=given, use_default=use_default
    )


def _settings(context: dict[str, Any]) -> dict[str, str]:
    config = load_config(context.get, overlays=OVERLAYS, node_counts=NODE_COUNTS)
    return first_deploy.settings(config)


def _deploy(
    before: dict[str, Any], given: dict[str, Any], tmp_path: Path, *, mask: bool = False
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A step from a clean clone: (the new template, the check's arguments)."""
    context = _context(before, given)
    after = synth(context, outdir=tmp_path / "after", last_template=before)[0]
    if mask:
        after = mask_asset_hashes(after)
    args = dict(
        kept=_settings(deployed.deployed_context(before, defaults=CDK_JSON_CONTEXT)),
        now=_settings(context),
        last_template=before,
        template=after,
        region=REGION,
    )
    return after, args, context


Step = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]
"""What `_deploy` returns: the new template, the check's arguments, the context."""
FromFirst = Callable[[dict[str, Any]], Step]


@pytest.fixture(scope="module")
def from_first(
    first_template: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> FromFirst:
    """`_deploy(first_template, given)`, synthesized once per `given` for the module (several
    tests take the same step from the first deploy: a synth is seconds of CPU); each call gets
    its own copy, free to change."""
    done: dict[str, Step] = {}

    def deploy(given: dict[str, Any]) -> Step:
        key = json.dumps(given, sort_keys=True)
        if key not in done:
            done[key] = _deploy(first_template, given, tmp_path_factory.mktemp("step"))
        return copy.deepcopy(done[key])

    return deploy


def _resource(template: dict[str, Any], rtype: str) -> dict[str, Any]:
    (found,) = [r for r in template["Resources"].values() if r["Type"] == rtype]
    return found


def _gpu_group(template: dict[str, Any]) -> dict[str, Any]:
    return next(
        r
        for r in template["Resources"].values()
        if r["Type"] == "AWS::EKS::Nodegroup" and "LaunchTemplate" in r["Properties"]
    )


def _store_template(template: dict[str, Any]) -> Any:
    """The rendezvous store Deployment's pod template, as the kubectl handler applies it."""
    for resource in template["Resources"].values():
        if resource["Type"] != replacements.MANIFEST_TYPE:
            continue
        for (kind, _, _name), obj in replacements._kubernetes_objects(
            resource, frozenset()
        ).items():
            if kind == "Deployment":
                return obj["spec"]["template"]
    raise AssertionError("no Deployment among the stack's Kubernetes objects")


def _ack_tokens(message: str) -> list[str]:
    return message.rsplit(f"{first_deploy.ACK_KEY}=", 1)[1].split(",")


def _access_kept(template: dict[str, Any]) -> None:
    """The first deploy's admin access entry and public endpoint are still there."""
    entries = [
        r["Properties"]["PrincipalArn"]
        for r in template["Resources"].values()
        if r["Type"] == "AWS::EKS::AccessEntry"
    ]
    assert ADMIN in entries
    vpc = _resource(template, "AWS::EKS::Cluster")["Properties"]["ResourcesVpcConfig"]
    assert vpc["EndpointPublicAccess"] is True and vpc["PublicAccessCidrs"] == ["203.0.113.7/32"]


# --- each README step, from a clone that has no local state ----------------------------------


@pytest.mark.parametrize("name", list(STEPS))
def test_a_step_keeps_every_setting_and_replaces_no_state(
    name: str, first_template: dict[str, Any], from_first: FromFirst, request: pytest.FixtureRequest
) -> None:
    given, needed = STEPS[name]
    if name == "kubernetes-version":
        request.getfixturevalue("newer_kubernetes")
    after, args, _ = from_first(given)
    changes = replacements.diff(first_template, after, region=REGION)
    assert not replacements.destructive(changes), replacements.summary(changes)
    _access_kept(after)  # `make gpu-nodes` no longer drops the first deploy's -c values
    fsx = _resource(after, "AWS::FSx::FileSystem")["Properties"]
    assert fsx["StorageCapacity"] == int(given.get("fsxStorageCapacityGiB", 4800))
    assert not replacements.output_changed(first_template, after, "ImageUri")
    assert _store_template(first_template) == _store_template(after)
    # The settings the next deploy reads back are this deploy's.
    stored = deployed.stored_settings(after)
    assert stored == deployed.settings_to_store(
        _context(first_template, given), defaults=CDK_JSON_CONTEXT
    )
    # Only what differs from cdk.json: a later default change reaches this stack.
    assert all(CDK_JSON_CONTEXT[k] != v for k, v in stored.items())
    assert stored["adminPrincipalArn"] == ADMIN and "vpcCidr" not in stored
    if needed:
        with pytest.raises(first_deploy.ReplacementRefused) as refused:
            first_deploy.check(**args, acknowledged=())
        assert _ack_tokens(str(refused.value)) == list(needed)  # each named on its own
    report = first_deploy.check(**args, acknowledged=needed)
    assert "!" not in report
    assert "DeploySettings" in report  # the changed settings are a stack update


def test_make_gpu_nodes_with_an_overlay_asks_for_its_nodes_and_spares(
    first_template: dict[str, Any],
    from_first: FromFirst,
    tmp_path: Path,
) -> None:
    after, _, _ = from_first({"overlay": "2node"})
    scaling = _gpu_group(after)["Properties"]["ScalingConfig"]
    assert scaling["DesiredSize"] == SIZES["2node"].node_count > SIZES["2node"].nodes
    # NODES=N overrides the overlay's count, and a later overlay clears the override.
    pinned, _, _ = _deploy(after, {"gpuNodesDesired": "1"}, tmp_path / "pinned")
    assert _gpu_group(pinned)["Properties"]["ScalingConfig"]["DesiredSize"] == 1
    kept = deployed.stored_settings(pinned)
    assert kept["overlay"] == "2node" and kept["gpuNodesDesired"] == "1"
    context = _context(pinned, {"overlay": "16node"})
    assert _settings(context)["gpuNodesDesired"] == str(SIZES["16node"].node_count)


def test_acknowledging_one_setting_never_accepts_another_change(from_first: FromFirst) -> None:
    """A reservation acknowledged by its settings, deployed with a code change that would
    replace the file system: the file system is refused on its own."""
    given, needed = STEPS["reservation"]
    after, args, _ = from_first(given)  # a copy of its own: changed below
    fsx = next(lid for lid, r in after["Resources"].items() if r["Type"] == "AWS::FSx::FileSystem")
    after["Resources"][fsx]["Properties"]["SubnetIds"] = [{"Ref": "SomeOtherSubnet"}]
    args["template"] = after
    with pytest.raises(first_deploy.ReplacementRefused) as refused:
        first_deploy.check(**args, acknowledged=needed)
    tokens = _ack_tokens(str(refused.value))
    assert tokens[0] == fsx and not set(needed) & set(tokens)
    assert "\n" not in str(refused.value)
    first_deploy.check(**args, acknowledged=(*needed, *tokens))


# cdk.json defaults a later commit might change: each guarded setting and the node count.
CHANGED_DEFAULTS = {
    "gpuAvailabilityZone": "us-east-2b",
    "capacityType": "capacity-reservation",
    "capacityReservationId": RESERVATION,
    "capacityReservationPlacementGroup": "training-pg",
    "adminPrincipalArn": "arn:aws:iam::123456789012:role/Other",
    "endpointAllowedCidrs": ["198.51.100.0/24"],
    "fsxStorageCapacityGiB": 9600,
    "gpuNodesMin": 1,
    "gpuNodesDesired": 2,
    "gpuNodesMax": 4,
}


def test_the_deployed_guarded_settings_come_from_the_stack_not_todays_defaults(
    first_template: dict[str, Any],
) -> None:
    """What the check compares a deploy with is what the stack was deployed with, whatever
    cdk.json says now (DeploySettings holds no untouched default)."""
    assert set(CHANGED_DEFAULTS) == set(deployed.COMPARED_FROM_RESOURCES)
    changed = {**CDK_JSON_CONTEXT, **CHANGED_DEFAULTS}
    before = _settings(deployed.deployed_context(first_template, defaults=changed))
    assert before == _settings(_context(first_template, {}))
    assert before["fsxStorageCapacityGiB"] == "4800" and before["gpuNodesDesired"] == "0"


@needs_aws_cli
def test_a_changed_default_of_a_guarded_setting_is_refused_like_any_change(
    first_template: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later cdk.json that grows FSx's default (4800 -> 9600 GiB), against the README's first
    deploy, which never set the size: the guard app.py runs (infra/guard.py), reading the
    emulated stack through the AWS CLI, refuses the growth as it refuses
    `-c fsxStorageCapacityGiB=9600`, naming its one acknowledgement. (An FSx growth is an
    in-place update: nothing else would refuse it.)"""
    assert "fsxStorageCapacityGiB" not in deployed.stored_settings(first_template)
    newer = {**CDK_JSON_CONTEXT, "fsxStorageCapacityGiB": 9600}
    cdk_json = tmp_path / "cdk.json"
    cdk_json.write_text(json.dumps({"context": newer}))
    monkeypatch.setattr(guard, "CDK_JSON", cdk_json)
    # The CDK CLI gives the app cdk.json's context (path metadata off, as infra_synth.synth).
    app = cdk.App(
        outdir=str(tmp_path / "out"),
        context={**newer, "aws:cdk:enable-path-metadata": False},
        analytics_reporting=False,
    )

    def build(config: Any, *, keep_creator_admin: bool, settings: dict[str, Any]) -> None:
        build_stacks(app, config=config, keep_creator_admin=keep_creator_admin, settings=settings)

    with emulated_cloudformation() as cfn:
        for key, value in cfn.env().items():
            monkeypatch.setenv(key, value)
        cfn.put(STACK_NAME, first_template)
        with pytest.raises(SystemExit) as refused:
            guard.guard(app, build=build)
    message = str(refused.value.code)
    assert message.startswith("Refused: ") and "\n" not in message
    assert "change fsxStorageCapacityGiB from 4800 to 9600" in message
    assert _ack_tokens(message) == ["fsxStorageCapacityGiB"]


# --- steps that replace state: refused, each change named ------------------------------------


def test_a_capacity_block_replaces_the_gpu_group_only_with_each_change_acknowledged(
    first_template: dict[str, Any], tmp_path: Path
) -> None:
    given = {
        "capacityType": "capacity-block",
        "capacityReservationId": RESERVATION,
        "gpuNodesDesired": "0",
    }
    after, args, _ = _deploy(first_template, given, tmp_path)
    lost = replacements.destructive(replacements.diff(first_template, after, region=REGION))
    assert [c.type for c in lost] == ["AWS::EKS::Nodegroup"]
    with pytest.raises(first_deploy.ReplacementRefused) as refused:
        first_deploy.check(**args, acknowledged=("capacityType", "capacityReservationId"))
    assert _ack_tokens(str(refused.value)) == [lost[0].logical_id]
    report = first_deploy.check(
        **args, acknowledged=("capacityType", "capacityReservationId", lost[0].logical_id)
    )
    assert f"! replace {lost[0].logical_id}" in report


def test_a_zone_move_with_nodes_is_refused_with_the_steps_that_work(
    first_template: dict[str, Any],
    from_first: FromFirst,
    tmp_path: Path,
) -> None:
    """The new group's nodes would join the placement group while the old group's still run
    in the old zone: refused whatever is acknowledged, naming the sequence."""
    running, _, _ = from_first({"gpuNodesDesired": "2"})
    _, args, _ = _deploy(running, {"gpuAvailabilityZone": "us-east-2b"}, tmp_path)
    with pytest.raises(first_deploy.ReplacementRefused) as refused:
        first_deploy.check(**args, acknowledged=("gpuAvailabilityZone",))
    message = str(refused.value)
    assert message.startswith("context 'gpuAvailabilityZone'") and "\n" not in message
    assert "make gpu-nodes NODES=0" in message and "InvalidPlacementGroup.InUse" in message


def test_a_zone_move_at_zero_nodes_replaces_group_fsx_and_volume_each_acknowledged(
    first_template: dict[str, Any], tmp_path: Path
) -> None:
    after, args, _ = _deploy(first_template, {"gpuAvailabilityZone": "us-east-2b"}, tmp_path)
    changes = replacements.diff(first_template, after, region=REGION)
    lost = replacements.destructive(changes)
    assert {c.type for c in lost} == {
        "AWS::EKS::Nodegroup",
        "AWS::FSx::FileSystem",
        "PersistentVolume",
    }
    assert not any(c.type == "AWS::EKS::Cluster" for c in lost)
    with pytest.raises(first_deploy.ReplacementRefused) as refused:
        first_deploy.check(**args, acknowledged=())
    tokens = _ack_tokens(str(refused.value))
    assert tokens == ["gpuAvailabilityZone", *(c.logical_id for c in lost)]
    # Acknowledging the setting alone accepts none of the replacements it causes.
    with pytest.raises(first_deploy.ReplacementRefused):
        first_deploy.check(**args, acknowledged=("gpuAvailabilityZone",))
    report = first_deploy.check(**args, acknowledged=tuple(tokens))
    for change in lost:
        assert change.logical_id in report
    assert _store_template(first_template) == _store_template(after)


def test_fsx_never_shrinks(first_template: dict[str, Any], tmp_path: Path) -> None:
    given = {"fsxStorageCapacityGiB": "2400", "fsxThroughputPerUnit": "500", "fsxSizedFor": "2node"}
    _, args, _ = _deploy(first_template, given, tmp_path)
    with pytest.raises(first_deploy.ReplacementRefused, match="never shrinks"):
        first_deploy.check(**args, acknowledged=("fsxStorageCapacityGiB",))


def test_removing_the_admin_or_the_public_endpoint_needs_its_own_acknowledgement(
    first_template: dict[str, Any], tmp_path: Path
) -> None:
    given = {"adminPrincipalArn": "none", "endpointAllowedCidrs": "[]"}
    after, args, _ = _deploy(first_template, given, tmp_path)
    changes = replacements.diff(first_template, after, region=REGION)
    assert any(c.type == "AWS::EKS::AccessEntry" and c.action == "remove" for c in changes)
    with pytest.raises(first_deploy.ReplacementRefused) as refused:
        first_deploy.check(**args, acknowledged=("adminPrincipalArn",))
    assert _ack_tokens(str(refused.value)) == ["endpointAllowedCidrs"]
    first_deploy.check(**args, acknowledged=("adminPrincipalArn", "endpointAllowedCidrs"))


# --- stacks deployed by earlier versions -----------------------------------------------------


# What the first deploy after the upgrade changes in main's bafc8b0 stack besides the step's
# own change, each intended (docs/day-two.md, Upgrade notes): the add-on pins
# (infra/addon_versions.py), AMP's documented statement on the alert key, and the per-namespace
# scraper Roles dropped (AMP's scraper has its own cluster-wide access entry). All in place:
# nothing stateful is replaced or removed.
UPGRADE_FROM_BAFC8B0 = [
    ("AWS::SSM::Parameter", "add", ()),
    ("AWS::EKS::Addon", "update", ("AddonVersion",)),
    ("AWS::EKS::Addon", "update", ("AddonVersion",)),
    ("AWS::EKS::Addon", "update", ("AddonVersion",)),
    ("AWS::EKS::Addon", "update", ("AddonVersion",)),
    ("AWS::KMS::Key", "update", ("KeyPolicy",)),
    (replacements.MANIFEST_TYPE, "remove", ("logical id",)),
    # The trainer's read of the hot spares (an eviction waits for a Ready one: straggler.py).
    ("Role", "add", ()),
    ("RoleBinding", "add", ()),
    # The node fencer (infra/node_fencer.py): its role and policy, its Pod Identity
    # association, and its Kubernetes objects (one new manifest resource).
    ("AWS::IAM::Role", "add", ()),
    ("AWS::IAM::Policy", "add", ()),
    ("AWS::EKS::PodIdentityAssociation", "add", ()),
    ("Custom::AWSCDK-EKS-KubernetesResource", "add", ()),
    # Every bad node ends the same way (docs/node-loss.md): the trainer's cordon policy admits
    # the product's unfit label, the FencingHalted and NodeFencerDown rules, the scraper reads
    # the fencer's /metrics. The GPU node group's repair overrides update it in place (below).
    ("ValidatingAdmissionPolicy", "update", ("spec",)),
    ("AWS::APS::RuleGroupsNamespace", "update", ("Data",)),
    ("AWS::APS::Scraper", "update", ("ScrapeConfiguration",)),
    # Replica groups (docs/replica-groups.md): the JobSet controller's chart, pinned
    # (infra/addons.py); the ReplicaGroupOut rule rides on the rule group's update above.
    ("Custom::AWSCDK-EKS-HelmChart", "add", ()),
]


def test_a_stack_deployed_by_main_before_this_change_upgrades_in_place(tmp_path: Path) -> None:
    """Main's stack (bafc8b0), deployed with the README's first-deploy values and a 2node-sized
    1200 GiB file system, has no DeploySettings: its settings are read from its resources.
    `make gpu-nodes NODES=2` from a clean clone changes the GPU node count, adds the parameter
    and makes exactly UPGRADE_FROM_BAFC8B0's changes (each in place); the cluster (its
    create-only bootstrap-admin setting included), both node groups and FSx are not replaced,
    and the admin entry, the endpoint and FSx's size are kept."""
    before = json.loads((FIXTURES / "deployed-main-bafc8b0.template.json").read_text())
    assert deployed.stored_settings(before) is None
    kept, source = deployed.kept_settings(before)
    assert "resources" in source
    assert kept["fsxStorageCapacityGiB"] == 1200 and kept["fsxSizedFor"] == "2node"
    after, args, _ = _deploy(before, {"gpuNodesDesired": "2"}, tmp_path, mask=True)
    changes = replacements.diff(before, after, region=REGION)
    assert sorted((c.type, c.action, c.reasons) for c in changes) == sorted(
        [
            *UPGRADE_FROM_BAFC8B0,
            ("AWS::EKS::Nodegroup", "update", ("NodeRepairConfig", "ScalingConfig")),
        ]
    ), replacements.summary(changes)
    assert {c.logical_id for c in changes if c.type == "AWS::EKS::Nodegroup"} == {_gpu_id(before)}
    (removed,) = [c.logical_id for c in changes if c.action == "remove"]
    assert "ScraperRbac" in removed
    cluster = _resource(after, "AWS::EKS::Cluster")["Properties"]
    assert cluster["AccessConfig"]["BootstrapClusterCreatorAdminPermissions"] is False
    _access_kept(after)
    assert first_deploy.check(**args, acknowledged=()) == replacements.summary(changes)


def _gpu_id(template: dict[str, Any]) -> str:
    return next(
        lid
        for lid, r in template["Resources"].items()
        if r["Type"] == "AWS::EKS::Nodegroup" and "LaunchTemplate" in r["Properties"]
    )


def _before_issue_33(capacity_gib: int = 4800) -> dict[str, Any]:
    text = (FIXTURES / "deployed-before-issue-33.template.json").read_text()
    if capacity_gib != 4800:  # the same stack, first deployed with the README's small FSx
        text = text.replace('"StorageCapacity": 4800', f'"StorageCapacity": {capacity_gib}')
        text = text.replace('"PerUnitStorageThroughput": 250', '"PerUnitStorageThroughput": 500')
        text = text.replace("4800Gi", f"{capacity_gib}Gi")
    return json.loads(text)


def test_a_stack_deployed_before_issue_33_is_updated_in_place(tmp_path: Path) -> None:
    """The template a stack deployed at 644927e holds (cdk.json's defaults then, asset hashes
    masked), read from a clean clone: the cluster keeps its bootstrap creator admin (create-only,
    so it must not flip), node groups and FSx are updated in place; the one loss is the old ECR
    repository (images now live in the images stack's), refused until acknowledged by its id."""
    before = _before_issue_33()
    after, args, _ = _deploy(before, {"gpuRootVolumeGiB": "500"}, tmp_path, mask=True)
    changes = replacements.diff(before, after, region=REGION)
    lost = [c for c in changes if c.action in ("replace", "remove")]
    assert [(c.type, c.action) for c in lost] == [("AWS::ECR::Repository", "remove")], (
        replacements.summary(changes)
    )
    with pytest.raises(first_deploy.ReplacementRefused) as refused:
        first_deploy.check(**args, acknowledged=())
    assert _ack_tokens(str(refused.value)) == [lost[0].logical_id]
    first_deploy.check(**args, acknowledged=(lost[0].logical_id,))
    assert first_deploy.keeps_creator_admin(before)
    cluster = _resource(after, "AWS::EKS::Cluster")["Properties"]
    assert "BootstrapClusterCreatorAdminPermissions" not in cluster["AccessConfig"]


def test_a_stack_first_deployed_with_another_fsx_size_has_a_way_forward(tmp_path: Path) -> None:
    """Before issue 33 the PV and claim carried the file system's size (here 1200Gi); today
    they carry a fixed nominal size, a change a bound claim cannot take. The file system keeps
    its 1200 GiB (read back), the PV and claim are refused each by name, and the refusal's
    acknowledgements (after docs/day-two.md's steps: delete both, the apply recreates them)
    accept exactly those."""
    before = _before_issue_33(1200)
    after, args, _ = _deploy(before, {"gpuRootVolumeGiB": "500"}, tmp_path, mask=True)
    assert _resource(after, "AWS::FSx::FileSystem")["Properties"]["StorageCapacity"] == 1200
    changes = replacements.diff(before, after, region=REGION)
    lost = replacements.destructive(changes)
    kinds = {c.type for c in lost}
    assert {"PersistentVolume", "PersistentVolumeClaim"} <= kinds, replacements.summary(changes)
    assert not kinds & {"AWS::FSx::FileSystem", "AWS::EKS::Cluster", "AWS::EKS::Nodegroup"}
    with pytest.raises(first_deploy.ReplacementRefused) as refused:
        first_deploy.check(**args, acknowledged=())
    tokens = _ack_tokens(str(refused.value))
    assert any(t.endswith("/PersistentVolume/fsdp-fsx") for t in tokens)
    assert any(t.endswith("/PersistentVolumeClaim/fsx-claim") for t in tokens)
    first_deploy.check(**args, acknowledged=tuple(tokens))
    steps = (REPO_ROOT / "docs/day-two.md").read_text().split("## A file system of another size")
    assert "kubectl delete pvc fsx-claim" in steps[1].split("\n## ")[0]  # the documented way


_OLD_STACK_SETTINGS = {
    "fsxS3Link": "s3://training-data/datasets",
    "alertEmail": "oncall@example.com",
    "imageUri": "123456789012.dkr.ecr.us-east-2.amazonaws.com/trainer:v1",
    "gpuRootVolumeGiB": 200,
    "systemNodeCount": 3,
    "systemInstanceType": "m7i.2xlarge",
    "efaSecondaryInterfaceType": "ip-bandwidth",
    "fsxBackupRetentionDays": 3,
}


def test_a_stack_from_before_deploy_settings_keeps_what_its_resources_hold(
    tmp_path: Path,
) -> None:
    """A stack deployed without DeploySettings: every setting its template holds is read back
    (the S3 link, the alert address, a prebuilt image, root volume, system nodes, EFA layout,
    backups, removal policy), so a plain deploy keeps them; dropping the S3 link or the alert
    subscription is refused, each until its own logical id is acknowledged."""
    given = {**FIRST_DEPLOY, **_OLD_STACK_SETTINGS, "fsxRemovalPolicy": "destroy"}
    before = synth(given, outdir=tmp_path / "before")[0]
    del before["Resources"][deployed.SETTINGS_PARAMETER_ID]
    derived = deployed.kept_settings(before)[0]
    assert {k: derived[k] for k in _OLD_STACK_SETTINGS} == _OLD_STACK_SETTINGS
    assert derived["fsxRemovalPolicy"] == "destroy"
    after, args, _ = _deploy(before, {"useDefault": "fsxS3Link,alertEmail"}, tmp_path)
    changes = replacements.diff(before, after, region=REGION)
    lost = {c.type: c.logical_id for c in replacements.destructive(changes)}
    assert set(lost) == {"AWS::FSx::DataRepositoryAssociation", "AWS::SNS::Subscription"}
    with pytest.raises(first_deploy.ReplacementRefused) as refused:
        first_deploy.check(**args, acknowledged=(lost["AWS::SNS::Subscription"],))
    assert _ack_tokens(str(refused.value)) == [lost["AWS::FSx::DataRepositoryAssociation"]]
    first_deploy.check(**args, acknowledged=tuple(lost.values()))


# --- make destroy ----------------------------------------------------------------------------


def test_a_retained_file_system_keeps_its_network(first_template: dict[str, Any]) -> None:
    """The file system's interfaces hold its security group and subnet (and so the VPC): kept
    with it, or the stack's delete ends DELETE_FAILED (aws/aws-cdk#31521)."""
    resources = first_template["Resources"]
    fsx = _resource(first_template, "AWS::FSx::FileSystem")
    assert fsx["DeletionPolicy"] == "Retain"
    group = fsx["Properties"]["SecurityGroupIds"][0]["Fn::GetAtt"][0]
    subnet = fsx["Properties"]["SubnetIds"][0]["Ref"]
    vpc = resources[subnet]["Properties"]["VpcId"]["Ref"]
    for lid in (group, subnet, vpc):
        assert resources[lid]["DeletionPolicy"] == "Retain", lid
    # The group's rule from itself (TCP 988 and 1018-1023: the FSx for Lustre user guide, "File
    # system access control with Amazon VPC", requires them between the file servers) stays
    # with it; the rules naming the cluster's group go (that group is deleted with the cluster).
    own = {"Fn::GetAtt": [group, "GroupId"]}
    self_rules = [
        (lid, r)
        for lid, r in resources.items()
        if r["Type"] == "AWS::EC2::SecurityGroupIngress"
        and r["Properties"]["GroupId"] == own
        and r["Properties"].get("SourceSecurityGroupId") == own
    ]
    ports = set()
    for lid, rule in self_rules:
        assert rule.get("DeletionPolicy") == "Retain", lid
        ports |= set(range(rule["Properties"]["FromPort"], rule["Properties"]["ToPort"] + 1))
    assert {988, *range(1018, 1024)} <= ports
    # Every private subnet (a zone move leaves the old file system in another one).
    for lid, resource in resources.items():
        if resource["Type"] == "AWS::EC2::Subnet" and "Private" in lid:
            assert resource["DeletionPolicy"] == "Retain", lid
    kept = deployed.retained(first_template, {})
    order = [rtype for rtype, _, _ in kept]
    assert order.index("AWS::FSx::FileSystem") < order.index("AWS::EC2::SecurityGroup")
    assert order.index("AWS::EC2::Subnet") < order.index("AWS::EC2::VPC")


def test_a_destroyed_file_system_takes_its_network_along(tmp_path: Path) -> None:
    template = synth({"fsxRemovalPolicy": "destroy"}, outdir=tmp_path)[0]
    for resource in template["Resources"].values():
        if resource["Type"] in ("AWS::EC2::VPC", "AWS::EC2::Subnet", "AWS::FSx::FileSystem"):
            assert resource.get("DeletionPolicy") != "Retain"


def test_create_only_properties_come_from_the_cfn_lint_schemas() -> None:
    paths = replacements.create_only_paths("AWS::FSx::FileSystem", REGION)
    assert ("SubnetIds",) in paths and ("StorageCapacity",) not in paths
    assert ("CapacityType",) in replacements.create_only_paths("AWS::EKS::Nodegroup", REGION)
    assert replacements.create_only_paths(replacements.MANIFEST_TYPE, REGION) == (
        ("ServiceToken",),
    )


# --- Capacity Blocks -------------------------------------------------------------------------

BLOCK = {
    "capacityType": "capacity-block",
    "capacityReservationId": RESERVATION,
    "capacityBlockActive": True,
}


@pytest.mark.usefixtures("newer_kubernetes")
@pytest.mark.parametrize("nodes", [2, 0])
def test_capacity_block_updates_only_at_zero_nodes(tmp_path: Path, nodes: int) -> None:
    """A version bump rolls every node group (Version follows the cluster); a Capacity Block
    group with nodes is refused, per the EKS guide, and goes through at 0 nodes."""
    before = synth({**BLOCK, "gpuNodesDesired": nodes}, outdir=tmp_path / "before")[0]
    after, args, _ = _deploy(before, {"kubernetesVersion": "1.37"}, tmp_path)
    changes = replacements.diff(before, after, region=REGION)
    rolled = {
        c.logical_id for c in changes if c.type == "AWS::EKS::Nodegroup" and "Version" in c.reasons
    }
    assert len(rolled) == 2  # the system nodes and the GPU nodes
    if nodes:
        with pytest.raises(first_deploy.ReplacementRefused) as refused:
            first_deploy.check(**args, acknowledged=())
        message = str(refused.value)
        assert message.startswith("context 'gpuNodesDesired'") and "\n" not in message
        assert "capacity-blocks-mng.html" in message and "NODES=0" in message
    else:
        assert "Version" in first_deploy.check(**args, acknowledged=())


def test_the_images_stack_is_diffed_too(images_template: dict[str, Any]) -> None:
    """A new repository name replaces the images stack's repository (RepositoryName is
    create-only) and deletes its images: refused, named by stack and logical id."""
    after = copy.deepcopy(images_template)
    (repo,) = [r for r in after["Resources"].values() if r["Type"] == "AWS::ECR::Repository"]
    repo["Properties"]["RepositoryName"] = "another-name"
    with pytest.raises(
        first_deploy.ReplacementRefused, match=r"EksFsdpResilientImages\.Repository"
    ):
        first_deploy.check(
            kept={},
            now={},
            last_template=None,
            template={},
            acknowledged=(),
            region=REGION,
            other_stacks={IMAGES_STACK_NAME: (images_template, after)},
        )


# --- the deployed stack, read through the AWS CLI from an emulated CloudFormation ------------


@needs_aws_cli
def test_the_deployed_stack_is_read_back_through_the_aws_cli(
    first_template: dict[str, Any], images_template: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    with emulated_cloudformation() as cfn:
        for key, value in cfn.env().items():
            monkeypatch.setenv(key, value)
        read = dict(stack_name=STACK_NAME, other_stacks=(IMAGES_STACK_NAME,), region=REGION)
        assert deployed.read(**read).status == "none"
        cfn.put(STACK_NAME, first_template)
        cfn.put(IMAGES_STACK_NAME, images_template)
        found = deployed.read(**read)
        assert found.status == "deployed" and found.template == first_template
        assert found.other_templates == {IMAGES_STACK_NAME: images_template}
        assert deployed.kept_settings(found.template)[0]["adminPrincipalArn"] == ADMIN
        assert ("GetTemplate", STACK_NAME) in cfn.calls
        cfn.put(STACK_NAME, first_template, status="UPDATE_IN_PROGRESS")
        busy = deployed.read(**read)
        assert busy.status == "unknown" and "wait" in busy.reason
        cfn.put(STACK_NAME, first_template, status="ROLLBACK_COMPLETE")
        assert deployed.read(**read).status == "none"
        # What make destroy keeps, with the physical ids and the commands, in order.
        cfn.put(STACK_NAME, first_template, physical_ids={_fsx_id(first_template): "fs-0abc"})
        kept = deployed.retained_report(stack_name=STACK_NAME, region=REGION)
        assert "aws fsx delete-file-system --file-system-id fs-0abc" in kept
        assert kept.index("delete-file-system") < kept.index("delete-subnet")
        assert kept.index("delete-subnet") < kept.index("delete-vpc")


def _fsx_id(template: dict[str, Any]) -> str:
    return next(
        lid for lid, r in template["Resources"].items() if r["Type"] == "AWS::FSx::FileSystem"
    )


@needs_aws_cli
def test_destroy_names_every_kept_resource_and_a_file_system_a_zone_move_left(
    first_template: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """make destroy's report: physical ids from ListStackResources followed page by page (the
    emulator answers 10 per page; DescribeStackResources would stop at 100), and a file system
    kept by UpdateReplacePolicy after a zone move, found by CloudFormation's stack-name tag."""
    with emulated_cloudformation() as cfn:
        for key, value in cfn.env().items():
            monkeypatch.setenv(key, value)
        cfn.page_size = 10
        fsx = _fsx_id(first_template)
        order = list(first_template["Resources"])
        assert order.index(fsx) >= cfn.page_size  # its id is on a later page
        cfn.put(STACK_NAME, first_template, physical_ids={fsx: "fs-0new"})
        tag = {"Key": "aws:cloudformation:stack-name", "Value": STACK_NAME}
        cfn.file_systems = [
            {"FileSystemId": "fs-0new", "Tags": [tag]},
            {"FileSystemId": "fs-0old", "Tags": [tag]},  # the zone move's old one
            {"FileSystemId": "fs-0other", "Tags": [{**tag, "Value": "AnotherStack"}]},
        ]
        kept = deployed.retained_report(stack_name=STACK_NAME, region=REGION)
    assert "delete-file-system --file-system-id fs-0new" in kept
    assert "delete-file-system --file-system-id fs-0old" in kept
    assert "fs-0other" not in kept
    assert (
        kept.count("--file-system-id fs-0new") == 1 and f" {fsx}:" not in kept
    )  # its id came from page 2+
    assert ("ListStackResources", STACK_NAME) in cfn.calls


def test_destroy_goes_on_when_the_aws_cli_times_out_or_answers_garbage(
    first_template: dict[str, Any],
) -> None:
    """retained_report never raises: a timeout or an answer that is not JSON is named in the
    report, and the destroy (which writes it) goes on."""
    body = json.dumps({"TemplateBody": json.dumps(first_template)})

    def run(args: list[str], **_: Any) -> subprocess.CompletedProcess:
        if "describe-stacks" in args:
            stacks = {"Stacks": [{"StackStatus": "UPDATE_COMPLETE"}]}
            return subprocess.CompletedProcess(args, 0, json.dumps(stacks), "")
        if "get-template" in args:
            return subprocess.CompletedProcess(args, 0, body, "")
        if "list-stack-resources" in args:
            raise subprocess.TimeoutExpired(args, 60)
        return subprocess.CompletedProcess(args, 0, "<html>not json", "")

    kept = deployed.retained_report(stack_name=STACK_NAME, region=REGION, run=run)
    assert "physical ids unknown" in kept and "zone move left behind unknown" in kept
    assert "aws fsx delete-file-system" in kept


@needs_aws_cli
def test_make_deploy_refuses_another_account_region_an_unsaid_first_deploy_and_bad_pins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """deployCheck=required (infra/deploy_target.py) against the emulated STS and EKS through
    the AWS CLI: a wrong account or region would read as 'no stack' and create a second one."""
    from infra import addon_versions, deploy_target

    with emulated_cloudformation() as cfn:
        for key, value in cfn.env().items():
            monkeypatch.setenv(key, value)
        ok = dict(
            stack_status="deployed",
            stack_name=STACK_NAME,
            region=REGION,
            deployed_region=REGION,
            expected_account=cfn.account,
            first_deploy=False,
            kubernetes_version=addon_versions.KUBERNETES_VERSION,
        )
        deploy_target.check(**ok)
        assert ("GetCallerIdentity", "") in cfn.calls
        assert {n for a, n in cfn.calls if a == "DescribeAddonVersions"} == set(
            addon_versions.EKS_ADDON_VERSIONS
        )
        refusals = {
            "account 123456789012, the CDK deploys to 999999999999": {
                "expected_account": "999999999999"
            },
            "-c region=eu-west-1 differs from us-east-2": {"region": "eu-west-1"},
            "firstDeploy=true": {"stack_status": "none"},
        }
        for expected, change in refusals.items():
            with pytest.raises(deploy_target.DeployRefused) as refused:
                deploy_target.check(**(ok | change))
            assert expected in str(refused.value)
        deploy_target.check(**(ok | {"stack_status": "none", "first_deploy": True}))
        pins = addon_versions.EKS_ADDON_VERSIONS
        cfn.addon_versions = {n: [v] for n, v in pins.items()} | {"vpc-cni": ["v0.0.1"]}
        with pytest.raises(deploy_target.DeployRefused) as refused:
            deploy_target.check(**ok)
        assert f"EKS does not offer vpc-cni {pins['vpc-cni']}" in str(refused.value)
        assert "\n" not in str(refused.value)


@needs_aws_cli
def test_without_credentials_the_stack_is_unknown_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in no_credentials_env().items():
        monkeypatch.setenv(key, value)
    found = deployed.read(stack_name=STACK_NAME, other_stacks=(), region=REGION)
    assert found.status == "unknown" and "credentials" in found.reason
    assert "\n" not in found.reason


def _app(
    tmp_path: Path, env: dict[str, str], **context: Any
) -> tuple[subprocess.CompletedProcess, Path]:
    """app.py as the CDK CLI runs it: cdk.json's context and the `-c` values (strings) merged
    in CDK_CONTEXT_JSON, cdk-nag on, from the repository root."""
    out = tmp_path / "out"
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    merged = {**CDK_JSON_CONTEXT, **context}
    proc = subprocess.run(
        [sys.executable, "app.py"],
        cwd=REPO_ROOT,
        env={
            **base,
            **env,
            "CDK_CONTEXT_JSON": json.dumps(merged),
            "CDK_OUTDIR": str(out),
            "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
            "CDK_VALIDATION": "false",  # cdk-nag still runs; tests/infra/test_infra_cli.py
        },
        capture_output=True,
        text=True,
        timeout=400,
    )
    return proc, out


@pytest.mark.slow
@needs_aws_cli
def test_the_app_from_a_clean_clone_keeps_the_deployed_settings(tmp_path: Path) -> None:
    """`make gpu-nodes NODES=2` (app.py with -c gpuNodesDesired=2) from a clone with no local
    state, against main's deployed stack: the first deploy's admin, endpoint and FSx size are
    read back and kept, the report says so, nothing is refused, and the only removal is the
    upgrade's intended one (the per-namespace scraper Roles)."""
    before = json.loads((FIXTURES / "deployed-main-bafc8b0.template.json").read_text())
    images = json.loads((FIXTURES / "deployed-main-bafc8b0.images.template.json").read_text())
    with emulated_cloudformation() as cfn:
        cfn.put(STACK_NAME, before)
        cfn.put(IMAGES_STACK_NAME, images)
        proc, out = _app(tmp_path, cfn.env(), gpuNodesDesired="2", deployCheck="required")
        # The synth `make destroy` runs first: what the destroy keeps, and how to delete it.
        destroy, destroy_out = _app(tmp_path / "destroy", cfn.env(), deployCheck="destroy")
    assert destroy.returncode == 0, destroy.stderr[-3000:]
    kept = (destroy_out / "retained.txt").read_text()
    assert "aws fsx delete-file-system" in kept and "AWS::KMS::Key" in kept
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"adminPrincipalArn={json.dumps(ADMIN)}" in proc.stderr
    assert (
        "fsxStorageCapacityGiB=1200" in proc.stderr and "given now: gpuNodesDesired" in proc.stderr
    )
    report = proc.stderr.split("against the deployed stack:")[1]
    # The upgrade's intended changes (UPGRADE_FROM_BAFC8B0): its one removal.
    removed = [line for line in report.splitlines() if line.strip().startswith("remove")]
    assert len(removed) == 1 and "ScraperRbac" in removed[0], report
    # Nothing stateful replaced or removed (marked "!"); the kubectl Lambda layers' content is
    # an asset of this clone's build (replaced, holding no state).
    assert not [line for line in report.splitlines() if line.startswith("!")], report
    template = json.loads((out / f"{STACK_NAME}.template.json").read_text())
    _access_kept(template)
    assert deployed.stored_settings(template)["fsxStorageCapacityGiB"] == 1200


@pytest.mark.slow
@needs_aws_cli
def test_make_deploy_where_no_stack_exists_needs_the_first_deploy_said(tmp_path: Path) -> None:
    """`make deploy` (app.py with -c deployCheck=required) against an emulated account that holds
    no stack: without -c firstDeploy=true it is refused in one line naming the fix, before
    anything is synthesized; with it, the report says first deploy and the stack stores the
    first deploy's -c values."""
    with emulated_cloudformation() as cfn:
        refused, refused_out = _app(
            tmp_path / "unsaid", cfn.env(), deployCheck="required", **FIRST_DEPLOY
        )
        proc, out = _app(
            tmp_path, cfn.env(), deployCheck="required", firstDeploy="true", **FIRST_DEPLOY
        )
    assert refused.returncode != 0
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("Refused:")]
    assert line == refused.stderr.strip().splitlines()[-1]
    assert f"no stack {STACK_NAME} in account {cfn.account}, region {REGION}" in line
    assert 'Fix: if this is the first deploy, say so: make deploy ARGS="-c firstDeploy=true' in line
    assert not (refused_out / f"{STACK_NAME}.template.json").exists()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = proc.stderr.split("What this deploy changes, against the deployed stack:\n")[1]
    assert report.splitlines()[0] == "first deploy"
    assert "Refused" not in proc.stderr and "Kept from" not in proc.stderr
    template = json.loads((out / f"{STACK_NAME}.template.json").read_text())
    assert deployed.stored_settings(template) == FIRST_DEPLOY
    assert {("DescribeStacks", STACK_NAME), ("GetCallerIdentity", "")} <= set(cfn.calls)


@pytest.mark.slow
@needs_aws_cli
def test_the_app_without_credentials_says_what_it_could_not_check(tmp_path: Path) -> None:
    proc, _ = _app(tmp_path, no_credentials_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("Not checked")]
    assert len(lines) == 1 and "credentials" in lines[0]
    refused, _ = _app(tmp_path / "deploy", no_credentials_env(), deployCheck="required")
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("Refused: could not read the deployed stack") and "credentials" in last


@pytest.mark.slow
@needs_aws_cli
@requires(cdk_cli_reason())
def test_make_diff_through_the_cdk_cli_refuses_a_zone_move_with_nodes(
    first_template: dict[str, Any], images_template: dict[str, Any], tmp_path: Path
) -> None:
    """The real `make diff` (the pinned CDK CLI's `cdk synth --no-lookups`, then app.py) from
    this clone, which has no deploy state, against the emulated stack: a zone move with the
    first deploy's nodes is refused in one line with the steps."""
    running = copy.deepcopy(first_template)
    _gpu_group(running)["Properties"]["ScalingConfig"]["DesiredSize"] = 2
    settings = deployed.stored_settings(running) | {"gpuNodesDesired": "2"}
    running["Resources"]["DeploySettings"]["Properties"]["Value"] = json.dumps(settings)
    with emulated_cloudformation() as cfn:
        cfn.put(STACK_NAME, running, physical_ids={_fsx_id(running): "fs-0abc"})
        cfn.put(IMAGES_STACK_NAME, images_template)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | cfn.env()
        out = tmp_path / "cdk.out"
        make = ["make", "--no-print-directory", f"CDK=node_modules/.bin/cdk --output {out}"]
        diff = subprocess.run(
            [*make, "diff", "ARGS=-c gpuAvailabilityZone=us-east-2b"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=500,
        )
        assert diff.returncode != 0
        refusal = [line for line in diff.stderr.splitlines() if line.startswith("Refused:")]
        assert len(refusal) == 1 and "make gpu-nodes NODES=0" in refusal[0], diff.stderr[-3000:]
        assert "Kept from the stack's DeploySettings parameter" in diff.stderr
    assert ("GetTemplate", STACK_NAME) in cfn.calls
