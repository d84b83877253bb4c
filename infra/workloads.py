"""Kubernetes objects applied with the stack, rendered by manifests/render.py (the same source as
the kustomize manifests and the job launcher): the objects every training Job shares.

The training Job itself is not a stack resource; `make train TARGET=eks OVERLAY=<name>`
(`python -m training.launch.eks submit`) renders it from the same module and applies it by
server-side apply. Why CloudFormation must not own it (aws-cdk-lib's kubectl handler,
custom-resource-handlers/dist/aws-eks-v2/kubectl-handler/apply: Create runs `kubectl create`,
Update `kubectl apply`, Delete `kubectl delete`):

- a Job's pod template is immutable, so any later change to it (a new image, an overlay size)
  makes the Update's `kubectl apply` fail and rolls the whole stack back;
- a deploy without the Job in the app (say, to scale the GPU nodes) removes the resource, and
  CloudFormation's Delete runs `kubectl delete` on the running Job;
- the Job deletes itself `ttlSecondsAfterFinished` after it ends, behind CloudFormation's back,
  so the next Update of that resource re-creates it and reruns training;
- a content-hashed Job name would avoid the first failure but start a second Job next to the
  first on every change of image or overlay, and the launcher's status, logs and stop commands
  address the Job by its name.

So every stack operation leaves training alone: deploy, update and destroy touch only the shared
objects below, and only the user's own `make train` / `make eks-stop` start or stop a run.
`-c train=<overlay>` (the old request) stops synth with that command instead (infra/config.py).
"""

from __future__ import annotations

from aws_cdk import aws_eks_v2 as eks
from constructs import Construct, IDependable

from manifests import render


class TrainingWorkloads(Construct):
    """Namespace first; then the FSx PV + PVC, service account, configuration and rendezvous
    store (after the FSx CSI driver).

    Attributes: `namespace`, `shared`.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster: eks.Cluster,
        namespace: str,
        file_system_id: str,
        dns_name: str,
        mount_name: str,
        storage_capacity_gib: int,
        image: str,
        store_image: str,
        csi_driver: IDependable,
    ) -> None:
        super().__init__(scope, construct_id)
        objects = render.shared_objects(
            namespace=namespace,
            file_system_id=file_system_id,
            dns_name=dns_name,
            mount_name=mount_name,
            storage_capacity_gib=storage_capacity_gib,
            image=image,
            store_image=store_image,
        )
        if any(o.get("kind") == "Job" for o in objects):
            raise ValueError("a Job among the shared objects: the stack must not own a Job")
        namespaces = [o for o in objects if o.get("kind") == "Namespace"]
        others = [o for o in objects if o.get("kind") != "Namespace"]
        # Namespaced objects fail to apply before their namespace exists: two manifests, ordered.
        # The manifests live under the cluster (add_manifest), so their ids carry a prefix.
        self.namespace = cluster.add_manifest("TrainingNamespace", *namespaces)
        self.shared = cluster.add_manifest("TrainingShared", *others)
        self.shared.node.add_dependency(self.namespace)
        # The PV names the fsx.csi.aws.com driver: its CSIDriver object must exist first.
        self.shared.node.add_dependency(csi_driver)
