"""The VPC: public and private subnets in the configured AZs, NAT, an S3 gateway endpoint, flow
logs (KMS-encrypted), the GPU nodes' subnet, and the EFA security group."""

from __future__ import annotations

from aws_cdk import Aws, CfnResource, RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

FLOW_LOG_RETENTION = logs.RetentionDays.TWO_YEARS


class Network(Construct):
    """VPC plus what the GPU nodes need from it.

    Attributes: `vpc`, `gpu_subnet` (the one private subnet of the GPU AZ: a cluster placement
    group is single-AZ), `efa_security_group` (all traffic to and from itself), `logs_key` (the
    KMS key of the flow-log group) and `flow_log_group`.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        availability_zones: tuple[str, ...],
        gpu_availability_zone: str,
        vpc_cidr: str,
    ) -> None:
        super().__init__(scope, construct_id)
        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(vpc_cidr),
            # Explicit AZs: synth never looks them up (no credentials needed), and the GPU AZ is
            # guaranteed to have a subnet.
            availability_zones=list(availability_zones),
            # One NAT gateway: nodes only need it for image pulls and AWS APIs; S3 goes through
            # the gateway endpoint and NCCL/Lustre traffic stays inside the VPC.
            nat_gateways=1,
            subnet_configuration=[
                ec2.SubnetConfiguration(
                    name="Public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24
                ),
                # /19: the VPC CNI gives every pod a VPC address; p5 nodes run many pods.
                ec2.SubnetConfiguration(
                    name="Private", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=19
                ),
            ],
            gateway_endpoints={
                "S3": ec2.GatewayVpcEndpointOptions(service=ec2.GatewayVpcEndpointAwsService.S3)
            },
        )
        # Flow logs go to a log group encrypted with this stack's key. CloudWatch Logs uses the
        # key as the regional service principal logs.<region>.amazonaws.com, which the key
        # policy must allow, scoped to this account's log groups by the encryption context
        # (CloudWatch Logs user guide, "Encrypt log data in CloudWatch Logs using AWS KMS",
        # https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html).
        self.logs_key = kms.Key(
            self,
            "LogsKey",
            description="Encryption of the VPC flow-log group",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.logs_key.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CloudWatchLogsUseOfTheKey",
                principals=[iam.ServicePrincipal(f"logs.{Aws.REGION}.amazonaws.com")],
                actions=[
                    "kms:Encrypt*",
                    "kms:Decrypt*",
                    "kms:ReEncrypt*",
                    "kms:GenerateDataKey*",
                    "kms:Describe*",
                ],
                resources=["*"],
                conditions={
                    "ArnLike": {
                        "kms:EncryptionContext:aws:logs:arn": (
                            f"arn:{Aws.PARTITION}:logs:{Aws.REGION}:{Aws.ACCOUNT_ID}:log-group:*"
                        )
                    }
                },
            )
        )
        self.flow_log_group = logs.LogGroup(
            self,
            "FlowLogGroup",
            encryption_key=self.logs_key,
            retention=FLOW_LOG_RETENTION,
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(self.flow_log_group),
        )

        gpu_subnets = self.vpc.select_subnets(
            subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS,
            availability_zones=[gpu_availability_zone],
        ).subnets
        self.gpu_subnet: ec2.ISubnet = gpu_subnets[0]

        # EFA needs all traffic to and from the same security group (EC2's EFA guide). With
        # allow_all_outbound=False CDK refuses an all-traffic egress rule through the L2 API,
        # hence the CfnSecurityGroupEgress below.
        self.efa_security_group = ec2.SecurityGroup(
            self,
            "EfaSecurityGroup",
            vpc=self.vpc,
            description="EFA: all traffic between the EFA interfaces of the GPU nodes",
            allow_all_outbound=False,
        )
        self.efa_security_group.add_ingress_rule(
            self.efa_security_group, ec2.Port.all_traffic(), "EFA from itself"
        )
        ec2.CfnSecurityGroupEgress(
            self,
            "EfaEgressToSelf",
            group_id=self.efa_security_group.security_group_id,
            ip_protocol="-1",
            destination_security_group_id=self.efa_security_group.security_group_id,
            description="EFA to itself",
        )

    def retained_with_file_system(self, file_system_group: ec2.ISecurityGroup) -> list[CfnResource]:
        """What a retained FSx file system still uses after the stack is deleted: the VPC,
        every private subnet (the file system's, and the one a zone move left behind), the
        file system's security group and its rules from itself (TCP 988 and 1018-1023 between
        the file servers: FSx for Lustre user guide, "File system access control with Amazon
        VPC"; CDK writes a self-referencing rule as its own AWS::EC2::SecurityGroupIngress).
        Its rules naming the cluster's group are not kept: that group goes with the cluster."""
        subnets = [s.node.default_child for s in self.vpc.private_subnets]
        own_id = file_system_group.security_group_id
        self_rules = [
            child
            for child in file_system_group.node.children
            if isinstance(child, ec2.CfnSecurityGroupIngress)
            and child.source_security_group_id == own_id
        ]
        return [
            self.vpc.node.default_child,
            *subnets,
            file_system_group.node.default_child,
            *self_rules,
        ]  # type: ignore[list-item]
