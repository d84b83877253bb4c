"""The EKS cluster (infra/cluster.py, infra/pod_identity.py): endpoint and secrets security,
access entries, core add-ons, the system node group, node roles, Pod Identity trust, node repair.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from aws_cdk.assertions import Capture, Match, Template
from infra_synth import VARIANT_CONTEXT
from infra_template import (
    NODEGROUP,
    gpu_nodegroup_has,
    only_one_has,
    resource_has,
)

from infra.nag import eks_cluster_findings


def test_system_nodegroup_is_small_and_on_demand(default_assertions: Template) -> None:
    only_one_has(
        default_assertions,
        NODEGROUP,
        {
            "CapacityType": "ON_DEMAND",
            "InstanceTypes": ["m7i.xlarge"],
            "ScalingConfig": {"DesiredSize": 2},
        },
        selector={"AmiType": "AL2023_x86_64_STANDARD"},
    )


def test_cluster_security(
    default_assertions: Template,
    variant_assertions: Template,
    default_template: dict[str, Any],
    variant_template: dict[str, Any],
) -> None:
    only_one_has(
        default_assertions,
        "AWS::EKS::Cluster",
        {
            "Version": "1.36",
            "ResourcesVpcConfig": {
                "EndpointPublicAccess": False,  # no CIDRs configured: private only
                "EndpointPrivateAccess": True,
            },
        },
    )
    only_one_has(
        variant_assertions,
        "AWS::EKS::Cluster",
        {
            "ResourcesVpcConfig": {
                "EndpointPublicAccess": True,
                "PublicAccessCidrs": ["203.0.113.7/32", "198.51.100.0/24"],
            }
        },
    )
    # infra.nag's own checks read plain dicts (they run on cdk.out too).
    assert eks_cluster_findings(default_template) == []
    assert eks_cluster_findings(variant_template) == []


def test_admin_access_entry(default_assertions: Template, variant_assertions: Template) -> None:
    admin = {"PrincipalArn": VARIANT_CONTEXT["adminPrincipalArn"]}
    default_assertions.resource_properties_count_is("AWS::EKS::AccessEntry", admin, 0)
    # The policy ARN is an Fn::Join over the partition: look for its name in the JSON.
    policy_arn = Capture()
    only_one_has(
        variant_assertions,
        "AWS::EKS::AccessEntry",
        {
            "AccessPolicies": [
                {"AccessScope": Match.exact({"Type": "cluster"}), "PolicyArn": policy_arn}
            ]
        },
        selector=admin,
    )
    assert "AmazonEKSClusterAdminPolicy" in json.dumps(policy_arn.as_object())


def test_core_addons(default_assertions: Template) -> None:
    addons = default_assertions.find_resources("AWS::EKS::Addon")
    names = {r["Properties"]["AddonName"] for r in addons.values()}
    assert names == {
        "eks-pod-identity-agent",
        "eks-node-monitoring-agent",
        "aws-fsx-csi-driver",
        "vpc-cni",  # managed: its own role, network policy agent on
    }


def _policy(name: str) -> dict[str, Any]:
    return {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, f":iam::aws:policy/{name}"]]}


def test_node_roles_pull_images_only_and_leave_eni_calls_to_aws_node(
    default_assertions: Template,
) -> None:
    from infra.cluster import NODE_ROLE_POLICIES

    for nodegroup in default_assertions.find_resources(NODEGROUP).values():
        role_id = nodegroup["Properties"]["NodeRole"]["Fn::GetAtt"][0]
        resource_has(
            default_assertions,
            role_id,
            "AWS::IAM::Role",
            {"ManagedPolicyArns": Match.exact([_policy(p) for p in NODE_ROLE_POLICIES])},
        )
        assert "PullOnly" in NODE_ROLE_POLICIES[1]
    # aws-node: the managed VPC CNI add-on, its own role through Pod Identity, network policy on.
    addon = Capture()
    only_one_has(
        default_assertions,
        "AWS::EKS::Addon",
        {
            "ConfigurationValues": addon,
            "PodIdentityAssociations": [
                {
                    "ServiceAccount": "aws-node",
                    "RoleArn": {"Fn::GetAtt": [Match.any_value(), "Arn"]},
                }
            ],
        },
        selector={"AddonName": "vpc-cni"},
    )
    assert json.loads(addon.as_string()) == {"enableNetworkPolicy": "true"}


@pytest.mark.parametrize("service_account", ["aws-node", "fsx-csi-controller-sa"])
def test_pod_identity_roles_trust_one_service_account_of_this_cluster(
    default_assertions: Template, service_account: str
) -> None:
    default_assertions.has_resource_properties(
        "AWS::IAM::Role",
        {
            "AssumeRolePolicyDocument": {
                "Statement": [
                    {
                        "Action": ["sts:AssumeRole", "sts:TagSession"],
                        "Principal": {"Service": "pods.eks.amazonaws.com"},
                        "Condition": {
                            "StringEquals": {
                                "aws:SourceAccount": {"Ref": "AWS::AccountId"},
                                "aws:RequestTag/eks-cluster-arn": {
                                    "Fn::GetAtt": [
                                        default_assertions.get_resource_id("AWS::EKS::Cluster"),
                                        "Arn",
                                    ]
                                },
                                "aws:RequestTag/kubernetes-namespace": "kube-system",
                                "aws:RequestTag/kubernetes-service-account": service_account,
                            }
                        },
                    }
                ]
            }
        },
    )


def test_node_auto_repair_is_paced(default_assertions: Template) -> None:
    from infra.cluster import SYSTEM_NODE_REPAIR, gpu_node_repair
    from infra.node_fencer import max_in_flight

    # cdk.json's defaults: no overlay, no desired count, gpuNodesMax 17 (the nominal size).
    repair = gpu_node_repair(max_in_flight=max_in_flight(None), node_count=17)
    gpu_nodegroup_has(default_assertions, {"NodeRepairConfig": Match.exact(repair)})
    only_one_has(
        default_assertions,
        NODEGROUP,
        {"NodeRepairConfig": Match.exact(SYSTEM_NODE_REPAIR)},
        selector={"AmiType": "AL2023_x86_64_STANDARD"},
    )


def test_a_new_cluster_gives_its_creator_no_admin(default_assertions: Template) -> None:
    only_one_has(
        default_assertions,
        "AWS::EKS::Cluster",
        {"AccessConfig": {"BootstrapClusterCreatorAdminPermissions": False}},
    )
