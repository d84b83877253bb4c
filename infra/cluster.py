"""The EKS cluster (aws_eks_v2): control plane, access, system node group and core add-ons."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk.lambda_layer_kubectl_v36 import KubectlV36Layer
from constructs import Construct

from infra.addon_versions import addon_version
from infra.config import ClusterConfig
from infra.fencer.decide import allowed_bad
from infra.fencer.settings import FENCER
from infra.pod_identity import pod_identity_role

# Each supported Kubernetes version with its eks_v2 constant and its matching kubectl layer.
_VERSIONS = {"1.36": (eks.KubernetesVersion.V1_36, KubectlV36Layer)}

# Every control-plane log type: the audit log is what shows who deleted a training job.
_ALL_LOG_TYPES = [
    eks.ClusterLoggingTypes.API,
    eks.ClusterLoggingTypes.AUDIT,
    eks.ClusterLoggingTypes.AUTHENTICATOR,
    eks.ClusterLoggingTypes.CONTROLLER_MANAGER,
    eks.ClusterLoggingTypes.SCHEDULER,
]


# What every node role holds: the kubelet's own EKS calls and image pulls. The VPC CNI's ENI
# permissions are not here: aws-node gets them through Pod Identity (TrainingCluster), and
# `...PullOnly` is the least ECR access that pulls images (EKS user guide, "Amazon EKS node IAM
# role": AmazonEKSWorkerNodePolicy and AmazonEC2ContainerRegistryPullOnly; the CNI policy "on
# the node role, or ... (recommended) on a separate role for the aws-node service account").
NODE_ROLE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryPullOnly")
CNI_POLICY = "AmazonEKS_CNI_Policy"
CNI_SERVICE_ACCOUNT = "aws-node"
# The VPC CNI add-on's configuration: its network policy agent enforces NetworkPolicy objects
# (the rendezvous store's); without it they are accepted and ignored (EKS user guide,
# "Restrict Pod network traffic with Kubernetes network policies", cni-network-policy-configure:
# add-on configuration `{"enableNetworkPolicy": "true"}`).
VPC_CNI_CONFIGURATION = {"enableNetworkPolicy": "true"}
# Node auto repair: how many nodes EKS repairs at once, and when it stops because too many are
# unhealthy (a fault of the AMI or the driver, not of the nodes). System nodes: one at a time,
# so the add-ons and the rendezvous store keep a node. GPU nodes: two at a time, stopping above
# half of the group (AWS::EKS::Nodegroup NodeRepairConfig; defaults: no limit on parallel
# repairs, and above 20% of a group of more than five nodes repairs stop).
SYSTEM_NODE_REPAIR = {"Enabled": True, "MaxParallelNodesRepairedCount": 1}
# GPU nodes: a node that still answers but whose node monitoring agent (the add-on below)
# reports a fatal networking, kernel or container-runtime reason is replaced after 2 minutes,
# not after the 30 minutes EKS waits on those conditions by default (node-repair.html). Each
# override names one condition and one reason the agent sets, and EKS requires all four fields
# ("If you use this, you must specify all the values": AWS::EKS::Nodegroup
# NodeRepairConfigOverrides; EKS API reference, NodeRepairConfigOverrides; MinRepairWaitTimeMins
# >= 1, RepairAction Replace | Reboot | NoAction). The reasons are the agent's own with
# severity Fatal, the ones that turn its condition False (aws/eks-node-monitoring-agent, its
# reasons catalogue, `defaultSeverity: "Fatal"`; the others are only events). Replace, not
# Reboot: the same bad hardware would come back, and the trainer pod moves to a spare either
# way. AcceleratedHardwareReady keeps the agent's per-XID defaults (10 min, Reboot or Replace
# by reason): its reasons are parameterised (NvidiaXID<n>Error), and the trainer's start-up
# check already cordons a node whose GPUs fall short (the node fencer then replaces it). A node
# with no kubelet (Ready Unknown) has no agent reason to match: the node fencer owns it.
GPU_REPAIR_WAIT_MINS = 2
GPU_REPAIR_FATAL_REASONS = {
    "NetworkingReady": (
        "InterfaceNotUp",
        "InterfaceNotRunning",
        "IPAMDNotReady",
        "IPAMDNotRunning",
        "MissingLoopbackInterface",
    ),
    "KernelReady": ("ForkFailedOutOfPIDs",),
    # A pod stuck Terminating holds its Job completion index: no replacement until it is gone.
    "ContainerRuntimeReady": ("PodStuckTerminating",),
}


def gpu_node_repair(*, max_in_flight: int, node_count: int) -> dict:
    """The GPU node group's NodeRepairConfig, paced and halted as the node fencer is (one owner:
    infra/fencer): at most `max_in_flight` nodes repaired at once (the overlay's hot spares,
    infra/node_fencer.py ``max_in_flight``: each repaired node's pods wait on a spare), and no
    repair once more of the group is unhealthy than the fencer allows
    (``infra.fencer.decide.allowed_bad`` at ``FENCER.max_bad_fraction``), as the smallest whole
    percentage of `node_count` (the group's nominal size) that the allowed count does not exceed
    (EKS repairs while the unhealthy share is at or under ``MaxUnhealthyNodeThresholdPercentage``,
    1-100: EKS API reference, NodeRepairConfig)."""
    if max_in_flight < 1 or node_count < 1:
        raise ValueError(
            f"max_in_flight={max_in_flight}, node_count={node_count}: give at least 1 each"
        )
    allowed = allowed_bad(
        size=node_count, max_bad_fraction=FENCER.max_bad_fraction, max_in_flight=max_in_flight
    )
    return {
        "Enabled": True,
        "MaxParallelNodesRepairedCount": max_in_flight,
        "MaxUnhealthyNodeThresholdPercentage": min(math.ceil(100 * allowed / node_count), 100),
        "NodeRepairConfigOverrides": [
            {
                "NodeMonitoringCondition": condition,
                "NodeUnhealthyReason": reason,
                "MinRepairWaitTimeMins": GPU_REPAIR_WAIT_MINS,
                "RepairAction": "Replace",
            }
            for condition, reasons in GPU_REPAIR_FATAL_REASONS.items()
            for reason in reasons
        ],
    }


def harden_nodegroup(
    nodegroup: eks.Nodegroup, *, version: str, repair: dict, after: Sequence[eks.CfnAddon] = ()
) -> None:
    """The settings both node groups share: Kubernetes version, node role policies, repair."""
    follow_cluster_version(nodegroup, version)
    cfn = nodegroup.node.default_child
    cfn.add_property_override("NodeRepairConfig", repair)  # type: ignore[union-attr]
    # The node role keeps its logical id (NodeRole is create-only on the node group): only its
    # policy list changes, in place, once aws-node has its own credentials (`after`).
    (role,) = [c for c in nodegroup.role.node.children if isinstance(c, iam.CfnRole)]
    # Set on the L1 (replacing the L2 role's lazy list), so cdk-nag sees what is deployed.
    role.managed_policy_arns = [
        iam.ManagedPolicy.from_aws_managed_policy_name(p).managed_policy_arn
        for p in NODE_ROLE_POLICIES
    ]
    for addon in after:
        nodegroup.role.node.add_dependency(addon)


def follow_cluster_version(nodegroup: eks.Nodegroup, version: str) -> None:
    """Pin a node group's Kubernetes version to the cluster's. Without `Version` a node group
    keeps the version it was created with when the control plane is upgraded
    (AWS::EKS::Nodegroup: the cluster's version is used only at creation); with it, a version
    bump updates the control plane and then rolls the nodes (EKS UpdateNodegroupVersion; the
    node group depends on the cluster, so CloudFormation updates it second)."""
    nodegroup.node.default_child.add_property_override("Version", version)  # type: ignore[union-attr]


class TrainingCluster(Construct):
    """An EKS cluster with managed node groups only (no Auto Mode), KMS-encrypted secrets, every
    control-plane log, an endpoint restricted to the configured CIDRs (or private only), an
    optional admin access entry, two on-demand system nodes and the Pod Identity and node
    monitoring agents.

    Attributes: `cluster`, `pod_identity_agent` (an add-on that Pod Identity users depend on).
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        config: ClusterConfig,
        keep_creator_admin: bool = False,
    ) -> None:
        super().__init__(scope, construct_id)
        version, layer = _VERSIONS[config.kubernetes_version]
        if config.endpoint_allowed_cidrs:
            # Public for the listed CIDRs (e.g. the job launcher on a laptop), private inside the
            # VPC: nodes and the kubectl provider (placed in the private subnets by eks_v2) never
            # leave the VPC to reach the API server.
            endpoint = eks.EndpointAccess.PUBLIC_AND_PRIVATE.only_from(
                *config.endpoint_allowed_cidrs
            )
        else:
            endpoint = eks.EndpointAccess.PRIVATE

        self.secrets_key = kms.Key(
            self,
            "SecretsKey",
            description=f"Envelope encryption of Kubernetes secrets in {config.cluster_name}",
            enable_key_rotation=True,
        )
        self.cluster = eks.Cluster(
            self,
            "Cluster",
            cluster_name=config.cluster_name,
            version=version,
            vpc=vpc,
            vpc_subnets=[ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS)],
            # eks_v2 defaults to Auto Mode; p5 with a custom EFA launch template needs managed
            # node groups, so no default capacity and node groups added below.
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            default_capacity=0,
            endpoint_access=endpoint,
            cluster_logging=_ALL_LOG_TYPES,
            secrets_encryption_key=self.secrets_key,
            kubectl_provider_options=eks.KubectlProviderOptions(
                kubectl_layer=layer(self, "KubectlLayer")
            ),
            # The update-kubeconfig command is a stack output with a stable name instead.
            output_config_command=False,
            # The principal that creates the cluster (CloudFormation's role) gets no standing
            # cluster-admin; the kubectl provider and adminPrincipalArn have access entries.
            # Create-only: a stack deployed with it keeps it (`keep_creator_admin`, from the
            # last deploy's template, infra/first_deploy.py) rather than replace the cluster.
            bootstrap_cluster_creator_admin_permissions=None if keep_creator_admin else False,
        )
        if config.admin_principal_arn:
            self.cluster.grant_access(
                "Admin",
                config.admin_principal_arn,
                [
                    eks.AccessPolicy.from_access_policy_name(
                        "AmazonEKSClusterAdminPolicy",
                        access_scope_type=eks.AccessScopeType.CLUSTER,
                    )
                ],
            )

        self.system_nodegroup = self.cluster.add_nodegroup_capacity(
            "SystemNodes",
            instance_types=[ec2.InstanceType(config.system_instance_type)],
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_STANDARD,
            capacity_type=eks.CapacityType.ON_DEMAND,
            min_size=config.system_node_count,
            desired_size=config.system_node_count,
            max_size=config.system_node_count + 1,
            disk_size=50,
            labels={"node-role": "system"},
            enable_node_auto_repair=True,
        )

        # Pod Identity: how the FSx CSI driver gets its IAM role (no OIDC provider needed).
        self.pod_identity_agent = eks.Addon(
            self,
            "PodIdentityAgent",
            cluster=self.cluster,
            addon_name="eks-pod-identity-agent",
            addon_version=addon_version("eks-pod-identity-agent"),
            preserve_on_delete=False,
        )
        # Reports GPU (XID), EFA, kernel and storage faults as node conditions; node auto repair
        # acts on them, which is what replaces a failed p5 without a human.
        self.node_monitoring_agent = eks.Addon(
            self,
            "NodeMonitoringAgent",
            cluster=self.cluster,
            addon_name="eks-node-monitoring-agent",
            addon_version=addon_version("eks-node-monitoring-agent"),
            preserve_on_delete=False,
        )
        # Add-ons need nodes to schedule on; without the dependency their creation can time out.
        for addon in (self.pod_identity_agent, self.node_monitoring_agent):
            addon.node.add_dependency(self.system_nodegroup)

        # The VPC CNI as a managed add-on: its own role through Pod Identity (so the node roles
        # drop the CNI policy) and its network policy agent on.
        self.cni_role = pod_identity_role(
            self,
            "VpcCniRole",
            cluster=self.cluster,
            namespace="kube-system",
            service_account=CNI_SERVICE_ACCOUNT,
            description="VPC CNI (aws-node) through EKS Pod Identity",
        )
        self.cni_role.add_managed_policy(iam.ManagedPolicy.from_aws_managed_policy_name(CNI_POLICY))
        self.vpc_cni = eks.CfnAddon(
            self,
            "VpcCni",
            addon_name="vpc-cni",
            addon_version=addon_version("vpc-cni"),
            cluster_name=self.cluster.cluster_name,
            # Takes over the aws-node DaemonSet EKS installed at creation.
            resolve_conflicts="OVERWRITE",
            preserve_on_delete=False,
            configuration_values=json.dumps(VPC_CNI_CONFIGURATION),
            pod_identity_associations=[
                eks.CfnAddon.PodIdentityAssociationProperty(
                    service_account=CNI_SERVICE_ACCOUNT, role_arn=self.cni_role.role_arn
                )
            ],
        )
        # No dependency on nodes: the node roles wait for this add-on (harden_nodegroup), so on
        # an update aws-node has its own role before the node role drops the CNI policy.
        harden_nodegroup(
            self.system_nodegroup,
            version=config.kubernetes_version,
            repair=SYSTEM_NODE_REPAIR,
            after=[self.vpc_cni],
        )
