"""The p5.48xlarge node group (infra/gpu_nodegroup.py): the EFA launch template's network
cards, placement group, IMDS, instance storage, capacity targeting, the EFA security group and
an update strategy that needs no spare capacity.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

import pytest
from aws_cdk.assertions import Capture, Match, Template
from infra_synth import CDK_JSON_CONTEXT, VARIANT_CONTEXT
from infra_template import (
    cluster_security_group,
    efa_security_group_id,
    gpu_nodegroup_has,
    launch_template_has,
    only_one_has,
    resource_has,
)


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


def test_imds_hop_limit_is_one(default_assertions: Template) -> None:
    launch_template_has(
        default_assertions,
        {"MetadataOptions": {"HttpPutResponseHopLimit": 1, "HttpTokens": "required"}},
    )


def test_no_placement_group_for_capacity_blocks(variant_assertions: Template) -> None:
    """EC2: a Capacity Block needs no cluster placement group; forcing one fails to launch."""
    variant_assertions.resource_count_is("AWS::EC2::PlacementGroup", 0)
    launch_template_has(variant_assertions, {"Placement": Match.absent()})


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
