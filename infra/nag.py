"""The IaC scans and every acknowledgment with its reason, all in this module:

- cdk-nag's AwsSolutions pack runs at synth (an unacknowledged finding fails synthesis);
- checkov (`checkov -d cdk.out --framework cloudformation`) reads the acknowledgments below from
  each resource's `Metadata.checkov.skip` in the synthesized template, so a scan of `cdk.out`
  reports every other finding; the last scan (checkov 3.3.30, default and variant templates)
  found exactly those acknowledged in CHECKOV_KUBECTL_PROVIDER, after CKV_AWS_136 (ECR
  encryption) was fixed in infra/image.py;
- our own checks for what cdk-nag does not look at on aws_eks_v2 clusters.

checkov is not a project dependency (it pins its own versions of common packages); run it from
its own environment, offline (it warns that it cannot fetch guidelines, and scans anyway):

    python3 -m venv /tmp/checkov && /tmp/checkov/bin/pip install checkov==3.3.30
    make synth && /tmp/checkov/bin/checkov -d cdk.out --framework cloudformation --compact
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aws_cdk import Acknowledgment, App, CfnResource, Validations
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_lambda as lambda_
from cdk_nag import AwsSolutionsChecks
from constructs import IConstruct


def add_checks(app: App) -> None:
    """Run the AwsSolutions pack at synth: an unacknowledged finding fails synthesis."""
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))


def acknowledge(
    *,
    cluster: eks.Cluster,
    nodegroups: Sequence[IConstruct],
    csi_role: IConstruct,
    cni_role: IConstruct,
    fencer_role: IConstruct | None = None,
) -> None:
    """Acknowledge, each on the construct it concerns and with its reason, the findings this
    design accepts. Nothing is acknowledged stack-wide: a new finding anywhere fails synth."""
    kubectl_provider = cluster.node.find_child("KubectlProvider")
    for scope, acknowledgments in (
        (cluster.role, CLUSTER_ROLE),
        (kubectl_provider, KUBECTL_PROVIDER),
        *((nodegroup, NODE_ROLE) for nodegroup in nodegroups),
        (csi_role, FSX_CSI_ROLE),
        (cni_role, VPC_CNI_ROLE),
        *(((fencer_role, FENCER_ROLE),) if fencer_role is not None else ()),
    ):
        for rule, reason in acknowledgments.items():
            Validations.of(scope).acknowledge(
                Acknowledgment(id=f"AwsSolutions::{rule}", reason=reason)
            )
    for function in kubectl_provider.node.find_all():
        if isinstance(function, lambda_.CfnFunction):
            skip_checkov(function, CHECKOV_KUBECTL_PROVIDER)


def skip_checkov(resource: CfnResource, acknowledgments: dict[str, str]) -> None:
    """Acknowledge checkov findings on one resource (checkov reads `Metadata.checkov.skip`)."""
    resource.add_metadata(
        "checkov",
        {"skip": [{"id": rule, "comment": reason} for rule, reason in acknowledgments.items()]},
    )


def _managed(policy: str) -> str:
    return f"AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{policy}]"


CLUSTER_ROLE = {
    _managed("AmazonEKSClusterPolicy"): (
        "The EKS service role needs exactly this AWS-managed policy; AWS updates it when EKS "
        "needs new permissions, which a copied inline policy would miss."
    ),
}
NODE_ROLE = {
    _managed("AmazonEKSWorkerNodePolicy"): (
        "Required by every EKS managed node (kubelet registration, EKS API reads); EKS documents "
        "this managed policy as the node role's baseline."
    ),
    _managed("AmazonEC2ContainerRegistryPullOnly"): (
        "Nodes pull the trainer, store and EKS add-on images from ECR; PullOnly is the least "
        "ECR access that pulls (EKS user guide, 'Amazon EKS node IAM role'). The CNI policy is "
        "not on the node role: aws-node has its own role (VPC_CNI_ROLE)."
    ),
}
VPC_CNI_ROLE = {
    _managed("AmazonEKS_CNI_Policy"): (
        "The VPC CNI (aws-node, through Pod Identity) assigns pod IPs with EC2 ENI calls; this "
        "is the managed policy EKS documents for it, kept up to date by AWS with the CNI."
    ),
}
KUBECTL_PROVIDER = {
    _managed("service-role/AWSLambdaBasicExecutionRole"): (
        "aws-cdk-lib's kubectl provider Lambda functions only write their own CloudWatch logs "
        "with this policy."
    ),
    _managed("service-role/AWSLambdaVPCAccessExecutionRole"): (
        "The kubectl provider runs in the private subnets to reach the private API endpoint; "
        "Lambda needs this policy to create its VPC network interfaces."
    ),
    _managed("AmazonEC2ContainerRegistryReadOnly"): (
        "aws-cdk-lib's kubectl handler may install Helm charts from ECR (OCI) repositories."
    ),
    (
        'AwsSolutions-IAM4[Policy::{"Fn::If":["EksClusterKubectlProviderHandlerHasEcrPublic'
        'C426D1A5",{"Fn::Join":["",["arn:",{"Ref":"AWS::Partition"},":iam::aws:policy/'
        'AmazonElasticContainerRegistryPublicReadOnly"]]},{"Ref":"AWS::NoValue"}]}]'
    ): (
        "aws-cdk-lib attaches ECR Public read-only access to the kubectl handler only in "
        "partitions that have ECR Public, for public OCI Helm charts."
    ),
    "AwsSolutions-L1": (
        "aws-cdk-lib picks the kubectl handler's Python runtime (the newest it knows at release "
        "2.275); it is not configurable and is updated with aws-cdk-lib."
    ),
    "AwsSolutions-IAM5[Resource::<EksClusterKubectlProviderHandlerDA75FB7A.Arn>:*]": (
        "The custom resource framework invokes any version of the one kubectl handler function; "
        "the wildcard is the version suffix of that single function ARN."
    ),
}
# aws-cdk-lib's kubectl provider functions (the handler and the custom-resource framework's
# onEvent): their code and configuration belong to aws-cdk-lib, and they run only while
# CloudFormation applies a Kubernetes manifest or Helm chart.
CHECKOV_KUBECTL_PROVIDER = {
    "CKV_AWS_115": (
        "Invoked only by CloudFormation, one call per custom resource; a reserved concurrency "
        "limit would only make stack operations fail."
    ),
    "CKV_AWS_116": (
        "Called synchronously by the custom-resource framework, which reports a failure to "
        "CloudFormation (the stack rolls back); there is no asynchronous event to dead-letter."
    ),
    "CKV_AWS_173": (
        "The environment holds no secrets (cluster name, role ARN, kubectl paths); Lambda "
        "encrypts it at rest with its service key."
    ),
}
FSX_CSI_ROLE = {
    "AwsSolutions-IAM5[Resource::*]": (
        "fsx:DescribeFileSystems and fsx:DescribeVolumes support no resource-level permissions; "
        "the role grants nothing else (the PV is provisioned statically)."
    ),
}


def eks_cluster_findings(template: dict[str, Any]) -> list[str]:
    """Problems with every AWS::EKS::Cluster in a synthesized template; empty when all is well.

    cdk-nag's EKS rules (EKS1, EKS2) read the old aws-eks custom resource, not the native
    AWS::EKS::Cluster that aws_eks_v2 emits, so these are checked here: the public endpoint is
    off or limited to named CIDRs, every control-plane log type is on, secrets are encrypted
    with a KMS key.
    """
    findings: list[str] = []
    for logical_id, resource in template.get("Resources", {}).items():
        if resource.get("Type") != "AWS::EKS::Cluster":
            continue
        props = resource.get("Properties", {})
        vpc_config = props.get("ResourcesVpcConfig", {})
        if vpc_config.get("EndpointPublicAccess", True):
            cidrs = vpc_config.get("PublicAccessCidrs") or ["0.0.0.0/0"]
            if any(c in ("0.0.0.0/0", "::/0") for c in cidrs):
                findings.append(f"{logical_id}: public endpoint open to the internet")
        if not vpc_config.get("EndpointPrivateAccess", False):
            findings.append(f"{logical_id}: private endpoint access is off")
        enabled = {
            entry.get("Type")
            for entry in props.get("Logging", {}).get("ClusterLogging", {}).get("EnabledTypes", [])
        }
        missing = set(LOG_TYPES) - enabled
        if missing:
            findings.append(f"{logical_id}: control-plane logs off: {sorted(missing)}")
        encryption = props.get("EncryptionConfig") or []
        if not any(
            "secrets" in e.get("Resources", []) and e.get("Provider", {}).get("KeyArn")
            for e in encryption
        ):
            findings.append(f"{logical_id}: secrets are not encrypted with a KMS key")
    return findings


LOG_TYPES = ("api", "audit", "authenticator", "controllerManager", "scheduler")
FENCER_ROLE = {
    "AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:<AWS::AccountId>:"
    "instance/*]": (
        "The node fencer terminates the GPU node that stopped answering, whose id is known only "
        "then; the statement's condition narrows it to instances tagged with this cluster's "
        "name and its GPU node group's name (eks:cluster-name, eks:nodegroup-name), so no other "
        "instance can be terminated (infra/node_fencer.py)."
    ),
    "AwsSolutions-IAM5[Resource::*]": (
        "ec2:DescribeInstances takes no resource-level permissions (Service Authorization "
        "Reference, Amazon EC2): '*' is the only resource it accepts; it is read-only and is "
        "the fencer's only other AWS permission."
    ),
}
