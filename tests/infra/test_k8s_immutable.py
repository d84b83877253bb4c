"""Immutable Kubernetes fields in the manifests the stack applies (infra/k8s_immutable.py): a
change that `kubectl apply` cannot make is refused at synth like a create-only property.

What cannot run here: the API server that refuses the update. The table cites the update
validation of each field (kubernetes/kubernetes pkg/apis/*/validation); these tests pin the
table's use on the stack's real templates, up to that boundary.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from infra_synth import CDK_JSON_CONTEXT, synth

from infra import first_deploy, k8s_immutable, replacements
from infra.config import load_config
from manifests.render import OVERLAYS
from manifests.sizes import SIZES

REGION = "us-east-2"


def _manifest_objects(template: dict[str, Any]) -> list[dict[str, Any]]:
    """Every Kubernetes object of the template's kubectl manifests, the intrinsics left as
    text (only kinds and plain fields are read)."""
    objects = []
    for resource in template["Resources"].values():
        if resource["Type"] != replacements.MANIFEST_TYPE:
            continue
        manifest = replacements._flatten(resource["Properties"]["Manifest"], frozenset())
        objects += json.loads(manifest)
    return objects


def test_every_kind_the_stack_applies_is_looked_up(default_template: dict[str, Any]) -> None:
    kinds = {o["kind"] for o in _manifest_objects(default_template)}
    assert {"PriorityClass", "PersistentVolumeClaim", "Deployment", "Service"} <= kinds
    k8s_immutable.check_known(kinds)
    with pytest.raises(ValueError, match=r"CronJob.*IMMUTABLE_FIELDS"):
        k8s_immutable.check_known(kinds | {"CronJob"})


def _kept() -> dict[str, str]:
    """The deployed settings of cdk.json's defaults (nothing about them changes here)."""
    counts = {name: size.node_count for name, size in SIZES.items()}
    config = load_config(CDK_JSON_CONTEXT.get, overlays=OVERLAYS, node_counts=counts)
    return first_deploy.settings(config)


