"""EKS node auto repair on the GPU node group (infra/cluster.py gpu_node_repair): the overrides
the API allows, each with every field EKS requires, checked by cfn-lint's own schema of
AWS::EKS::Nodegroup, an in-place update (no create-only property: the day-two rule), and a pace
and halt that agree with the node fencer's for every overlay.

The synthesized template carries exactly this setting (tests/infra/test_cluster.py,
``test_node_auto_repair_is_paced``) and passes cfn-lint as a whole
(tests/infra/test_infra_validation.py). What cannot run here: EKS's acceptance of each
condition/reason pair (only the API on a real cluster says so; cfn-lint's schema types them as
free strings) and the repair itself.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support import cfn_lint

from infra import replacements
from infra.cluster import GPU_REPAIR_FATAL_REASONS, gpu_node_repair
from infra.fencer.decide import FencePolicy, NodeView, decide
from infra.fencer.settings import FENCER
from infra.node_fencer import max_in_flight
from manifests.sizes import SIZES

GPU_NODE_REPAIR = gpu_node_repair(max_in_flight=1, node_count=17)
"""cdk.json's defaults (no overlay: 1 in flight; gpuNodesMax 17)."""

REGION = "us-east-2"
AGENT_CONDITIONS = {
    "AcceleratedHardwareReady",
    "ContainerRuntimeReady",
    "KernelReady",
    "NetworkingReady",
    "StorageReady",
}
"""The node monitoring agent's conditions (EKS User Guide, node-health.html)."""


def _lint(tmp_path: Path, repair: dict) -> subprocess.CompletedProcess:
    template = {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Resources": {
            "Gpu": {
                "Type": "AWS::EKS::Nodegroup",
                "Properties": {
                    "ClusterName": "c",
                    "NodeRole": "arn:aws:iam::123456789012:role/n",
                    "Subnets": ["subnet-0123456789abcdef0"],
                    "NodeRepairConfig": repair,
                },
            }
        },
    }
    path = tmp_path / "template.json"
    path.write_text(json.dumps(template))
    return cfn_lint(path, "--regions", REGION)


def test_every_override_names_an_agent_condition_and_has_every_field() -> None:
    overrides = GPU_NODE_REPAIR["NodeRepairConfigOverrides"]
    assert len(overrides) == sum(len(r) for r in GPU_REPAIR_FATAL_REASONS.values())
    for override in overrides:
        assert set(override) == {
            "NodeMonitoringCondition",
            "NodeUnhealthyReason",
            "MinRepairWaitTimeMins",
            "RepairAction",
        }
        assert override["NodeMonitoringCondition"] in AGENT_CONDITIONS
        assert override["MinRepairWaitTimeMins"] >= 1
        assert override["RepairAction"] == "Replace"
    pairs = [(o["NodeMonitoringCondition"], o["NodeUnhealthyReason"]) for o in overrides]
    assert len(set(pairs)) == len(pairs)


def test_cfn_lint_accepts_the_setting(tmp_path: Path) -> None:
    result = _lint(tmp_path, GPU_NODE_REPAIR)
    assert result.stdout == "" and result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "broken",
    [
        {"RepairAction": "Terminate"},  # not Replace | Reboot | NoAction
        {"MinRepairWaitTimeMins": 0},  # minimum 1
        {"Condition": "NetworkingReady"},  # no such field
    ],
)
def test_cfn_lint_checks_the_overrides(tmp_path: Path, broken: dict) -> None:
    """The same lint fails a broken override: the acceptance above is a check."""
    repair = json.loads(json.dumps(GPU_NODE_REPAIR))
    repair["NodeRepairConfigOverrides"][0].update(broken)
    result = _lint(tmp_path, repair)
    assert result.returncode != 0 and ":E" in result.stdout, result.stdout


def test_node_repair_updates_in_place() -> None:
    """No part of NodeRepairConfig is create-only (cfn-lint's schema, the day-two test's
    source): changing it never replaces the node group."""
    paths = replacements.create_only_paths("AWS::EKS::Nodegroup", REGION)
    assert paths, "the schema lists the node group's create-only properties"
    assert not [p for p in paths if p[0] == "NodeRepairConfig"]


def _eks_repairs(repair: dict, *, bad: int, size: int) -> bool:
    """EKS repairs while the unhealthy share is at or under the threshold (EKS API reference,
    NodeRepairConfig ``MaxUnhealthyNodeThresholdPercentage``; node-repair.html)."""
    return 100 * bad / size <= repair["MaxUnhealthyNodeThresholdPercentage"]


@pytest.mark.parametrize("overlay", [*SIZES, None])
def test_eks_repair_paces_and_halts_as_the_fencer_does(overlay: str | None) -> None:
    """For every overlay's group size and every count of bad nodes, EKS repair halts exactly
    when the fencer's decide() halts, and repairs as many nodes at once as the fencer ends
    (the spares): the two never disagree on pace or halt."""
    size = SIZES[overlay].node_count if overlay else 17
    spares = max_in_flight(overlay)
    repair = gpu_node_repair(max_in_flight=spares, node_count=size)
    assert repair["MaxParallelNodesRepairedCount"] == spares
    policy = FencePolicy(
        wait_s=FENCER.wait_s, max_in_flight=spares, max_bad_fraction=FENCER.max_bad_fraction
    )
    for bad in range(size + 1):
        nodes = [
            NodeView(
                name=f"n{i}",
                instance_id=f"i-{i}",
                ready="Unknown" if i < bad else "True",
                ready_since=0.0,
                out_of_service=False,
            )
            for i in range(size)
        ]
        fencer_halts = decide(nodes, now=1e6, policy=policy, in_flight=0).alert is not None
        assert fencer_halts == (not _eks_repairs(repair, bad=bad, size=size)), (overlay, bad)
