"""The p5.48xlarge managed node group: an EFA launch template (32 network cards), a cluster
placement group, capacity targeting, RAID0 instance storage, GPU labels and taint."""

from __future__ import annotations

from aws_cdk import Fn
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from constructs import Construct

from infra.config import GPU_INSTANCE_TYPE, GpuNodesConfig

# p5.48xlarge has 32 network cards (EC2 user guide, "EFA configuration for P5 instances").
P5_NETWORK_CARDS = 32

# Pods that need a GPU tolerate this taint; nothing else lands on a p5 by accident.
GPU_TAINT_KEY = "nvidia.com/gpu"
GPU_LABELS = {
    "node-role": "gpu",
    # Matches the EFA device plugin's node selector (infra/addons.py).
    "vpc.amazonaws.com/efa.present": "true",
    "nvidia.com/gpu.present": "true",
}

# nodeadm (AL2023) merges this NodeConfig with the one EKS generates for the node group: the
# eight local NVMe SSDs become one RAID0 array used by the kubelet and containerd, so image
# layers and pods' ephemeral storage (e.g. local checkpoint copies) do not fill the root volume.
_NODEADM_USER_DATA = """MIME-Version: 1.0
Content-Type: multipart/mixed; boundary="==NODEADM=="

--==NODEADM==
Content-Type: application/node.eks.aws

---
apiVersion: node.eks.aws/v1alpha1
kind: NodeConfig
spec:
  instance:
    localStorage:
      strategy: RAID0

--==NODEADM==--
"""


def network_interfaces(
    *, primary_groups: list[str], efa_groups: list[str], secondary_type: str
) -> list[ec2.CfnLaunchTemplate.NetworkInterfaceProperty]:
    """One EFA interface per network card, per EC2's guidance for P5.

    Card 0, device 0 is the primary interface and must be `efa` (EFA with ENA): it carries the
    node's IP traffic and the cluster security group. Cards 1..31 use device index 1 and are
    `efa-only` (no IP address consumed) or `efa`, carrying only the EFA security group.
    Security groups go on each interface: a launch template with interfaces may not set
    top-level security groups.
    """
    interfaces = [
        ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
            network_card_index=0,
            device_index=0,
            interface_type="efa",
            groups=primary_groups,
            delete_on_termination=True,
        )
    ]
    interfaces += [
        ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
            network_card_index=card,
            device_index=1,
            interface_type=secondary_type,
            groups=efa_groups,
            delete_on_termination=True,
        )
        for card in range(1, P5_NETWORK_CARDS)
    ]
    return interfaces


