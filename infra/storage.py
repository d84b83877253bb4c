"""FSx for Lustre for checkpoints and data, its optional S3 link, and the FSx CSI driver add-on
with an IAM role through Pod Identity."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_iam as iam
from constructs import Construct

from infra.addon_versions import addon_version
from infra.config import FsxConfig
from infra.pod_identity import pod_identity_role

# Lustre's network ports (FSx for Lustre user guide, "File system access control with VPC").
LUSTRE_PORTS = (ec2.Port.tcp(988), ec2.Port.tcp_range(1018, 1023))

# Service account of the FSx CSI controller, as installed by the EKS add-on.
FSX_CSI_SERVICE_ACCOUNT = "fsx-csi-controller-sa"
FSX_CSI_NAMESPACE = "kube-system"

# Where the S3 link appears inside the file system: its root, so that every path the pods use
# under the mount (manifests/render.py FSX_MOUNT, /fsx) has one S3 key: /fsx/checkpoints/<job>
# is <link>/checkpoints/<job>, /fsx/runs/<job> is <link>/runs/<job>, /fsx/data is <link>/data.
# "If you specify only a forward slash (/) as the file system path, you can link only one data
# repository to the file system" (AWS::FSx::DataRepositoryAssociation FileSystemPath): one
# association covers checkpoints, runs and data.
S3_LINK_PATH = "/"
# Where the trainer writes shared checkpoints, inside the file system (render.py passes
# --checkpoint.dir=/fsx/checkpoints/<job>; tests/infra checks the two agree).
CHECKPOINTS_PATH = "/checkpoints"
# Export every change: new and changed files (each committed checkpoint) are copied to S3, and
# the retention's deletions of old checkpoints (keep_last) are mirrored, so S3 holds the same
# checkpoints as the file system (FSx for Lustre user guide, "Automatically export updates to
# your S3 bucket"; the daily backups keep older states).
AUTO_EXPORT_EVENTS = ["NEW", "CHANGED", "DELETED"]


class LustreStorage(Construct):
    """PERSISTENT_2 Lustre file system in the GPU nodes' subnet, reachable only from the nodes.

    Attributes: `file_system` (id, DNS name, mount name) and `csi_driver` (the FSx CSI add-on,
    which manifests that mount the file system must come after).
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        subnet: ec2.ISubnet,
        cluster: eks.Cluster,
        pod_identity_agent: eks.Addon,
        config: FsxConfig,
    ) -> None:
        super().__init__(scope, construct_id)
        self.security_group = ec2.SecurityGroup(
            self,
            "SecurityGroup",
            vpc=vpc,
            description="FSx for Lustre: Lustre ports from the EKS nodes and between servers",
        )
        # Every managed node (system and GPU) carries the cluster security group: it is the
        # only client source. (LustreFileSystem itself opens 988-1023 between its own servers.)
        # The file servers also connect to the clients on the same ports, so the clients'
        # group admits them ("Lustre clients ... inbound ... from the file system's security
        # group", FSx for Lustre user guide, "File system access control with Amazon VPC").
        for port in LUSTRE_PORTS:
            self.security_group.add_ingress_rule(
                cluster.cluster_security_group, port, "Lustre from the EKS nodes"
            )
            cluster.cluster_security_group.add_ingress_rule(
                self.security_group, port, "Lustre from the FSx file servers"
            )

        self.file_system = fsx.LustreFileSystem(
            self,
            "FileSystem",
            vpc=vpc,
            # Same AZ as the GPU nodes: no cross-AZ latency or data transfer charges.
            vpc_subnet=subnet,
            security_group=self.security_group,
            storage_capacity_gib=config.storage_capacity_gib,
            file_system_type_version=fsx.FileSystemTypeVersion.V_2_15,
            lustre_configuration=fsx.LustreConfiguration(
                deployment_type=fsx.LustreDeploymentType.PERSISTENT_2,
                per_unit_storage_throughput=config.throughput_per_unit,
                # Checkpoints of bf16/fp32 tensors compress a little; LZ4 costs nothing here.
                data_compression_type=fsx.LustreDataCompressionType.LZ4,
                automatic_backup_retention=(
                    Duration.days(config.backup_retention_days)
                    if config.backup_retention_days
                    else None
                ),
            ),
            # The checkpoints live here: keep the file system on `cdk destroy` unless the user
            # opted in with -c fsxRemovalPolicy=destroy (a retained one still costs money; delete
            # it with `aws fsx delete-file-system` once its data is safe).
            removal_policy=(
                RemovalPolicy.DESTROY
                if config.removal_policy == "destroy"
                else RemovalPolicy.RETAIN
            ),
        )

        self.s3_link: fsx.CfnDataRepositoryAssociation | None = None
        if config.s3_link:
            # PERSISTENT_2 cannot take import_path: an association links S3 both ways. Batch
            # import at creation lists what the prefix already holds (the checkpoints of an
            # earlier file system, a dataset), so a new file system resumes from them.
            self.s3_link = fsx.CfnDataRepositoryAssociation(
                self,
                "S3Link",
                file_system_id=self.file_system.file_system_id,
                file_system_path=S3_LINK_PATH,
                data_repository_path=config.s3_link,
                batch_import_meta_data_on_create=True,
                s3=fsx.CfnDataRepositoryAssociation.S3Property(
                    auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(
                        events=["NEW", "CHANGED", "DELETED"]
                    ),
                    auto_export_policy=fsx.CfnDataRepositoryAssociation.AutoExportPolicyProperty(
                        events=AUTO_EXPORT_EVENTS
                    ),
                ),
            )

        # The CSI controller only describes file systems: the PV is provisioned statically.
        role = pod_identity_role(
            self,
            "CsiDriverRole",
            cluster=cluster,
            namespace=FSX_CSI_NAMESPACE,
            service_account=FSX_CSI_SERVICE_ACCOUNT,
            description="FSx CSI driver controller (through EKS Pod Identity)",
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["fsx:DescribeFileSystems", "fsx:DescribeVolumes"],
                resources=["*"],
            )
        )
        self.csi_role = role
        # The L2 Addon has no Pod Identity props: the L1 takes the association inline.
        self.csi_driver = eks.CfnAddon(
            self,
            "CsiDriver",
            addon_name="aws-fsx-csi-driver",
            addon_version=addon_version("aws-fsx-csi-driver"),
            cluster_name=cluster.cluster_name,
            resolve_conflicts="OVERWRITE",
            preserve_on_delete=False,
            pod_identity_associations=[
                eks.CfnAddon.PodIdentityAssociationProperty(
                    service_account=FSX_CSI_SERVICE_ACCOUNT, role_arn=role.role_arn
                )
            ],
        )
        self.csi_driver.node.add_dependency(pod_identity_agent)
