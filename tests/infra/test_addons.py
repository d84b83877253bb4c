"""The Helm charts (infra/addons.py): pinned in one place, DCGM exporter on GPU nodes only.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

import re

from aws_cdk.assertions import Match, Template
from infra_template import (
    HELM_CHART,
    gpu_nodegroup_has,
    only_one_has,
)

from infra.addons import CHARTS, DCGM_EXPORTER, EFA_DEVICE_PLUGIN, JOBSET, NVIDIA_DEVICE_PLUGIN


def test_charts_are_pinned_in_one_place(default_assertions: Template) -> None:
    charts = default_assertions.find_resources(HELM_CHART)
    assert (
        {r["Properties"]["Chart"] for r in charts.values()}
        == {c.name for c in CHARTS}
        == {
            "nvidia-device-plugin",
            "aws-efa-k8s-device-plugin",
            "dcgm-exporter",
            "jobset",
        }
    )
    assert {NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN, DCGM_EXPORTER, JOBSET} == set(CHARTS)
    for pinned in CHARTS:
        only_one_has(
            default_assertions,
            HELM_CHART,
            {"Version": pinned.version, "Repository": pinned.repository},
            selector={"Chart": pinned.name},
        )
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", pinned.version), pinned.version
    efa_values = {
        "nodeSelector": Match.exact({"vpc.amazonaws.com/efa.present": "true"}),
        "tolerations": [{"key": "nvidia.com/gpu"}],
    }
    default_assertions.has_resource_properties(
        HELM_CHART,
        {
            "Chart": "aws-efa-k8s-device-plugin",
            "Values": Match.serialized_json(Match.object_like(efa_values)),
        },
    )


def test_dcgm_exporter_on_gpu_nodes_only(default_assertions: Template) -> None:
    values = {
        # The GPU nodes' label (set by the node group) and the GPU taint's toleration, nothing
        # more.
        "nodeSelector": Match.exact({"nvidia.com/gpu.present": "true"}),
        "tolerations": Match.exact(
            [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        ),
        # No ServiceMonitor: its CRD (Prometheus Operator) is not installed by this stack.
        "serviceMonitor": Match.exact({"enabled": False}),
    }
    only_one_has(
        default_assertions,
        HELM_CHART,
        {"Values": Match.serialized_json(Match.object_like(values))},
        selector={"Chart": "dcgm-exporter"},
    )
    gpu_nodegroup_has(default_assertions, {"Labels": {"nvidia.com/gpu.present": "true"}})
