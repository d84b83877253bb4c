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
  type); read-only. The fencer waits for ``terminated`` before it marks the node, and lists the
  group's instances (by the same two tags) to find one that never joined.
- Kubernetes ``get``/``list``/``watch`` on Nodes (read the node group's nodes, their ``Ready``
  condition, cordon and the product's unfit label) and ``patch`` (the out-of-service taint). No
  ``delete``: the cloud node lifecycle controller deletes the Node of a terminated instance.
- Kubernetes ``list`` on pods, in the training namespace only (a Role, not a ClusterRole): is a
  training pod still on an unfit node, and which pods are ``Pending`` on a node whose FSx volume
  fails to mount? PodGC and the Job controller move the pods of a fenced node (kubernetes.io
  "Node Shutdowns", *Non-graceful node shutdown*).
- Kubernetes ``list`` on events, in the training namespace only: the kubelet's ``FailedMount``
  events, the only record that a pod's FSx volume never mounted (the container never starts).
- Kubernetes ``create`` on ``pods/eviction``, in the training namespace only: evict a trainer
  pod stuck on a failed FSx mount past ``FENCER.lustre_mount_s``, once its node is marked
  unfit (``lustre-mount``); the Eviction API adds ``DisruptionTarget``, which the Job's
  ``podFailurePolicy`` Ignores, and it honours PodDisruptionBudgets. No ``delete`` on pods.
The same ``TerminateInstances`` ends both kinds of bad node (infra/fencer/decide.py): a silent
one (fenced) and one the product cordoned (``ops.cordon.UNFIT_LABEL``) once it is empty
(replaced); a node a person cordoned is never touched.
The role is assumable only by this ServiceAccount of this cluster (infra/pod_identity.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from aws_cdk import Aws
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from constructs import Construct, IDependable

from infra.fencer.settings import FENCER, FencerSettings
from infra.pod_identity import pod_identity_role
from manifests.sizes import SIZES
from ops.cordon import LUSTRE_MOUNT, UNFIT_LABEL, cordon_patch

NAMESPACE = "kube-system"
NAME = "node-fencer"
SYSTEM_NODE_SELECTOR = {"node-role": "system"}
"""The system node group's label (infra/cluster.py): the fencer never runs on a node it fences."""
NODEGROUP_LABEL = "eks.amazonaws.com/nodegroup"
"""The label EKS managed node groups put on their nodes (EKS User Guide, "Managed node groups")."""
NODE_VERBS = ("get", "list", "watch", "patch")
POD_VERBS = ("list",)
EVENT_VERBS = ("list",)
EVICTION_VERBS = ("create",)
METRICS_PORT_NAME = "metrics"
"""The container port the stack's scraper keeps (infra/observability.py, job ``node-fencer``)."""


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
    cluster_name: str,
    nodegroup_name: str,
    max_in_flight: int,
    training_namespace: str,
    settings: FencerSettings = FENCER,
) -> list[dict]:
    """ServiceAccount, ClusterRole + binding (Nodes only), Role + binding (list pods and events,
    evict pods, in the training namespace) and the Deployment."""
    labels = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "eks-fsdp-resilient"}
    meta = {"name": NAME, "namespace": NAMESPACE, "labels": labels}
    env = {
        "AWS_REGION": region,
        "FENCE_NODE_SELECTOR": f"{NODEGROUP_LABEL}={nodegroup_name}",
        "FENCE_WAIT_S": str(settings.wait_s),
        "FENCE_MAX_IN_FLIGHT": str(max_in_flight),
        "FENCE_MAX_BAD_FRACTION": str(settings.max_bad_fraction),
        "FENCE_POLL_S": str(settings.poll_s),
        "FENCE_UNFIT_LABEL": UNFIT_LABEL,
        "FENCE_NAMESPACES": training_namespace,
        "FENCE_METRICS_PORT": str(settings.metrics_port),
        "FENCE_JOIN_TIMEOUT_S": str(settings.join_timeout_s),
        "FENCE_CLUSTER_NAME": cluster_name,
        "FENCE_NODEGROUP_NAME": nodegroup_name,
        "FENCE_MOUNT_TIMEOUT_S": str(settings.lustre_mount_s),
        # The product's own cordon body (ops.cordon, its one owner), as JSON: the fencer's image
        # carries infra/fencer alone.
        "FENCE_MOUNT_CORDON": json.dumps(cordon_patch(LUSTRE_MOUNT), sort_keys=True),
    }
    binding_subjects = [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
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
            "subjects": binding_subjects,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": NAME, "namespace": training_namespace, "labels": labels},
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": list(POD_VERBS)},
                {"apiGroups": [""], "resources": ["events"], "verbs": list(EVENT_VERBS)},
                {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": list(EVICTION_VERBS)},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": NAME, "namespace": training_namespace, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
            "subjects": binding_subjects,
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
                                "ports": [
                                    {
                                        "name": METRICS_PORT_NAME,
                                        "containerPort": settings.metrics_port,
                                    }
                                ],
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
        training_namespace: str,
        pod_identity_agent: IDependable,
        after: Sequence[IDependable] = (),
    ) -> None:
        """`after`: what must exist first (the training namespace, for the Role in it)."""
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
                cluster_name=cluster.cluster_name,
                nodegroup_name=nodegroup_name,
                max_in_flight=max_in_flight,
                training_namespace=training_namespace,
            ),
        )
        for dependency in after:
            self.manifest.node.add_dependency(dependency)
        # Credentials before the pod starts: its first EC2 call would fail otherwise.
        self.manifest.node.add_dependency(self.association)