def test_a_priority_class_value_change_is_refused(
    default_template: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's case (G13): a code change of the store's priority synthesizes an in-place
    update of the manifest, which `kubectl apply` would fail on. A real synth of the change."""
    from manifests import render
    from manifests.objects import rdzv_store

    # The builder's own module (render re-exports the name; patching it there changes nothing).
    monkeypatch.setattr(rdzv_store, "RDZV_PRIORITY", render.RDZV_PRIORITY + 1)
    after, _ = synth(outdir=tmp_path / "cdk")
    changes = replacements.diff(default_template, after, region=REGION)
    (change,) = [c for c in changes if c.type == "PriorityClass"]
    assert change.action == "replace" and change.destructive
    assert change.reasons == (
        "value is immutable",
        f"delete it first: kubectl delete priorityclass {render.RDZV_PRIORITY_CLASS}",
    )
    args = dict(kept=_kept(), now=_kept(), last_template=default_template, template=after)
    with pytest.raises(first_deploy.ReplacementRefused, match="PriorityClass") as refused:
        first_deploy.check(**args, acknowledged=(), region=REGION)
    assert "value is immutable" in str(refused.value)
    # One acknowledgement per object: the manifest resource, kind and name.
    assert str(refused.value).endswith(f"acknowledgeReplacement={change.logical_id}")
    first_deploy.check(**args, acknowledged=(change.logical_id,), region=REGION)


def test_a_mutable_change_of_the_same_object_is_an_update(default_template: dict[str, Any]) -> None:
    """The description of the same PriorityClass may change: an update, refused by nothing."""
    from manifests import render

    text = next(
        o["description"] for o in render.shared_objects(**_SHARED) if o["kind"] == "PriorityClass"
    )

    def reword(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(text, text + " (reworded)")
        if isinstance(value, list):
            return [reword(v) for v in value]
        if isinstance(value, dict):
            return {k: reword(v) for k, v in value.items()}
        return value

    after = copy.deepcopy(default_template)
    for resource in after["Resources"].values():
        if resource["Type"] == replacements.MANIFEST_TYPE:
            resource["Properties"] = reword(resource["Properties"])
    changes = replacements.diff(default_template, after, region=REGION)
    (change,) = [c for c in changes if c.type == "PriorityClass"]
    assert change.action == "update" and not change.destructive


_SHARED = dict(
    namespace="training",
    file_system_id="fs-1",
    dns_name="d",
    mount_name="m",
    storage_capacity_gib=4800,
    image="i",
    store_image="s",
)


_SC = {"storageClassName": "fsx-sc"}


def _gib(n: int) -> dict[str, str]:
    return {"storage": f"{n}Gi"}


def _obj(kind: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": "x", "namespace": "training"}, **fields}


@pytest.mark.parametrize(
    ("old", "new", "fields"),
    [
        (_obj("PriorityClass", value=1), _obj("PriorityClass", value=2), ["value"]),
        (
            _obj("PriorityClass", preemptionPolicy="Never"),
            _obj("PriorityClass", preemptionPolicy="PreemptLowerPriority"),
            ["preemptionPolicy"],
        ),
        # Absent is the server's default, PreemptLowerPriority (the API reference,
        # PriorityClass.preemptionPolicy: "If unset, defaults to PreemptLowerPriority"): the
        # stored object already holds it, so setting it explicitly changes nothing.
        (
            _obj("PriorityClass", value=1),
            _obj("PriorityClass", value=1, preemptionPolicy="PreemptLowerPriority"),
            [],
        ),
        (
            _obj("PriorityClass", value=1),
            _obj("PriorityClass", value=1, preemptionPolicy="Never"),
            ["preemptionPolicy"],
        ),
        (
            _obj("Job", spec={"completions": 2, "parallelism": 2}),
            _obj("Job", spec={"completions": 4, "parallelism": 4}),
            ["spec.completions"],
        ),
        # An Indexed Job's completions may change together with parallelism (elastic Indexed
        # Jobs: validateCompletions).
        (
            _obj("Job", spec={"completionMode": "Indexed", "completions": 2, "parallelism": 2}),
            _obj("Job", spec={"completionMode": "Indexed", "completions": 4, "parallelism": 4}),
            [],
        ),
        (
            _obj("Job", spec={"completionMode": "Indexed", "completions": 2, "parallelism": 2}),
            _obj("Job", spec={"completionMode": "Indexed", "completions": 4, "parallelism": 2}),
            ["spec.completions"],
        ),
        (_obj("Secret", type="Opaque"), _obj("Secret", type="kubernetes.io/tls"), ["type"]),
        (_obj("Secret"), _obj("Secret", type="Opaque"), []),  # Opaque is the default
        (
            _obj("Deployment", spec={"selector": {"matchLabels": {"a": "1"}}}),
            _obj("Deployment", spec={"selector": {"matchLabels": {"a": "2"}}}),
            ["spec.selector"],
        ),
        # A headless Service cannot become a ClusterIP one by dropping `clusterIP: None`.
        (_obj("Service", spec={"clusterIP": "None"}), _obj("Service", spec={}), ["spec.clusterIP"]),
        # ...but a move to ExternalName clears it.
        (
            _obj("Service", spec={"clusterIP": "None"}),
            _obj("Service", spec={"type": "ExternalName", "externalName": "a.example.com"}),
            [],
        ),
        (
            _obj("Job", spec={"template": {"spec": {"containers": [{"image": "a"}]}}}),
            _obj("Job", spec={"template": {"spec": {"containers": [{"image": "b"}]}}}),
            ["spec.template"],
        ),
        (
            _obj("PersistentVolume", spec={"csi": {"volumeHandle": "fs-1"}}),
            _obj("PersistentVolume", spec={"csi": {"volumeHandle": "fs-2"}}),
            ["spec.csi"],
        ),
        # A PV's capacity may change.
        (
            _obj("PersistentVolume", spec={"capacity": {"storage": "1200Gi"}}),
            _obj("PersistentVolume", spec={"capacity": {"storage": "4800Gi"}}),
            [],
        ),
        # A claim of a class may grow (validation; resizing is then up to its class), never
        # shrink, and nothing else of its spec may change...
        (
            _obj("PersistentVolumeClaim", spec={**_SC, "resources": {"requests": _gib(1200)}}),
            _obj("PersistentVolumeClaim", spec={**_SC, "resources": {"requests": _gib(4800)}}),
            [],
        ),
        # ...and a static claim (no class, as the stack's FSx claim) is never resized.
        (
            _obj("PersistentVolumeClaim", spec={"resources": {"requests": _gib(1200)}}),
            _obj("PersistentVolumeClaim", spec={"resources": {"requests": _gib(4800)}}),
            ["spec.resources.requests.storage"],
        ),
        (
            _obj("PersistentVolume", spec={"nodeAffinity": {"required": {"a": 1}}}),
            _obj("PersistentVolume", spec={"nodeAffinity": {"required": {"a": 2}}}),
            ["spec.nodeAffinity"],
        ),
        (
            _obj("PersistentVolume", spec={}),
            _obj("PersistentVolume", spec={"nodeAffinity": {"required": {"a": 2}}}),
            [],
        ),
        (
            _obj("PersistentVolumeClaim", spec={**_SC, "resources": {"requests": _gib(4916)}}),
            _obj("PersistentVolumeClaim", spec={**_SC, "resources": {"requests": _gib(4800)}}),
            ["spec.resources.requests.storage"],
        ),
        (
            _obj("PersistentVolumeClaim", spec={"accessModes": ["ReadWriteMany"]}),
            _obj("PersistentVolumeClaim", spec={"accessModes": ["ReadWriteOnce"]}),
            ["spec"],
        ),
        (
            _obj("StorageClass", provisioner="fsx.csi.aws.com", parameters={"a": "1"}),
            _obj("StorageClass", provisioner="fsx.csi.aws.com", parameters={"a": "2"}),
            ["parameters"],
        ),
        (
            _obj("ClusterRoleBinding", roleRef={"kind": "ClusterRole", "name": "a"}),
            _obj("ClusterRoleBinding", roleRef={"kind": "ClusterRole", "name": "b"}),
            ["roleRef"],
        ),
        (_obj("ConfigMap", data={"a": "1"}), _obj("ConfigMap", data={"a": "2"}), []),
        (
            _obj("ConfigMap", immutable=True, data={"a": "1"}),
            _obj("ConfigMap", immutable=True, data={"a": "2"}),
            ["data"],
        ),
        (
            _obj("ValidatingAdmissionPolicy", spec={"validations": [{"expression": "true"}]}),
            _obj("ValidatingAdmissionPolicy", spec={"validations": [{"expression": "false"}]}),
            [],
        ),
    ],
)
def test_the_table(old: dict, new: dict, fields: list[str]) -> None:
    reasons = k8s_immutable.changed_immutable_fields(old, new)
    assert [r.removesuffix(" is immutable") for r in reasons[:-1]] == fields
    if fields:
        kind = new["kind"].lower()
        assert reasons[-1].endswith(f"kubectl delete {kind} x -n training")


def test_a_claim_is_deleted_after_the_job_that_mounts_it() -> None:
    """A claim a pod uses stays Terminating until the pod is gone (the kubernetes.io/pvc-protection
    finalizer): the message says to stop the Job first."""
    old = _obj("PersistentVolumeClaim", spec={"accessModes": ["ReadWriteMany"]})
    new = _obj("PersistentVolumeClaim", spec={"accessModes": ["ReadWriteOnce"]})
    last = k8s_immutable.changed_immutable_fields(old, new)[-1]
    assert "pvc-protection" in last and "make eks-stop" in last
    assert last.index("stop the Job") < last.index("kubectl delete persistentvolumeclaim x")


def test_the_fsx_claim_of_another_size_names_both_deletes(default_template: dict[str, Any]) -> None:
    """G15: a stack first deployed with a 1200 GiB claim meets today's fixed 4800Gi: refused,
    with the two deletes that make it deployable (the data stays on FSx: reclaim Retain)."""
    before = copy.deepcopy(default_template)
    for resource in before["Resources"].values():
        if resource["Type"] == replacements.MANIFEST_TYPE:
            text = json.dumps(resource["Properties"]).replace('"4800Gi', '"1200Gi')
            resource["Properties"] = json.loads(text)
    changes = replacements.diff(before, default_template, region=REGION)
    (claim,) = [c for c in changes if c.type == "PersistentVolumeClaim"]
    assert claim.action == "replace"
    assert claim.reasons[-1].endswith(
        "kubectl delete persistentvolumeclaim fsx-claim -n training"
        " && kubectl delete persistentvolume fsdp-fsx"
    )
    (volume,) = [c for c in changes if c.type == "PersistentVolume"]
    assert volume.action == "update"  # its capacity may change
