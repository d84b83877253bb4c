"""The IaC checks (infra/nag.py): this repository's own EKS checks and the acknowledged checkov
findings.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

import json
from typing import Any

from aws_cdk.assertions import Match, Template
from infra_template import (
    only_one_has,
)

from infra.nag import CHECKOV_KUBECTL_PROVIDER, eks_cluster_findings


def test_own_eks_checks_catch_an_open_cluster(
    default_assertions: Template, default_template: dict[str, Any]
) -> None:
    # A broken copy of the plain dict: Template offers no way to edit a template.
    template = json.loads(json.dumps(default_template))
    cluster_id = default_assertions.get_resource_id("AWS::EKS::Cluster")
    cluster = template["Resources"][cluster_id]["Properties"]
    cluster["ResourcesVpcConfig"].update(EndpointPublicAccess=True, PublicAccessCidrs=[])
    cluster["Logging"]["ClusterLogging"]["EnabledTypes"] = [{"Type": "api"}]
    del cluster["EncryptionConfig"]
    findings = " | ".join(eks_cluster_findings(template))
    assert "open to the internet" in findings
    assert "'audit'" in findings
    assert "not encrypted" in findings


def test_checkov_findings_are_acknowledged_on_their_resources(
    default_assertions: Template,
    default_template: dict[str, Any],
    images_template: dict[str, Any],
) -> None:
    """checkov 3.3.30 over the default and variant templates found only these, on aws-cdk-lib's
    kubectl provider functions; each carries its acknowledgment (infra/nag.py) in the template,
    where `checkov -d cdk.out` reads it."""
    # Every function (all_resources fails when there is none), in the table's order, each
    # comment over 40 characters.
    skips = [
        {"id": rule, "comment": Match.string_like_regexp(r"[\s\S]{41}")}
        for rule in CHECKOV_KUBECTL_PROVIDER
    ]
    default_assertions.all_resources(
        "AWS::Lambda::Function", {"Metadata": {"checkov": {"skip": skips}}}
    )
    # Fixed rather than acknowledged: ECR encrypted with KMS (CKV_AWS_136), in the images stack.
    only_one_has(
        Template.from_json(images_template),
        "AWS::ECR::Repository",
        {"EncryptionConfiguration": Match.exact({"EncryptionType": "KMS"})},
    )
    # Nothing else is skipped anywhere: over resources of every type, which Template's
    # look-ups (one type at a time) cannot span, so over the plain dict.
    skipped = [
        k for k, r in default_template["Resources"].items() if "checkov" in r.get("Metadata", {})
    ]
    assert set(skipped) == set(default_assertions.find_resources("AWS::Lambda::Function"))
