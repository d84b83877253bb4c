"""Helm charts, each pinned to one version in this module: on the GPU nodes the NVIDIA device
plugin (GPUs), the AWS EFA device plugin (EFA interfaces) and NVIDIA's DCGM exporter (GPU
telemetry in Prometheus format); on the system nodes the JobSet controller (the replica groups'
JobSet, ``manifests/replica.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_eks_v2 as eks
from constructs import Construct

from infra.gpu_nodegroup import GPU_TAINT_KEY
from infra.observability import dcgm_exporter_values


@dataclass(frozen=True)
class Chart:
    """A Helm chart pinned to one version."""

    repository: str
    """Helm repository URL; for an OCI chart, the chart's own ``oci://`` reference (the CDK
    kubectl handler runs ``helm pull <repository> --version <version>`` for those,
    aws-cdk-lib ``custom-resource-handlers/.../kubectl-handler/helm/__init__.py``)."""
    name: str
    """Chart name in the repository."""
    version: str
    """Exact chart version: never `latest`, so a redeploy installs the same thing."""
    namespace: str
    """Namespace of the release."""


# The one place chart versions live: the newest version in each chart repository's index
# (its gh-pages branch, index.yaml) as of the dates below. Check for newer ones before a deploy
# with `helm search repo <repo>/<chart> --versions`.
NVIDIA_DEVICE_PLUGIN = Chart(
    repository="https://nvidia.github.io/k8s-device-plugin",
    name="nvidia-device-plugin",
    # NVIDIA/k8s-device-plugin gh-pages index.yaml (2026-08-20): 0.20.0, tag v0.20.0.
    version="0.20.0",
    namespace="kube-system",
)
EFA_DEVICE_PLUGIN = Chart(
    repository="https://aws.github.io/eks-charts",
    name="aws-efa-k8s-device-plugin",
    # aws/eks-charts gh-pages index.yaml (2026-08-03): v0.5.30 (plugin v0.5.20,
    # stable/aws-efa-k8s-device-plugin/Chart.yaml).
    version="v0.5.30",
    namespace="kube-system",
)
DCGM_EXPORTER = Chart(
    repository="https://nvidia.github.io/dcgm-exporter/helm-charts",
    name="dcgm-exporter",
    # NVIDIA/dcgm-exporter gh-pages helm-charts/index.yaml: 4.8.2 (exporter 4.8.2, DCGM
    # 4.5.3). The release notes list 4.6.0-4.8.3 (2026-07-15,
    # https://docs.nvidia.com/datacenter/dcgm/latest/release-notes/dcgm-exporter.html); pin it
    # once its chart is in the index.
    version="4.8.2",
    namespace="kube-system",
)
JOBSET = Chart(
    # Published as an OCI chart only (no index.yaml: no `helm search`); its install guide:
    # `helm install jobset oci://registry.k8s.io/jobset/charts/jobset --version 0.12.0
    # --create-namespace --namespace=jobset-system` (https://jobset.sigs.k8s.io/docs/installation,
    # kubernetes-sigs/jobset site/content/en/docs/installation/_index.md at v0.12.0). 0.12.0 is
    # the newest release tag (kubernetes-sigs/jobset releases, charts/jobset/Chart.yaml
    # `version: 0.12.0`); the released chart pins its controller image to the same tag
    # (hack/helm-chart-package.sh). Check for newer ones with
    # `helm show chart oci://registry.k8s.io/jobset/charts/jobset --version <v>`.
    repository="oci://registry.k8s.io/jobset/charts/jobset",
    name="jobset",
    version="0.12.0",
    namespace="jobset-system",
)
CHARTS: tuple[Chart, ...] = (NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN, DCGM_EXPORTER, JOBSET)

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
                # stack does not install; the stack's managed scraper (infra/observability.py)
                # finds the exporter's pods by their metrics port instead.
                "serviceMonitor": {"enabled": False},
                # The fields the alerts and the dashboard read (observability/dcgm-counters.csv).
                **dcgm_exporter_values(),
            },
        )

    def _install(
        self, cluster: eks.Cluster, construct_id: str, chart: Chart, values: dict
    ) -> eks.HelmChart:
        # DaemonSets on GPU nodes that may not exist yet (min size 0): never wait for them.
        return install_chart(self, construct_id, cluster=cluster, chart=chart, values=values)


def install_chart(
    scope: Construct,
    construct_id: str,
    *,
    cluster: eks.Cluster,
    chart: Chart,
    values: dict,
    wait: bool = False,
) -> eks.HelmChart:
    return eks.HelmChart(
        scope,
        construct_id,
        cluster=cluster,
        repository=chart.repository,
        chart=chart.name,
        version=chart.version,
        namespace=chart.namespace,
        release=chart.name,
        values=values,
        wait=wait,
        timeout=Duration.minutes(10),
    )


SYSTEM_NODE_SELECTOR = {"node-role": "system"}
"""The system node group's label (infra/cluster.py)."""


class JobSetController(Construct):
    """The JobSet API (``jobset.x-k8s.io``) and its controller and webhook, on the system nodes
    (never on a GPU node: a lost training node must not take the controller that restarts its
    group along). The stack waits for it (``wait``), after the system nodes: a JobSet submitted
    before its webhook answers is refused.

    Attribute: `chart` (the HelmChart construct)."""

    def __init__(
        self, scope: Construct, construct_id: str, *, cluster: eks.Cluster, nodes: Construct
    ) -> None:
        super().__init__(scope, construct_id)
        self.chart = install_chart(
            self,
            "Chart",
            cluster=cluster,
            chart=JOBSET,
            values={"controller": {"nodeSelector": SYSTEM_NODE_SELECTOR}},
            wait=True,
        )
        # It waits for its pod: the system nodes (``nodes``) must exist first, as for the
        # cluster's add-ons (infra/cluster.py).
        self.chart.node.add_dependency(nodes)
