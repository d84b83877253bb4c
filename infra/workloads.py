"""Kubernetes objects applied with the stack, rendered by manifests/render.py (the same source as
the kustomize manifests): the shared objects on every deploy, the training job on request."""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import aws_eks_v2 as eks
from constructs import Construct, IDependable

from manifests import render


class TrainingWorkloads(Construct):
    """Namespace first; then the FSx PV + PVC, service account and configuration (after the FSx
    CSI driver); then, when `train_overlay` is set, that overlay's headless Service and Indexed
    Job (after `job_dependencies`, e.g. the GPU nodes and device plugins).

    Attributes: `namespace`, `shared`, `job` (None without an overlay).
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
        csi_driver: IDependable,
        train_overlay: str | None,
        job_dependencies: Sequence[IDependable] = (),
    ) -> None:
        super().__init__(scope, construct_id)
        objects = render.shared_objects(
            namespace=namespace,
            file_system_id=file_system_id,
            dns_name=dns_name,
            mount_name=mount_name,
            storage_capacity_gib=storage_capacity_gib,
            image=image,
        )
        namespaces = [o for o in objects if o.get("kind") == "Namespace"]
        others = [o for o in objects if o.get("kind") != "Namespace"]
        # Namespaced objects fail to apply before their namespace exists: two manifests, ordered.
        # The manifests live under the cluster (add_manifest), so their ids carry a prefix.
        self.namespace = cluster.add_manifest("TrainingNamespace", *namespaces)
        self.shared = cluster.add_manifest("TrainingShared", *others)
        self.shared.node.add_dependency(self.namespace)
        # The PV names the fsx.csi.aws.com driver: its CSIDriver object must exist first.
        self.shared.node.add_dependency(csi_driver)

        self.job: eks.KubernetesManifest | None = None
        if train_overlay is not None:
            if train_overlay not in render.OVERLAYS:
                raise ValueError(
                    f"unknown overlay {train_overlay!r}: use one of {', '.join(render.OVERLAYS)}"
                )
            job_objects = render.job_objects(
                overlay=train_overlay, namespace=namespace, image=image
            )
            self.job = cluster.add_manifest(f"TrainingJob-{train_overlay}", *job_objects)
            self.job.node.add_dependency(self.shared)
            for dependency in job_dependencies:
                self.job.node.add_dependency(dependency)
