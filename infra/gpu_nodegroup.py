"""The p5.48xlarge managed node group: an EFA launch template (32 network cards), a cluster
placement group, capacity targeting, RAID0 instance storage, 2 MiB huge pages allocated at boot,
GPU labels and taints, and an update strategy that needs no spare capacity."""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Fn
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from constructs import Construct

from facts.hardware import P5_48XLARGE, P5_NETWORK_CARDS
from infra.cluster import gpu_node_repair, harden_nodegroup
from infra.config import GPU_INSTANCE_TYPE, GpuNodesConfig
from infra.node_fencer import max_in_flight

# Node replacement on a launch-template or AMI change: one node at a time, old one first (see
# GpuNodeGroup for the sources).
UPDATE_MAX_UNAVAILABLE = 1
UPDATE_STRATEGY = "MINIMAL"

# Pods that need a GPU tolerate this taint; nothing else lands on a p5 by accident.
GPU_TAINT_KEY = "nvidia.com/gpu"
# Set on every GPU node at registration; the FSx CSI node driver removes it when it starts
# (aws-fsx-csi-driver docs/install.md, "Configure node startup taint"), which says the driver
# runs, not that a Lustre mount works: the Lustre client itself is installed and loaded by the
# user data before the kubelet starts (LUSTRE_SCRIPT), and the trainer's start-up check verifies
# that /fsx is a writable Lustre mount. The driver's node DaemonSet tolerates every taint; pods
# that do not tolerate this one (the trainer, the device plugins, the DCGM exporter) are
# scheduled only after its removal.
FSX_STARTUP_TAINT_KEY = "fsx.csi.aws.com/agent-not-ready"
GPU_LABELS = {
    "node-role": "gpu",
    # Matches the EFA device plugin's node selector (infra/addons.py).
    "vpc.amazonaws.com/efa.present": "true",
    "nvidia.com/gpu.present": "true",
}

HUGEPAGE_SIZE_MIB = 2

# The Lustre client's user-space tools (lctl, mount.lustre) and kernel module, before the
# kubelet starts. Current AL2023 EKS AMIs ship neither the tools nor a loaded module: Amazon Linux
# splits the kernel module from the user-space package, and without `lctl` the file servers
# cannot push client settings ("error invoking upcall /usr/sbin/lctl set_param",
# kubernetes-sigs/aws-fsx-csi-driver issue 436 and PR 460, "Amazon-Linux based distros have
# kernel module and userspace tool separate"). The EKS AMI maintainers keep lustre-client out of
# the AMI and point to user data: `dnf install -y lustre-client` (awslabs/amazon-eks-ami PR 2696,
# review of 2026-05-01). A node that cannot install or load it never joins the cluster: the
# script stops nodeadm-run.service (which starts the kubelet after cloud-final) and says why on
# the serial console, so the node group reports the node as failed to join instead of running
# pods whose /fsx mount fails later.
LUSTRE_SCRIPT = """#!/bin/bash
# Lustre client tools and module for FSx (see infra/gpu_nodegroup.py). Fails the node loudly.
set -uo pipefail
fail() {
  echo "lustre-client: $*; this node will not join the cluster" | tee -a /dev/console >&2
  systemctl mask --now --no-block nodeadm-run.service
  exit 1
}
installed=0
for attempt in 1 2 3 4 5; do
  if rpm -q lustre-client >/dev/null 2>&1 || dnf install -y lustre-client; then
    installed=1
    break
  fi
  sleep $((attempt * 10))
done
[ "$installed" = 1 ] || fail "dnf install -y lustre-client failed 5 times"
command -v lctl >/dev/null || fail "lctl is missing after installing lustre-client"
modprobe lustre || fail "modprobe lustre failed (kernel $(uname -r))"
grep -q '^lustre ' /proc/modules || fail "the lustre module is not loaded"
# Loaded again at every boot (a reboot does not rerun this part).
echo lustre > /etc/modules-load.d/lustre.conf
"""


