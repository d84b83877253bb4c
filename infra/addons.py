"""Helm charts on the GPU nodes, each pinned to one version in this module: the NVIDIA device
plugin (GPUs), the AWS EFA device plugin (EFA interfaces) and NVIDIA's DCGM exporter (GPU
telemetry in Prometheus format)."""

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


# The one place chart versions live. Check for newer ones before a deploy with
# `helm search repo <repo>/<chart> --versions`.
NVIDIA_DEVICE_PLUGIN = Chart(
    repository="https://nvidia.github.io/k8s-device-plugin",
    name="nvidia-device-plugin",
    # v0.19.2: NVIDIA/k8s-device-plugin PR #1814 "[release-0.19] Bump k8s-device-plugin
    # version to v0.19.2" (2026-05-26); the chart version equals the release.
    version="0.19.2",
    namespace="kube-system",
)
EFA_DEVICE_PLUGIN = Chart(
    repository="https://aws.github.io/eks-charts",
    name="aws-efa-k8s-device-plugin",
    # eks-charts release v0.0.244 (2026-09-10): "bump aws-efa-k8s-device-plugin to
    # v0.5.21-eksbuild.13" (aws/eks-charts PR #1366); the chart versions follow the plugin's.
    version="v0.5.21",
    namespace="kube-system",
)
DCGM_EXPORTER = Chart(
    repository="https://nvidia.github.io/dcgm-exporter/helm-charts",
    name="dcgm-exporter",
    # 4.8.3 (DCGM 4.6.0): DCGM Exporter release notes, "4.6.0-4.8.3, released 2026-07-15"
    # (https://docs.nvidia.com/datacenter/dcgm/latest/release-notes/dcgm-exporter.html); the
    # chart version is the exporter's.
    version="4.8.3",
    namespace="kube-system",
)
CHARTS: tuple[Chart, ...] = (NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN, DCGM_EXPORTER)

# Every chart here runs on the tainted GPU nodes only: a node selector on the GPU nodes' label
# and a toleration of the GPU taint (and nothing else).
GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
_GPU_TOLERATIONS = [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]


class DevicePlugins(Construct):
    """Advertises `nvidia.com/gpu` and `vpc.amazonaws.com/efa` to the scheduler, and exports
    DCGM's GPU metrics (utilisation, memory, XID errors, NVLink and PCIe counters) on port 9400
    of every GPU node.

    Attributes: `nvidia`, `efa`, `dcgm` (the HelmChart constructs).
    """

    def __init__(self, scope: Construct, construct_id: str, *, cluster: eks.Cluster) -> None:
        super().__init__(scope, construct_id)
        self.nvidia = self._install(
            cluster,
            "NvidiaDevicePlugin",
            NVIDIA_DEVICE_PLUGIN,
            {"nodeSelector": GPU_NODE_SELECTOR, "tolerations": _GPU_TOLERATIONS},
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
        self.dcgm = self._install(
            cluster,
            "DcgmExporter",
            DCGM_EXPORTER,
            {
                "nodeSelector": GPU_NODE_SELECTOR,
                "tolerations": _GPU_TOLERATIONS,
                # The chart's ServiceMonitor needs the Prometheus Operator's CRDs, which this
                # stack does not install; scrape the Service (port 9400) from your Prometheus or
                # the CloudWatch agent instead.
                "serviceMonitor": {"enabled": False},
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
