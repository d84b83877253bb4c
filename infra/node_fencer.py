"""The node fencer in the cluster (infra/fencer; docs/node-loss.md, "The fencer"): its IAM role
through EKS Pod Identity, its Kubernetes rights, and its Deployment on the system nodes.

Every permission, and why:
- IAM ``ec2:TerminateInstances`` on instances only, and only those whose tags say they belong to
  this cluster's GPU node group: ``ec2:ResourceTag/eks:cluster-name`` and
  ``ec2:ResourceTag/eks:nodegroup-name`` (the tags EKS puts on a managed node group's instances;
  EKS's own node-group service-linked role conditions on ``ec2:ResourceTag/eks:nodegroup-name``,
  AWSServiceRoleForAmazonEKSNodegroup). The fence itself: a terminated instance never writes
  again. A system node, another node group or another cluster's instance is refused by IAM.
- IAM ``ec2:DescribeInstances`` on ``*``: EC2's Describe actions take no resource-level
  permissions (Service Authorization Reference, Amazon EC2: DescribeInstances has no resource
  type); read-only. The fencer waits for ``terminated`` before it marks the node.
- Kubernetes ``get``/``list``/``watch`` on Nodes (read the node group's nodes and their
  ``Ready`` condition) and ``patch`` (the out-of-service taint). No ``delete``: the cloud node
  lifecycle controller deletes the Node of a terminated instance. Nothing on pods: PodGC and the
  Job controller move them (kubernetes.io "Node Shutdowns", *Non-graceful node shutdown*).
The role is assumable only by this ServiceAccount of this cluster (infra/pod_identity.py).
"""

from __future__ import annotations

from aws_cdk import Aws
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from constructs import Construct, IDependable

from infra.fencer.settings import FENCER, FencerSettings
from infra.pod_identity import pod_identity_role
from manifests.sizes import SIZES

NAMESPACE = "kube-system"
NAME = "node-fencer"
SYSTEM_NODE_SELECTOR = {"node-role": "system"}
"""The system node group's label (infra/cluster.py): the fencer never runs on a node it fences."""
NODEGROUP_LABEL = "eks.amazonaws.com/nodegroup"
"""The label EKS managed node groups put on their nodes (EKS User Guide, "Managed node groups")."""
NODE_VERBS = ("get", "list", "watch", "patch")


def max_in_flight(overlay: str | None) -> int:
    """Nodes fenced at once, at most: the overlay's hot spares (manifests/sizes.py), at least 1
    (a group sized by a bare node count still gets its silent nodes replaced, one at a time)."""
    return max(SIZES[overlay].spares, 1) if overlay else 1


def policy_statements(*, cluster_name: str, nodegroup_name: str) -> list[iam.PolicyStatement]:
    return [
        iam.PolicyStatement(
            sid="TerminateOnlyThisGpuNodeGroup",
            actions=["ec2:TerminateInstances"],
            resources=[f"arn:{Aws.PARTITION}:ec2:{Aws.REGION}:{Aws.ACCOUNT_ID}:instance/*"],
            conditions={
                "StringEquals": {
                    "ec2:ResourceTag/eks:cluster-name": cluster_name,
                    "ec2:ResourceTag/eks:nodegroup-name": nodegroup_name,
                }
            },
        ),
        iam.PolicyStatement(
            sid="ReadInstanceStates", actions=["ec2:DescribeInstances"], resources=["*"]
        ),
    ]


def kubernetes_objects(
    *,
    image: str,
    region: str,
    nodegroup_name: str,
    max_in_flight: int,
    settings: FencerSettings = FENCER,
) -> list[dict]:
    """ServiceAccount, ClusterRole + binding (Nodes only) and the Deployment."""
    labels = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "eks-fsdp-resilient"}
    meta = {"name": NAME, "namespace": NAMESPACE, "labels": labels}
    env = {
        "AWS_REGION": region,
        "FENCE_NODE_SELECTOR": f"{NODEGROUP_LABEL}={nodegroup_name}",
        "FENCE_WAIT_S": str(settings.wait_s),
        "FENCE_MAX_IN_FLIGHT": str(max_in_flight),
        "FENCE_MAX_BAD_FRACTION": str(settings.max_bad_fraction),
        "FENCE_POLL_S": str(settings.poll_s),
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NAME, "labels": labels},
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": list(NODE_VERBS)}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": labels},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": NAME,
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                # Never two fencers at once (each would count the other's fences as its own
                # room): the old pod goes before the new one starts.
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": NAME,
                        "nodeSelector": SYSTEM_NODE_SELECTOR,
                        "priorityClassName": "system-cluster-critical",
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 65534,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [
                            {
                                "name": "fencer",
                                "image": image,
                                "command": ["python", "-m", "infra.fencer"],
                                "env": [{"name": k, "value": v} for k, v in env.items()],
                                "resources": {
                                    "requests": {"cpu": "50m", "memory": "128Mi"},
                                    "limits": {"memory": "256Mi"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                            }
                        ],
                    },
                },
            },
        },
    ]


class NodeFencer(Construct):
    """Attributes: `role`, `association`, `manifest`."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster: eks.Cluster,
        nodegroup: eks.Nodegroup,
        image: str,
        max_in_flight: int,
        pod_identity_agent: IDependable,
    ) -> None:
        super().__init__(scope, construct_id)
        self.role = pod_identity_role(
            self,
            "Role",
            cluster=cluster,
            namespace=NAMESPACE,
            service_account=NAME,
            description="Node fencer: terminates this cluster's silent GPU nodes (Pod Identity)",
        )
        # The name alone: `Nodegroup.nodegroup_name` is the resource's Ref ("cluster/nodegroup",
        # AWS::EKS::Nodegroup return values) unless the @aws-cdk/aws-eks:nodegroupNameAttribute
        # feature flag is on (aws-cdk-lib aws-eks-v2 managed-nodegroup); the tag holds the name.
        nodegroup_name = nodegroup.node.default_child.attr_nodegroup_name  # type: ignore[union-attr]
        for statement in policy_statements(
            cluster_name=cluster.cluster_name, nodegroup_name=nodegroup_name
        ):
            self.role.add_to_policy(statement)
        self.association = eks.CfnPodIdentityAssociation(
            self,
            "PodIdentity",
            cluster_name=cluster.cluster_name,
            namespace=NAMESPACE,
            service_account=NAME,
            role_arn=self.role.role_arn,
        )
        self.association.node.add_dependency(pod_identity_agent)
        self.manifest = cluster.add_manifest(
            "NodeFencer",
            *kubernetes_objects(
                image=image,
                region=Aws.REGION,
                nodegroup_name=nodegroup_name,
                max_in_flight=max_in_flight,
            ),
        )
        # Credentials before the pod starts: its first EC2 call would fail otherwise.
        self.manifest.node.add_dependency(self.association)
