"""The one stack: network, cluster, GPU nodes, storage (sized at synth), device plugins and GPU
telemetry, image, the shared Kubernetes objects (never the training Job), and the outputs the
job launcher reads from cdk-outputs.json."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aws_cdk import App, Aws, CfnOutput, DefaultStackSynthesizer, Environment, RemovalPolicy, Stack
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from infra import nag, sizing
from infra.addons import DevicePlugins, JobSetController
from infra.cluster import TrainingCluster
from infra.config import IMAGES_STACK_NAME, STACK_NAME, StackConfig
from infra.deployed import SETTINGS_PARAMETER_ID
from infra.gpu_nodegroup import GpuNodeGroup
from infra.image import TrainerImage
from infra.images import ImagesStack
from infra.network import Network
from infra.node_fencer import NodeFencer, max_in_flight
from infra.observability import Observability
from infra.storage import LustreStorage
from infra.workloads import TrainingWorkloads


class TrainingClusterStack(Stack):
    """EKS + p5.48xlarge/EFA + FSx for Lustre for fault-tolerant FSDP2 training."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: StackConfig,
        keep_creator_admin: bool = False,
        settings: Mapping[str, Any] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        # Every setting of this deploy, kept with the stack: the next deploy, from any clone,
        # reads it back (infra/deployed.py) and keeps what it is not told to change. A resource
        # (not template metadata), so that a changed setting is always a stack update.
        settings_parameter = ssm.CfnParameter(
            self,
            SETTINGS_PARAMETER_ID,
            type="String",
            value=json.dumps(dict(settings or {}), sort_keys=True, separators=(",", ":")),
            description="Deploy settings of this stack (infra/deployed.py reads them back)",
        )
        settings_parameter.override_logical_id(SETTINGS_PARAMETER_ID)
        # Before any construct: a file system too small or too slow for the largest overlay is
        # a ConfigError naming the context values and what would fit.
        sizing.check_fsx(
            capacity_gib=config.fsx.storage_capacity_gib,
            tier_mbps_per_tib=config.fsx.throughput_per_unit,
            sized_for=config.fsx.sized_for,
        )
        network = Network(
            self,
            "Network",
            availability_zones=config.network.availability_zones,
            gpu_availability_zone=config.network.gpu_availability_zone,
            vpc_cidr=config.network.vpc_cidr,
        )
        cluster = TrainingCluster(
            self,
            "Eks",
            vpc=network.vpc,
            config=config.cluster,
            keep_creator_admin=keep_creator_admin,
        )
        gpu = GpuNodeGroup(
            self,
            "Gpu",
            cluster=cluster.cluster,
            subnet=network.gpu_subnet,
            efa_security_group=network.efa_security_group,
            config=config.gpu,
            kubernetes_version=config.cluster.kubernetes_version,
            after=[cluster.vpc_cni],
        )
        storage = LustreStorage(
            self,
            "Storage",
            vpc=network.vpc,
            subnet=network.gpu_subnet,
            cluster=cluster.cluster,
            pod_identity_agent=cluster.pod_identity_agent,
            config=config.fsx,
        )
        if config.fsx.removal_policy == "retain":
            # A retained file system keeps its interfaces in its subnet and security group: the
            # stack's delete of those (and of the VPC) would fail with DependencyViolation
            # (aws/aws-cdk#31521). They are retained with it; `make destroy` prints what it
            # kept and the commands that delete it (infra/deployed.py RETAINED_DELETE).
            for retained in network.retained_with_file_system(storage.security_group):
                retained.apply_removal_policy(RemovalPolicy.RETAIN)
        DevicePlugins(self, "DevicePlugins", cluster=cluster.cluster)
        JobSetController(self, "JobSet", cluster=cluster.cluster, nodes=cluster.system_nodegroup)
        image = TrainerImage(self, "TrainerImage", config=config.image)
        self.image_tags = image.tags
        fs = storage.file_system
        workloads = TrainingWorkloads(
            self,
            "Workloads",
            cluster=cluster.cluster,
            namespace=config.workload.namespace,
            file_system_id=fs.file_system_id,
            dns_name=fs.dns_name,
            mount_name=fs.mount_name,
            storage_capacity_gib=config.fsx.storage_capacity_gib,
            image=image.image_uri,
            store_image=image.store_image_uri,
            csi_driver=storage.csi_driver,
        )
        fencer = NodeFencer(
            self,
            "NodeFencer",
            cluster=cluster.cluster,
            nodegroup=gpu.nodegroup,
            image=image.fencer_image_uri,
            max_in_flight=max_in_flight(config.gpu.overlay),
            training_namespace=config.workload.namespace,
            pod_identity_agent=cluster.pod_identity_agent,
            after=[workloads.namespace],
        )
        observability = Observability(
            self,
            "Observability",
            cluster=cluster.cluster,
            vpc=network.vpc,
            training_namespace=config.workload.namespace,
            alert_email=config.observability.alert_email,
        )
        nag.acknowledge(
            cluster=cluster.cluster,
            nodegroups=[cluster.system_nodegroup, gpu.nodegroup],
            csi_role=storage.csi_role,
            cni_role=cluster.cni_role,
            fencer_role=fencer.role,
        )

        name = config.cluster.cluster_name
        region = config.network.region
        outputs = {
            "ClusterName": (name, "EKS cluster name"),
            "Region": (region, "AWS region of the stack"),
            "UpdateKubeconfigCommand": (
                f"aws eks update-kubeconfig --region {region} --name {name}",
                "Run this to point kubectl at the cluster",
            ),
            "FsxFileSystemId": (fs.file_system_id, "FSx for Lustre file system id"),
            "FsxDnsName": (fs.dns_name, "FSx for Lustre DNS name"),
            "FsxMountName": (fs.mount_name, "FSx for Lustre mount name"),
            "ImageUri": (image.image_uri, "Trainer image the pods run"),
            "ImageRepositoryUri": (
                f"{Aws.ACCOUNT_ID}.dkr.ecr.{Aws.REGION}.{Aws.URL_SUFFIX}/"
                f"{config.image.repository_name}",
                "ECR repository of the images (infra/images.py); CI may push here too",
            ),
            "TrainingNamespace": (config.workload.namespace, "Namespace of the training job"),
            # The name, not `nodegroup_name` ("cluster/nodegroup" without the CDK feature flag
            # @aws-cdk/aws-eks:nodegroupNameAttribute: aws/aws-cdk#22442).
            "GpuNodegroupName": (
                gpu.nodegroup.node.default_child.attr_nodegroup_name,  # type: ignore[union-attr]
                "p5.48xlarge node group",
            ),
            "PrometheusWorkspaceId": (
                observability.workspace.attr_workspace_id,
                "Metrics workspace (Amazon Managed Service for Prometheus)",
            ),
            "PrometheusQueryUrl": (
                observability.workspace.attr_prometheus_endpoint,
                "Prometheus endpoint of the workspace (a Grafana data source, SigV4)",
            ),
            "AlertTopicArn": (observability.topic.topic_arn, "SNS topic the alerts go to"),
        }
        for output_id, (value, description) in outputs.items():
            CfnOutput(self, output_id, value=value, description=description)


def build_stacks(
    app: App,
    *,
    config: StackConfig,
    keep_creator_admin: bool = False,
    settings: Mapping[str, Any] | None = None,
) -> TrainingClusterStack:
    """The app's two stacks (app.py and the tests build them here): the images repository,
    then the training stack, whose image assets CDK publishes into that repository."""
    # Region only: the account comes from the credentials at deploy time, and with no account
    # synth never looks anything up (AZs are given in the context).
    env = Environment(region=config.network.region)
    training = TrainingClusterStack(
        app,
        STACK_NAME,
        config=config,
        keep_creator_admin=keep_creator_admin,
        settings=settings,
        env=env,
        synthesizer=DefaultStackSynthesizer(
            image_assets_repository_name=config.image.repository_name
        ),
        description="EKS + p5.48xlarge/EFA + FSx for Lustre for fault-tolerant FSDP2 training",
    )
    images = ImagesStack(
        app,
        IMAGES_STACK_NAME,
        config=config.image,
        running_tags=training.image_tags,
        env=env,
        description="ECR repository of the training stack's images (emptied on destroy)",
    )
    training.add_dependency(images, "its images are published into the repository")
    return training