def _mebibytes(quantity: str) -> int:
    """A Kubernetes binary quantity (`5120Mi`, `5Gi`) in MiB."""
    units = {"Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
    for suffix, factor in units.items():
        if quantity.endswith(suffix) and quantity[: -len(suffix)].isdigit():
            return int(quantity[: -len(suffix)]) * factor
    raise ValueError(f"{quantity!r} is not a Mi/Gi/Ti quantity")


def hugepages_2mi_count() -> int:
    """2 MiB huge pages each GPU node allocates at boot: exactly what the trainer pod requests
    (`hugepages-2Mi`, from facts/hardware.py, the one owner of that figure; one trainer pod per
    node). Kubernetes advertises only the huge pages the node holds when the kubelet starts, and
    a pod requesting more than that stays Pending."""
    mib = _mebibytes(P5_48XLARGE.hugepages_2mi)
    if mib % HUGEPAGE_SIZE_MIB:
        raise ValueError(f"hugepages-2Mi {P5_48XLARGE.hugepages_2mi} is not a multiple of 2Mi")
    return mib // HUGEPAGE_SIZE_MIB


def node_user_data(*, hugepages: int) -> str:
    """The launch template's user data: a MIME multi-part document that EKS merges with its own.

    - `application/node.eks.aws`: nodeadm merges this NodeConfig with the one EKS generates; the
      eight local NVMe SSDs become one RAID0 array for the kubelet and containerd, so image
      layers and pods' ephemeral storage do not fill the root volume.
    - `text/x-shellscript` (LUSTRE_SCRIPT): installs lustre-client and loads the lustre module,
      or keeps the node from joining (see LUSTRE_SCRIPT's comment for the sources).
    - `text/x-shellscript`: reserves `hugepages` 2 MiB pages (and persists the setting across
      reboots). cloud-init runs it in cloud-final; nodeadm-run.service, which starts the
      kubelet, is ordered `After=... cloud-final.service` (amazon-eks-ami
      templates/al2023/runtime/rootfs/etc/systemd/system/nodeadm-run.service), so the kubelet
      sees the pages when it starts. The AL2023 NVIDIA AMI reserves none by itself: its sources
      (amazon-eks-ami, templates/ and nodeadm/, 2026-07-23) set no `vm.nr_hugepages` (its
      templates/al2023/runtime/rootfs/etc/sysctl.conf has none) and run the EFA installer with
      `--minimal` (templates/al2023/provisioners/install-efa.sh); the script only raises the
      count, so pages anything else reserved are kept. Early in boot memory is unfragmented, so
      the allocation succeeds; the script logs a shortfall instead of failing the boot.
    """
    return f"""MIME-Version: 1.0
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

--==NODEADM==
Content-Type: text/x-shellscript; charset="us-ascii"

{LUSTRE_SCRIPT}
--==NODEADM==
Content-Type: text/x-shellscript; charset="us-ascii"

#!/bin/bash
# 2 MiB huge pages for the EFA provider (libfabric), before the kubelet starts. Only raises the
# count: pages something else reserved are kept.
set -euo pipefail
want={hugepages}
have=$(cat /proc/sys/vm/nr_hugepages)
if [ "$have" -lt "$want" ]; then
  echo "vm.nr_hugepages = $want" > /etc/sysctl.d/90-hugepages.conf
  sysctl -w vm.nr_hugepages="$want"
fi
got=$(cat /proc/sys/vm/nr_hugepages)
if [ "$got" -lt "$want" ]; then
  echo "only $got of $want 2 MiB huge pages allocated" >&2
fi

--==NODEADM==--
"""


# Cards whose device index 1 carries an ENA interface in the `ip-bandwidth` layout (EC2 guide,
# p5 use case 2: one ENA in each of the subsets [4-7], [8-11], ..., [28-31]).
IP_BANDWIDTH_CARDS = tuple(range(4, P5_NETWORK_CARDS, 4))


def network_interfaces(
    *, ena_groups: list[str], efa_groups: list[str], layout: str
) -> list[ec2.CfnLaunchTemplate.NetworkInterfaceProperty]:
    """The p5 layout of EC2's EFA guide ("Maximize network bandwidth on Amazon EC2 instances
    with multiple network cards", efa-acc-inst-types.html, "EFA configuration for P5 and P5e
    instances"):

    - card 0, device 0: the primary, an ENA interface ("You can't use an EFA-only network
      interface as the primary network interface"), carrying the node's and pods' IP traffic;
    - card 0, device 1 and cards 1..31, device 0: EFA-only interfaces (no IP address);
    - `ip-bandwidth` only: ENA interfaces on device 1 of cards 4, 8, ..., 28 (use case 2).

    ENA interfaces carry the cluster security group, EFA-only ones the EFA group. Security
    groups go on each interface: a launch template with interfaces may not set top-level ones.
    """

    def interface(
        card: int, device: int, efa: bool
    ) -> ec2.CfnLaunchTemplate.NetworkInterfaceProperty:
        return ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
            network_card_index=card,
            device_index=device,
            # Omitted means `interface` (ENA) (AWS::EC2::LaunchTemplate NetworkInterface).
            interface_type="efa-only" if efa else None,
            groups=efa_groups if efa else ena_groups,
            delete_on_termination=True,
        )

    interfaces = [interface(0, 0, efa=False), interface(0, 1, efa=True)]
    for card in range(1, P5_NETWORK_CARDS):
        interfaces.append(interface(card, 0, efa=True))
        if layout == "ip-bandwidth" and card in IP_BANDWIDTH_CARDS:
            interfaces.append(interface(card, 1, efa=False))
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
        kubernetes_version: str,
        after: Sequence[eks.CfnAddon] = (),
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
                ena_groups=[cluster.cluster_security_group_id],
                efa_groups=[efa_sg],
                layout=config.efa_secondary_interface_type,
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
            user_data=Fn.base64(node_user_data(hugepages=hugepages_2mi_count())),
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
                eks.TaintSpec(key=GPU_TAINT_KEY, value="true", effect=eks.TaintEffect.NO_SCHEDULE),
                eks.TaintSpec(key=FSX_STARTUP_TAINT_KEY, effect=eks.TaintEffect.NO_EXECUTE),
            ],
            # Replaces nodes the node monitoring agent reports unhealthy (GPU XID, EFA faults).
            enable_node_auto_repair=True,
            max_unavailable=UPDATE_MAX_UNAVAILABLE,
        )
        # What a launch-template change (user data, AMI release, interfaces) does to running
        # nodes: EKS creates a new template version and replaces every node of the group, at
        # most UPDATE_MAX_UNAVAILABLE at a time. Its DEFAULT strategy launches the new instances
        # first ("scale up phase": the Auto Scaling group grows by up to twice the number of AZs
        # or maxUnavailable, whichever is larger) and only then drains and terminates the old
        # ones; a capacity reservation, a Capacity Block or a full placement group has no spare
        # p5 for that surge, so the update would stall and fail. MINIMAL "terminates the old
        # instances before launching the new instances ... useful in scenarios where you are
        # constrained to resources or costs (for example, with hardware accelerators such as
        # GPUs)" (EKS API reference, NodegroupUpdateConfig; EKS user guide,
        # https://docs.aws.amazon.com/eks/latest/userguide/managed-node-update-behavior.html).
        # So: one node at a time is drained (its trainer pod gets SIGTERM and the grace period
        # for the final checkpoint), terminated, and its replacement launched into the freed
        # slot; the Job replaces the lost pod and the run resumes from the checkpoint.
        # eks_v2's node group props have no update strategy: set it on the L1.
        cfn = self.nodegroup.node.default_child
        cfn.add_property_override("UpdateConfig.UpdateStrategy", UPDATE_STRATEGY)  # type: ignore[union-attr]
        # A version bump rolls these nodes too (infra/cluster.py). For a Capacity Block the
        # app refuses any rolling update while the group has nodes (infra/first_deploy.py).
        # Paced and halted as the node fencer is (infra/cluster.py gpu_node_repair).
        repair = gpu_node_repair(
            max_in_flight=max_in_flight(config.overlay),
            node_count=max(config.desired_size or config.max_size, 1),
        )
        harden_nodegroup(self.nodegroup, version=kubernetes_version, repair=repair, after=after)


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
