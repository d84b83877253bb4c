"""IAM roles that EKS Pod Identity assumes for one service account of one cluster.

The trust policy lets `pods.eks.amazonaws.com` assume the role and tag the session
(`sts:AssumeRole`, `sts:TagSession`) only for this account, this cluster and this service
account: EKS Pod Identity sets the session tags `eks-cluster-arn`, `kubernetes-namespace` and
`kubernetes-service-account` on every assumption, and the EKS user guide shows them as the
trust policy's conditions ("Create IAM role with trust policy required by EKS Pod Identity",
pod-id-role.html, "Setting Conditions"; the tag list: pod-id-abac.html). `aws:SourceAccount`
keeps any other account's cluster out (confused deputy).
"""

from __future__ import annotations

from aws_cdk import Aws
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from constructs import Construct

POD_IDENTITY_PRINCIPAL = "pods.eks.amazonaws.com"


def pod_identity_role(
    scope: Construct,
    construct_id: str,
    *,
    cluster: eks.ICluster,
    namespace: str,
    service_account: str,
    description: str,
) -> iam.Role:
    """A role for `namespace/service_account` of `cluster`, through EKS Pod Identity."""
    conditions = {
        "StringEquals": {
            "aws:SourceAccount": Aws.ACCOUNT_ID,
            "aws:RequestTag/eks-cluster-arn": cluster.cluster_arn,
            "aws:RequestTag/kubernetes-namespace": namespace,
            "aws:RequestTag/kubernetes-service-account": service_account,
        }
    }
    principal = iam.SessionTagsPrincipal(
        iam.PrincipalWithConditions(iam.ServicePrincipal(POD_IDENTITY_PRINCIPAL), conditions)
    )
    return iam.Role(scope, construct_id, description=description, assumed_by=principal)
