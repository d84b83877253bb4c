"""Day two: every docs/eks.md step after the first deploy, synthesized before and after, offline.

    .venv/bin/pytest tests/infra/test_day_two.py        # ~20 s on 2 cores

Each step is the context a user adds after the first `make deploy` (cdk.json's defaults). The
changes come from infra/replacements.py, the same code `make diff` and every synth run: create-
only properties from the CloudFormation schemas cfn-lint ships, changed logical ids, and the
Kubernetes objects the kubectl custom resource applies. What cannot run here: CloudFormation
itself (a replacement it decides from the live stack) and the kubectl handler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from infra_synth import CDK_JSON_CONTEXT, mask_asset_hashes, synth

from infra import first_deploy, replacements
from infra.config import STACK_NAME

REPO_ROOT = Path(__file__).resolve().parents[2]
REGION = CDK_JSON_CONTEXT["region"]
RESERVATION = "cr-0123456789abcdef0"

# docs/eks.md's steps after the first deploy: (name, context added to cdk.json's).
STEPS: dict[str, dict[str, Any]] = {
    "gpu-nodes": {"gpuNodesDesired": 2},
    "reservation": {
        "capacityType": "capacity-reservation",
        "capacityReservationId": RESERVATION,
        "gpuNodesDesired": 2,
    },
    "fsx-size": {"fsxStorageCapacityGiB": 9600},
    "fsx-throughput": {"fsxThroughputPerUnit": 500},
    "kubernetes-version": {"kubernetesVersion": "1.37"},
}
# Steps that cannot avoid a replacement: refused unless acknowledged, and what they replace.
UNAVOIDABLE: dict[str, tuple[dict[str, Any], str, set[str]]] = {
    "capacity-block": (
        {"capacityType": "capacity-block", "capacityReservationId": RESERVATION},
        "capacityType",
        {"AWS::EKS::Nodegroup"},
    ),
    "zone": (
        {"gpuAvailabilityZone": "us-east-2b"},
        "gpuAvailabilityZone",
        {"AWS::EKS::Nodegroup", "AWS::FSx::FileSystem", "PersistentVolume"},
    ),
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


def _store_template(template: dict[str, Any]) -> Any:
    """The rendezvous store Deployment's pod template, as the kubectl handler applies it."""
    for lid, resource in template["Resources"].items():
        if resource["Type"] != replacements.MANIFEST_TYPE:
            continue
        objects = replacements._kubernetes_objects(resource, frozenset())
        for (kind, _, _name), obj in objects.items():
            if kind == "Deployment":
                return lid, obj["spec"]["template"]
    raise AssertionError("no Deployment among the stack's Kubernetes objects")


