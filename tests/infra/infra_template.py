"""Assertion helpers for the fine-grained template tests, tests/infra/test_<construct>.py (EFA
launch template, placement group, node groups, FSx, Pod Identity, Helm charts, cluster security,
Kubernetes objects, outputs):

    .venv/bin/pytest tests/infra/test_gpu_nodegroup.py     # one construct
    .venv/bin/pytest tests/infra -k 'not day_two'          # all of infra, ~40 s of synthesis

The checks use aws_cdk.assertions.Template. Its patterns match objects partly (extra keys are
allowed) and arrays exactly (length and order); `Match.exact` / `Match.object_equals` mark the
places where the whole value is pinned. Where a pattern cannot say it (text inside an Fn::Join,
the user-data script, sets of values), a Capture or find_resources hands the value to a short
Python check.

Everything runs offline; whether AWS accepts the template (capacity, quotas, the charts being
reachable) can only be seen by `make deploy` in an account.
"""

from __future__ import annotations

from typing import Any

from aws_cdk.assertions import Capture, Match, Template

LAUNCH_TEMPLATE = "AWS::EC2::LaunchTemplate"
NODEGROUP = "AWS::EKS::Nodegroup"
GPU_AMI = {"AmiType": "AL2023_x86_64_NVIDIA"}
HELM_CHART = "Custom::AWSCDK-EKS-HelmChart"
K8S_RESOURCE = "Custom::AWSCDK-EKS-KubernetesResource"


def only_one_has(
    template: Template,
    type_: str,
    props: dict[str, Any],
    *,
    selector: dict[str, Any] | None = None,
) -> None:
    """Exactly one `type_` resource matches `selector` (all of that type when none), and that
    one has `props` too: a second resource that matches would hide a wrong first one."""
    if selector:
        template.resource_properties_count_is(type_, selector, 1)
    else:
        template.resource_count_is(type_, 1)
    template.has_resource_properties(type_, {**(selector or {}), **props})


def launch_template_has(template: Template, data: dict[str, Any]) -> None:
    """The stack's one launch template has `data` in its LaunchTemplateData."""
    only_one_has(template, LAUNCH_TEMPLATE, {"LaunchTemplateData": data})


def gpu_nodegroup_has(template: Template, props: dict[str, Any]) -> None:
    only_one_has(template, NODEGROUP, props, selector=GPU_AMI)


def resource_has(template: Template, logical_id: str, type_: str, props: dict[str, Any]) -> None:
    """The resource `logical_id` is a `type_` whose properties match `props` (template_matches
    fills no Capture: capture through has_resource_properties instead)."""
    template.template_matches({"Resources": {logical_id: {"Type": type_, "Properties": props}}})


def cluster_security_group(template: Template) -> dict[str, Any]:
    """The EKS-created security group that every node (and the primary interface) is in."""
    return {"Fn::GetAtt": [template.get_resource_id("AWS::EKS::Cluster"), "ClusterSecurityGroupId"]}


def efa_security_group_id(template: Template) -> str:
    return template.get_resource_id(
        "AWS::EC2::SecurityGroup",
        {"Properties": {"GroupDescription": Match.string_like_regexp("EFA")}},
    )


def gpu_subnets(template: Template) -> list[Any]:
    subnets = Capture()
    gpu_nodegroup_has(template, {"Subnets": subnets})
    return subnets.as_array()