class GpuNodeGroup(Construct):
    """p5.48xlarge managed node group in one subnet, in a cluster placement group.

    Attributes: `nodegroup`, `launch_template`, `placement_group`.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster: eks.Cluster,
        subnet: ec2.ISubnet,
        efa_security_group: ec2.ISecurityGroup,
        config: GpuNodesConfig,
    ) -> None:
        super().__init__(scope, construct_id)
        self.placement_group: ec2.CfnPlacementGroup | None = None
        placement = _placement(self, config)

        efa_sg = efa_security_group.security_group_id
        data = ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
            # The instance type lives here, not in the node group: eks_v2's GPU instance list
            # lacks P5 and would reject it (the AMI type below is set explicitly instead).
            instance_type=GPU_INSTANCE_TYPE,
            network_interfaces=network_interfaces(
                primary_groups=[cluster.cluster_security_group_id, efa_sg],
                efa_groups=[efa_sg],
                secondary_type=config.efa_secondary_interface_type,
            ),
            placement=placement,
            metadata_options=ec2.CfnLaunchTemplate.MetadataOptionsProperty(
                http_tokens="required",  # IMDSv2 only
                http_endpoint="enabled",
                # One hop: pods on the pod network cannot reach IMDS (nor the node role's
                # credentials). Nothing on the GPU nodes' pod network needs it: AWS credentials
                # come from Pod Identity (FSx CSI controller, on the system nodes), and the
                # node-level agents (FSx CSI node, EFA and NVIDIA device plugins, DCGM exporter)
                # do not call AWS from the pod network.
                http_put_response_hop_limit=1,
            ),
            block_device_mappings=[
                ec2.CfnLaunchTemplate.BlockDeviceMappingProperty(
                    device_name="/dev/xvda",
                    ebs=ec2.CfnLaunchTemplate.EbsProperty(
                        volume_size=config.root_volume_gib,
                        volume_type="gp3",
                        iops=3000,
                        throughput=250,
                        encrypted=True,
                        delete_on_termination=True,
                    ),
                )
            ],
            user_data=Fn.base64(_NODEADM_USER_DATA),
            **_capacity_settings(config),
        )
        self.launch_template = ec2.CfnLaunchTemplate(
            self, "LaunchTemplate", launch_template_data=data
        )

        self.nodegroup = cluster.add_nodegroup_capacity(
            "GpuNodes",
            # Without it a p5 group would silently get the STANDARD AMI (no NVIDIA driver).
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_NVIDIA,
            launch_template_spec=eks.LaunchTemplateSpec(
                id=self.launch_template.ref,
                version=self.launch_template.attr_latest_version_number,
            ),
            subnets=ec2.SubnetSelection(subnets=[subnet]),
            capacity_type=(
                eks.CapacityType.CAPACITY_BLOCK
                if config.capacity_type == "capacity-block"
                else eks.CapacityType.ON_DEMAND
            ),
            min_size=config.min_size,
            desired_size=config.desired_size,
            max_size=config.max_size,
            labels=GPU_LABELS,
            taints=[
                eks.TaintSpec(key=GPU_TAINT_KEY, value="true", effect=eks.TaintEffect.NO_SCHEDULE)
            ],
            # Replaces nodes the node monitoring agent reports unhealthy (GPU XID, EFA faults).
            enable_node_auto_repair=True,
            # Replace one p5 at a time: a training job loses at most one node per update.
            max_unavailable=1,
        )


def _placement(
    scope: Construct, config: GpuNodesConfig
) -> ec2.CfnLaunchTemplate.PlacementProperty | None:
    """The launch template's placement group, by capacity type.

    - on-demand: a new cluster placement group packs the nodes close together for NCCL.
    - capacity-block: none; EC2 places a block's instances close together already ("there is
      no need to use a cluster placement group with a Capacity Block", EC2 user guide).
    - capacity-reservation: the group the reservation was created in, if any. Forcing a new
      group onto reserved capacity fails with InsufficientInstanceCapacity (eksctl PR #8220,
      terraform-aws-eks PR #3730 removed exactly that).
    """
    if config.capacity_type == "on-demand":
        group = ec2.CfnPlacementGroup(scope, "PlacementGroup", strategy="cluster")
        scope.placement_group = group  # type: ignore[attr-defined]
        return ec2.CfnLaunchTemplate.PlacementProperty(group_name=group.ref)
    if config.reservation_placement_group is not None:
        return ec2.CfnLaunchTemplate.PlacementProperty(
            group_name=config.reservation_placement_group
        )
    return None


def _capacity_settings(config: GpuNodesConfig) -> dict:
    """Launch template fields that target a capacity reservation or a capacity block."""
    if config.capacity_type == "on-demand":
        return {}
    target = ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty(
        capacity_reservation_target=ec2.CfnLaunchTemplate.CapacityReservationTargetProperty(
            capacity_reservation_id=config.capacity_reservation_id
        )
    )
    if config.capacity_type == "capacity-reservation":
        return {"capacity_reservation_specification": target}
    return {
        "capacity_reservation_specification": target,
        "instance_market_options": ec2.CfnLaunchTemplate.InstanceMarketOptionsProperty(
            market_type="capacity-block"
        ),
    }
