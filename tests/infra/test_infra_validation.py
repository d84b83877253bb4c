"""Real validators on the synthesized templates: cfn-lint, cdk-nag (AwsSolutions) with CDK's
built-in CloudFormation validation, and the acknowledgments' reasons.

    .venv/bin/pytest tests/infra/test_infra_validation.py    # ~60 s on 2 cores

cfn-lint checks the template against the CloudFormation resource schemas offline; what it cannot
know (quotas, capacity, service-side limits) only shows at deploy time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk import aws_ec2 as ec2
from infra_synth import VARIANT_CONTEXT, synth
from support import cfn_lint

from infra import nag

# Every cfn-lint rule this project ignores, with the reason.
CFN_LINT_IGNORED = {
    "W3010": "AZs are hardcoded on purpose: they come from the context (availabilityZones), so "
    "synth needs no AZ lookup and the GPU subnet is in the capacity reservation's AZ.",
    "W3005": "aws-cdk-lib's eks_v2 adds DependsOn entries that a Ref already implies (cluster -> "
    "subnets, kubectl handler -> its role); harmless and not ours to change.",
}


@pytest.mark.parametrize("fixture", ["default_template", "variant_template", "images_template"])
def test_cfn_lint_finds_nothing_else(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    template: dict[str, Any] = request.getfixturevalue(fixture)
    path = tmp_path / "template.json"
    path.write_text(json.dumps(template))
    result = cfn_lint(path, "--regions", "us-east-2", "--ignore-checks", *CFN_LINT_IGNORED)
    assert result.stdout == "" and result.returncode == 0, result.stdout + result.stderr


def test_cfn_lint_really_lints(tmp_path: Path) -> None:
    """The same invocation reports an error on a broken template (the test above can fail)."""
    path = tmp_path / "bad.json"
    bad = {
        "Resources": {
            "Fs": {"Type": "AWS::FSx::FileSystem", "Properties": {"FileSystemType": "LUSTRE"}}
        }
    }
    path.write_text(json.dumps(bad))
    result = cfn_lint(path, timeout=120)
    assert result.returncode != 0 and ":E" in result.stdout


def test_cdk_nag_and_builtin_validation_pass(tmp_path: Path) -> None:
    """Full validation (cdk-nag plugin + CloudFormation validation): synth raises on any
    unacknowledged finding; the report says both plugins succeeded."""
    synth(VARIANT_CONTEXT, outdir=tmp_path, validate=True)
    report = json.loads((tmp_path / "validation-report.json").read_text())
    conclusions = {p["pluginName"]: p["conclusion"] for p in report["pluginReports"]}
    assert conclusions.get("AwsSolutions") == "success", report
    assert all(c == "success" for c in conclusions.values()), report


def test_cdk_nag_really_checks(tmp_path: Path) -> None:
    """The same plugin fails synthesis on a security group open to the world."""
    app = cdk.App(outdir=str(tmp_path), analytics_reporting=False)
    stack = cdk.Stack(app, "Open")
    vpc = ec2.Vpc(
        stack,
        "Vpc",
        max_azs=1,
        nat_gateways=0,
        subnet_configuration=[ec2.SubnetConfiguration(name="p", subnet_type=ec2.SubnetType.PUBLIC)],
    )
    group = ec2.SecurityGroup(stack, "Group", vpc=vpc)
    group.add_ingress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(22))
    nag.add_checks(app)
    with pytest.raises(RuntimeError, match="ValidationFailed") as caught:
        app.synth()
    assert "AwsSolutions-EC23" in str(caught.value)


def test_every_acknowledgment_has_a_specific_reason() -> None:
    tables = [nag.CLUSTER_ROLE, nag.NODE_ROLE, nag.KUBECTL_PROVIDER, nag.FSX_CSI_ROLE]
    reasons = [reason for table in tables for reason in table.values()]
    assert len(reasons) == len(set(reasons)), "each acknowledgment says why, in its own words"
    for table in tables:
        for rule, reason in table.items():
            assert rule.startswith("AwsSolutions-"), rule
            assert len(reason) >= 60, f"{rule}: reason too short to be specific"