def _step(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    context = STEPS.get(name) or UNAVOIDABLE[name][0]
    if name == "kubernetes-version":
        request.getfixturevalue("newer_kubernetes")
    return synth(context, outdir=tmp_path / name)[0]


@pytest.mark.parametrize("name", list(STEPS))
def test_step_replaces_no_state_and_restarts_no_store(
    name: str, default_template: dict[str, Any], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    after = _step(name, tmp_path, request)
    changes = replacements.diff(default_template, after, region=REGION)
    assert not replacements.destructive(changes), replacements.summary(changes)
    assert not replacements.output_changed(default_template, after, "ImageUri")
    assert _store_template(default_template) == _store_template(after)
    # The report the app prints accepts it without acknowledgment.
    report = first_deploy.check(
        kept=dict.fromkeys(first_deploy.FIRST_DEPLOY_KEYS) | _kept(),
        now=_now(name),
        last_template=default_template,
        template=after,
        acknowledged=()
        if name not in ("reservation",)
        else ("capacityType", "capacityReservationId"),
        region=REGION,
    )
    assert "!" not in report


def _kept() -> dict[str, str]:
    return {
        "gpuAvailabilityZone": CDK_JSON_CONTEXT["gpuAvailabilityZone"],
        "capacityType": "on-demand",
        "capacityReservationId": "none",
        "capacityReservationPlacementGroup": "none",
    }


def _now(name: str) -> dict[str, str]:
    context = STEPS.get(name) or UNAVOIDABLE[name][0]
    return {
        **_kept(),
        **{k: str(v) for k, v in context.items() if k in first_deploy.FIRST_DEPLOY_KEYS},
    }


@pytest.mark.parametrize("name", list(UNAVOIDABLE))
def test_unavoidable_replacement_is_refused_unless_acknowledged(
    name: str, default_template: dict[str, Any], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    _, setting, must_replace = UNAVOIDABLE[name]
    after = _step(name, tmp_path, request)
    changes = replacements.diff(default_template, after, region=REGION)
    assert {c.type for c in replacements.destructive(changes)} == must_replace
    # Never the cluster, the trainer image or the store.
    assert not any(c.type == "AWS::EKS::Cluster" for c in changes if c.destructive)
    assert not replacements.output_changed(default_template, after, "ImageUri")
    assert _store_template(default_template) == _store_template(after)

    args = dict(kept=_kept(), now=_now(name), last_template=default_template, template=after)
    with pytest.raises(first_deploy.ReplacementRefused) as refused:
        first_deploy.check(**args, acknowledged=(), region=REGION)
    message = str(refused.value)
    assert "\n" not in message and setting in message
    assert f"acknowledgeReplacement={setting}" in message
    assert "!" in refused.value.report  # what it replaces is printed with the refusal
    ack = tuple(k for k in first_deploy.FIRST_DEPLOY_KEYS if _now(name)[k] != _kept()[k])
    report = first_deploy.check(**args, acknowledged=ack, region=REGION)
    for change in replacements.destructive(changes):
        assert change.logical_id in report


def test_a_replaced_stateful_resource_without_a_setting_is_refused(
    default_template: dict[str, Any],
) -> None:
    """A code change that replaces state (here: the FSx subnet, as a changed zone would) with
    no first-deploy setting changed is refused by the resource's logical id."""
    import copy

    after = copy.deepcopy(default_template)
    fsx = next(lid for lid, r in after["Resources"].items() if r["Type"] == "AWS::FSx::FileSystem")
    after["Resources"][fsx]["Properties"]["SubnetIds"] = [{"Ref": "SomeOtherSubnet"}]
    args = dict(kept=_kept(), now=_kept(), last_template=default_template, template=after)
    with pytest.raises(first_deploy.ReplacementRefused, match=fsx) as refused:
        first_deploy.check(**args, acknowledged=(), region=REGION)
    # The PV that names the file system cannot follow it: the fix names both.
    ack = str(refused.value).rsplit("acknowledgeReplacement=", 1)[1].split(",")
    assert ack[0] == fsx and len(ack) == 2
    first_deploy.check(**args, acknowledged=tuple(ack), region=REGION)


def test_create_only_properties_come_from_the_cfn_lint_schemas() -> None:
    paths = replacements.create_only_paths("AWS::FSx::FileSystem", REGION)
    assert ("SubnetIds",) in paths and ("StorageCapacity",) not in paths
    assert ("CapacityType",) in replacements.create_only_paths("AWS::EKS::Nodegroup", REGION)
    # Custom resources: the generic schema (only the provider is create-only).
    assert replacements.create_only_paths(replacements.MANIFEST_TYPE, REGION) == (
        ("ServiceToken",),
    )


def test_first_deploy_settings_round_trip_and_bad_lines() -> None:
    text = first_deploy.render(_kept())
    assert first_deploy.parse(text) == _kept()
    with pytest.raises(first_deploy.ConfigError, match="line 1"):
        first_deploy.parse("zone=us-east-2a\n")


def _make_dry_run(*variables: str) -> str:
    return subprocess.run(
        ["make", "-n", "--no-print-directory", *variables],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_make_deploy_keeps_the_first_deploy_settings(tmp_path: Path) -> None:
    """Every later deploy passes the kept settings before ARGS (the CLI keeps the last -c of a
    key), and keeps the templates and settings of a deploy that succeeded."""
    (tmp_path / first_deploy.SETTINGS_FILE).write_text(first_deploy.render(_kept()))
    state = f"STATE_DIR={tmp_path}"
    out = _make_dry_run("deploy", state, "GPU_NODES_FILE=/nonexistent", "ARGS=-c x=1")
    line = next(x for x in out.splitlines() if " deploy " in x)
    assert line.index("-c gpuAvailabilityZone=us-east-2a") < line.index("-c x=1")
    assert f"-c {first_deploy.STATE_DIR_KEY}={tmp_path}" in line
    assert f"-m infra.first_deploy keep cdk.out --stack {STACK_NAME} --state-dir {tmp_path}" in out
    # make diff synthesizes with the same context (the app prints the same report).
    diff = _make_dry_run("diff", state, "GPU_NODES_FILE=/nonexistent")
    assert "-c gpuAvailabilityZone=us-east-2a" in diff
    destroy = _make_dry_run("destroy", state, "GPU_NODES_FILE=/nonexistent")
    for name in (
        first_deploy.SETTINGS_FILE,
        first_deploy.LAST_TEMPLATE_FILE,
        *first_deploy.KEPT_STACKS.values(),
    ):
        assert f"{tmp_path}/{name}" in destroy


def test_keep_writes_every_file_or_none(tmp_path: Path, default_app: Any) -> None:
    assembly = Path(default_app[1].synth().directory)
    state = tmp_path / "state"
    state.mkdir()
    # No settings file in this assembly (app.py writes it): nothing is kept.
    assert first_deploy.main(["keep", str(tmp_path / "empty"), "--state-dir", str(state)]) == 2
    assert list(state.iterdir()) == []
    (assembly / first_deploy.SETTINGS_FILE.lstrip(".")).write_text(first_deploy.render(_kept()))
    assert first_deploy.main(["keep", str(assembly), "--state-dir", str(state)]) == 0
    kept, template, others = first_deploy.load_kept(state)
    assert kept == _kept() and template == default_app[0]
    assert set(others) == set(first_deploy.KEPT_STACKS) and all(others.values())


@pytest.mark.slow
def test_the_app_refuses_a_changed_zone_in_one_line(
    default_template: dict[str, Any], tmp_path: Path
) -> None:
    """app.py as the CDK CLI runs it (context in CDK_CONTEXT_JSON, cdk-nag on): the kept
    settings and template in a state folder, a new zone on the command line."""
    state = tmp_path / "state"
    state.mkdir()
    (state / first_deploy.SETTINGS_FILE).write_text(first_deploy.render(_kept()))
    (state / first_deploy.LAST_TEMPLATE_FILE).write_text(json.dumps(default_template))

    def run(**extra: Any) -> subprocess.CompletedProcess:
        context = {**CDK_JSON_CONTEXT, first_deploy.STATE_DIR_KEY: str(state), **extra}
        env = {
            **os.environ,
            "CDK_CONTEXT_JSON": json.dumps(context),
            "CDK_OUTDIR": str(tmp_path / "out"),
            "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
            "CDK_VALIDATION": "false",  # cdk-nag still runs; tests/infra/test_infra_cli.py
        }
        return subprocess.run(
            [sys.executable, "app.py"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
        )

    refused = run(gpuAvailabilityZone="us-east-2b")
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("Refused: context 'gpuAvailabilityZone'")
    assert "acknowledgeReplacement=gpuAvailabilityZone" in last
    assert "! replace" in refused.stderr  # the report, printed before the refusal

    accepted = run(gpuAvailabilityZone="us-east-2b", acknowledgeReplacement="gpuAvailabilityZone")
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    assert "AWS::FSx::FileSystem" in accepted.stderr
    written = (tmp_path / "out" / first_deploy.SETTINGS_FILE.lstrip(".")).read_text()
    assert first_deploy.parse(written)["gpuAvailabilityZone"] == "us-east-2b"


def test_the_store_runs_its_own_image(default_template: dict[str, Any]) -> None:
    """The store's pod template names the store's asset, never the trainer's image (whose
    every change would otherwise restart the store under running launchers)."""
    _, template = _store_template(default_template)
    (container,) = template["spec"]["containers"]
    trainer = replacements._flatten(default_template["Outputs"]["ImageUri"]["Value"], frozenset())
    assert f"/{CDK_JSON_CONTEXT['imageRepositoryName']}:" in container["image"]
    assert container["image"] != trainer


BLOCK = {
    "capacityType": "capacity-block",
    "capacityReservationId": RESERVATION,
    "capacityBlockActive": True,
}
BLOCK_KEPT = {**_kept(), "capacityType": "capacity-block", "capacityReservationId": RESERVATION}


@pytest.mark.usefixtures("newer_kubernetes")
@pytest.mark.parametrize("nodes", [2, 0])
def test_capacity_block_updates_only_at_zero_nodes(tmp_path: Path, nodes: int) -> None:
    """A version bump rolls every node group (Version follows the cluster); a Capacity Block
    group with nodes is refused, per the EKS guide, and goes through at 0 nodes."""
    before = synth({**BLOCK, "gpuNodesDesired": nodes}, outdir=tmp_path / "before")[0]
    after = synth(
        {**BLOCK, "gpuNodesDesired": nodes, "kubernetesVersion": "1.37"}, outdir=tmp_path / "after"
    )[0]
    changes = replacements.diff(before, after, region=REGION)
    rolled = {
        c.logical_id for c in changes if c.type == "AWS::EKS::Nodegroup" and "Version" in c.reasons
    }
    assert len(rolled) == 2  # the system nodes and the GPU nodes
    args = dict(kept=BLOCK_KEPT, now=BLOCK_KEPT, last_template=before, template=after)
    if nodes:
        with pytest.raises(first_deploy.ReplacementRefused) as refused:
            first_deploy.check(**args, acknowledged=(), region=REGION)
        message = str(refused.value)
        assert message.startswith("context 'gpuNodesDesired'") and "\n" not in message
        assert "capacity-blocks-mng.html" in message and "NODES=0" in message
    else:
        assert "Version" in first_deploy.check(**args, acknowledged=(), region=REGION)


def test_capacity_block_launch_template_change_is_refused_with_nodes(tmp_path: Path) -> None:
    """A new launch template version (here: edited user data) rolls the nodes like a version
    bump: the node group's LaunchTemplate.Version follows the template's latest version."""
    import copy

    before = synth({**BLOCK, "gpuNodesDesired": 2}, outdir=tmp_path / "before")[0]
    after = copy.deepcopy(before)
    template = next(
        r for r in after["Resources"].values() if r["Type"] == "AWS::EC2::LaunchTemplate"
    )
    template["Properties"]["LaunchTemplateData"]["UserData"] = {"Fn::Base64": "edited"}
    changes = replacements.diff(before, after, region=REGION)
    gpu = [c for c in changes if c.type == "AWS::EKS::Nodegroup"]
    assert [c.reasons for c in gpu] == [("LaunchTemplate",)]
    with pytest.raises(first_deploy.ReplacementRefused, match="gpuNodesDesired"):
        first_deploy.check(
            kept=BLOCK_KEPT,
            now=BLOCK_KEPT,
            last_template=before,
            template=after,
            acknowledged=(),
            region=REGION,
        )


def test_a_stack_deployed_before_issue_33_is_updated_in_place(tmp_path: Path) -> None:
    """The template a stack deployed before these fixes holds (cdk.json's defaults at commit
    644927e, asset hashes masked): today's app, given it as the last deploy, replaces nothing.
    The fixes that touch create-only properties keep what the stack has: the cluster's
    bootstrap creator admin (kept; docs/day-two.md says how to remove it), the node roles
    (same roles, new policy lists), the FSx security groups (rules added, not moved). The one
    thing it removes is the old ECR repository (images now live in the images stack's): the
    app refuses that until acknowledged, since CI's images in it go with it."""
    fixture = Path(__file__).parent / "fixtures" / "deployed-before-issue-33.template.json"
    before = json.loads(fixture.read_text())
    # Masked as the fixture is (asset hashes follow every file of their build context).
    after = mask_asset_hashes(
        synth({"gpuRootVolumeGiB": 500}, outdir=tmp_path / "now", last_template=before)[0]
    )
    changes = replacements.diff(before, after, region=REGION)
    lost = [c for c in changes if c.action in ("replace", "remove")]
    assert [(c.type, c.action) for c in lost] == [("AWS::ECR::Repository", "remove")], (
        replacements.summary(changes)
    )
    args = dict(kept=_kept(), now=_kept(), last_template=before, template=after)
    with pytest.raises(first_deploy.ReplacementRefused, match=lost[0].logical_id):
        first_deploy.check(**args, acknowledged=(), region=REGION)
    first_deploy.check(**args, acknowledged=(lost[0].logical_id,), region=REGION)
    # A deployed cluster keeps its creator admin; a new one gets none.
    assert first_deploy.keeps_creator_admin(before)
    cluster = next(r for r in after["Resources"].values() if r["Type"] == "AWS::EKS::Cluster")
    assert "BootstrapClusterCreatorAdminPermissions" not in cluster["Properties"]["AccessConfig"]


def test_the_images_stack_is_diffed_too(images_template: dict[str, Any]) -> None:
    """A new repository name replaces the images stack's repository (RepositoryName is
    create-only) and deletes its images: refused, named by stack and logical id."""
    import copy

    after = copy.deepcopy(images_template)
    (repo,) = [r for r in after["Resources"].values() if r["Type"] == "AWS::ECR::Repository"]
    repo["Properties"]["RepositoryName"] = "another-name"
    with pytest.raises(
        first_deploy.ReplacementRefused, match=r"EksFsdpResilientImages\.Repository"
    ):
        first_deploy.check(
            kept=_kept(),
            now=_kept(),
            last_template=None,
            template={},
            acknowledged=(),
            region=REGION,
            other_stacks={"EksFsdpResilientImages": (images_template, after)},
        )
