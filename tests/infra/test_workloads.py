"""The Kubernetes objects the stack applies (infra/workloads.py): the shared objects from
manifests/render.py, and never the training Job.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from aws_cdk.assertions import Template
from infra_template import (
    K8S_RESOURCE,
)

from manifests import render


def k8s_manifests(template: Template) -> dict[str, dict[str, Any]]:
    """The workloads' two KubernetesResource custom resources: the namespace, then the shared
    objects (AMP gives the metrics scraper its access itself). The third is the node fencer's
    (infra/node_fencer.py, tests/infra/test_node_fencer.py)."""
    template.resource_count_is(K8S_RESOURCE, 3)  # no training job without -c train=...
    found = template.find_resources(K8S_RESOURCE)
    return {k: r for k, r in found.items() if "NodeFencer" not in k}


def manifest_text(resource: dict[str, Any]) -> str:
    # A manifest is JSON text, or an Fn::Join of text and references: search its JSON.
    return json.dumps(resource["Properties"]["Manifest"])


def test_shared_objects_order_and_fsx_volume(default_assertions: Template) -> None:
    manifests = k8s_manifests(default_assertions)
    (namespace_id,) = [
        k for k, r in manifests.items() if '\\"kind\\":\\"Namespace\\"' in manifest_text(r)
    ]
    (shared_id,) = [k for k in manifests if k != namespace_id]
    csi = default_assertions.get_resource_id(
        "AWS::EKS::Addon", {"Properties": {"AddonName": "aws-fsx-csi-driver"}}
    )
    assert {namespace_id, csi} <= set(manifests[shared_id]["DependsOn"])
    text = manifest_text(manifests[shared_id])
    fs_id = default_assertions.get_resource_id("AWS::FSx::FileSystem")
    for expected in (
        "PersistentVolume",
        "PersistentVolumeClaim",
        "fsx.csi.aws.com",
        fs_id,
        "LustreMountName",
    ):
        assert expected in text


@pytest.mark.parametrize("fixture", ["default_assertions", "variant_assertions"])
def test_the_stack_owns_no_job(fixture: str, request: pytest.FixtureRequest) -> None:
    """No stack operation can fail on, delete or rerun training: no Job is a stack resource
    (the Job is submitted by `make train TARGET=eks`; infra/workloads.py says why)."""
    template: Template = request.getfixturevalue(fixture)
    for resource in k8s_manifests(template).values():
        kinds = set(re.findall(r'\\"kind\\":\\"(\w+)\\"', manifest_text(resource)))
        assert kinds
        assert "Job" not in kinds
        # The shared objects are the renderer's, applied on every deploy.
        assert kinds <= {o["kind"] for o in render.shared_objects(**SHARED_ARGS)}


SHARED_ARGS = {
    "namespace": "training",
    "file_system_id": "fs-0",
    "dns_name": "d",
    "mount_name": "m",
    "storage_capacity_gib": 1200,
    "image": "i:1",
}
