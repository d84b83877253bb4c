"""FSx for Lustre (infra/storage.py): the file system, its ports, the CSI driver's identity,
retention and backups, and the S3 link that exports the checkpoints.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

import pytest
from aws_cdk.assertions import Capture, Match, Template
from infra_synth import VARIANT_CONTEXT
from infra_template import (
    cluster_security_group,
    gpu_subnets,
    only_one_has,
    resource_has,
)

from infra.storage import AUTO_EXPORT_EVENTS, CHECKPOINTS_PATH
from manifests import render


def test_fsx_file_system(default_assertions: Template, variant_assertions: Template) -> None:
    only_one_has(
        default_assertions,
        "AWS::FSx::FileSystem",
        {
            "LustreConfiguration": Match.object_equals(
                {
                    "AutomaticBackupRetentionDays": 7,
                    "DataCompressionType": "LZ4",
                    "DeploymentType": "PERSISTENT_2",
                    "PerUnitStorageThroughput": 250,
                }
            ),
            # Sized for the largest overlay (16node, p5_70b): infra/sizing.py.
            "StorageCapacity": 4800,
            # Same subnet as the GPU nodes.
            "SubnetIds": Match.exact(gpu_subnets(default_assertions)),
        },
    )
    only_one_has(
        variant_assertions,
        "AWS::FSx::FileSystem",
        {"StorageCapacity": 4800, "LustreConfiguration": {"PerUnitStorageThroughput": 500}},
    )
    default_assertions.resource_count_is("AWS::FSx::DataRepositoryAssociation", 0)
    only_one_has(
        variant_assertions,
        "AWS::FSx::DataRepositoryAssociation",
        {
            "DataRepositoryPath": VARIANT_CONTEXT["fsxS3Link"],
            "FileSystemPath": "/",  # the whole file system, checkpoints included
        },
    )


def test_lustre_ports_open_only_from_the_nodes(default_assertions: Template) -> None:
    fsx_sg_capture = Capture()
    only_one_has(default_assertions, "AWS::FSx::FileSystem", {"SecurityGroupIds": [fsx_sg_capture]})
    fsx_sg = fsx_sg_capture.as_object()
    cluster_sg = cluster_security_group(default_assertions)
    resource_has(
        default_assertions,
        fsx_sg["Fn::GetAtt"][0],
        "AWS::EC2::SecurityGroup",
        {"SecurityGroupIngress": Match.absent()},
    )
    rules = default_assertions.find_resources(
        "AWS::EC2::SecurityGroupIngress", {"Properties": {"GroupId": Match.exact(fsx_sg)}}
    )
    from_nodes = default_assertions.find_resources(
        "AWS::EC2::SecurityGroupIngress",
        {
            "Properties": {
                "GroupId": Match.exact(fsx_sg),
                "SourceSecurityGroupId": Match.exact(cluster_sg),
            }
        },
    )
    ports = {(r["Properties"]["FromPort"], r["Properties"]["ToPort"]) for r in from_nodes.values()}
    assert ports == {(988, 988), (1018, 1023)}
    # Every other rule is the file system talking to itself (a property of every match, which
    # a pattern over one resource cannot state).
    for rule in rules.values():
        assert rule["Properties"]["SourceSecurityGroupId"] in (cluster_sg, fsx_sg)
        assert "CidrIp" not in rule["Properties"]


def test_fsx_csi_driver_uses_pod_identity(default_assertions: Template) -> None:
    fsx_csi = {"AddonName": "aws-fsx-csi-driver"}
    role_id = Capture()
    only_one_has(
        default_assertions,
        "AWS::EKS::Addon",
        {
            "PodIdentityAssociations": [
                {
                    "ServiceAccount": "fsx-csi-controller-sa",
                    "RoleArn": {"Fn::GetAtt": [role_id, Match.any_value()]},
                }
            ]
        },
        selector=fsx_csi,
    )
    role = default_assertions.find_resources("AWS::IAM::Role")[role_id.as_string()]
    # Actions and principals may be spread over several statements: gather them.
    statements = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    actions = {
        a
        for s in statements
        for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    }
    assert {"sts:AssumeRole", "sts:TagSession"} <= actions
    assert {s["Principal"]["Service"] for s in statements} == {"pods.eks.amazonaws.com"}
    # The driver's credentials come from the Pod Identity agent: it must be there first.
    pod_identity = default_assertions.get_resource_id(
        "AWS::EKS::Addon", {"Properties": {"AddonName": "eks-pod-identity-agent"}}
    )
    default_assertions.has_resource(
        "AWS::EKS::Addon",
        {"Properties": fsx_csi, "DependsOn": Match.array_with([pod_identity])},
    )


def test_fsx_is_retained_with_backups(default_assertions: Template) -> None:
    default_assertions.resource_count_is("AWS::FSx::FileSystem", 1)
    default_assertions.has_resource(
        "AWS::FSx::FileSystem",
        {
            "DeletionPolicy": "Retain",
            "UpdateReplacePolicy": "Retain",
            "Properties": {"LustreConfiguration": {"AutomaticBackupRetentionDays": 7}},
        },
    )


def test_s3_link_exports_the_checkpoints(variant_assertions: Template) -> None:
    path = Capture()
    only_one_has(
        variant_assertions,
        "AWS::FSx::DataRepositoryAssociation",
        {
            "DataRepositoryPath": VARIANT_CONTEXT["fsxS3Link"],
            "FileSystemPath": path,
            "S3": {"AutoExportPolicy": {"Events": AUTO_EXPORT_EVENTS}},
            "BatchImportMetaDataOnCreate": True,
        },
    )
    assert CHECKPOINTS_PATH.startswith(path.as_string())  # the association covers the checkpoints
    assert set(AUTO_EXPORT_EVENTS) == {"NEW", "CHANGED", "DELETED"}
    # Every overlay's trainer writes its checkpoints there (the PV mounts the file system root).
    for overlay in render.OVERLAYS:
        (job,) = [
            o
            for o in render.job_objects(overlay=overlay, namespace="training", image="i:1")
            if o["kind"] == "Job"
        ]
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        (ckpt,) = [a for a in args if a.startswith("--checkpoint.dir=")]
        assert ckpt.split("=", 1)[1].startswith(render.FSX_MOUNT + CHECKPOINTS_PATH + "/")


@pytest.mark.parametrize(("low", "high"), [(988, 988), (1018, 1023)])
def test_file_servers_reach_the_nodes_on_lustre_ports(
    default_assertions: Template, low: int, high: int
) -> None:
    fsx_sg = default_assertions.get_resource_id(
        "AWS::EC2::SecurityGroup",
        {"Properties": {"GroupDescription": Match.string_like_regexp("FSx for Lustre")}},
    )
    default_assertions.has_resource_properties(
        "AWS::EC2::SecurityGroupIngress",
        {
            "GroupId": cluster_security_group(default_assertions),
            "SourceSecurityGroupId": {"Fn::GetAtt": [fsx_sg, "GroupId"]},
            "IpProtocol": "tcp",
            "FromPort": low,
            "ToPort": high,
        },
    )
