"""Device plugins installed through Helm with pinned chart versions: NVIDIA (GPUs) and AWS EFA
(on EFA nodes only)."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_eks_v2 as eks
from constructs import Construct

from infra.gpu_nodegroup import GPU_TAINT_KEY


@dataclass(frozen=True)
class Chart:
    """A Helm chart pinned to one version."""

    repository: str
    """Helm repository URL."""
    name: str
    """Chart name in the repository."""
    version: str
    """Exact chart version: never `latest`, so a redeploy installs the same thing."""
    namespace: str
    """Namespace of the release."""


NVIDIA_DEVICE_PLUGIN = Chart(
    repository="https://nvidia.github.io/k8s-device-plugin",
    name="nvidia-device-plugin",
    version="0.17.2",
    namespace="kube-system",
)
EFA_DEVICE_PLUGIN = Chart(
    repository="https://aws.github.io/eks-charts",
    name="aws-efa-k8s-device-plugin",
    version="v0.5.7",
    namespace="kube-system",
)

# Both plugins run on the tainted GPU nodes only.
_GPU_TOLERATIONS = [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]


class DevicePlugins(Construct):
    """Advertises `nvidia.com/gpu` and `vpc.amazonaws.com/efa` to the scheduler.

    Attributes: `nvidia`, `efa` (the HelmChart constructs; a job needing them depends on them).
    """

    def __init__(self, scope: Construct, construct_id: str, *, cluster: eks.Cluster) -> None:
        super().__init__(scope, construct_id)
        self.nvidia = self._install(
            cluster,
            "NvidiaDevicePlugin",
            NVIDIA_DEVICE_PLUGIN,
            {
                "nodeSelector": {"nvidia.com/gpu.present": "true"},
                "tolerations": _GPU_TOLERATIONS,
            },
        )
        self.efa = self._install(
            cluster,
            "EfaDevicePlugin",
            EFA_DEVICE_PLUGIN,
            {
                # The label set on EFA nodes by the GPU node group (infra/gpu_nodegroup.py).
                "nodeSelector": {"vpc.amazonaws.com/efa.present": "true"},
                "tolerations": _GPU_TOLERATIONS,
            },
        )

    def _install(
        self, cluster: eks.Cluster, construct_id: str, chart: Chart, values: dict
    ) -> eks.HelmChart:
        return eks.HelmChart(
            self,
            construct_id,
            cluster=cluster,
            repository=chart.repository,
            chart=chart.name,
            version=chart.version,
            namespace=chart.namespace,
            release=chart.name,
            values=values,
            # DaemonSets on GPU nodes that may not exist yet (min size 0): never wait for them.
            wait=False,
            timeout=Duration.minutes(10),
        )
