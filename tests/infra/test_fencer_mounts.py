"""A node whose FSx for Lustre mount fails ends as every other bad node does (infra/fencer): a
trainer pod bound to it stays ``Pending`` (``ContainerCreating``) while the kubelet retries the
mount for as long as the pod exists, so nothing else would ever end it. Past
``FENCER.lustre_mount_s`` the fencer marks the node unfit with the product's own cordon body
(``ops.cordon.cordon_patch(LUSTRE_MOUNT)``), evicts the pod (the Job's replacement lands on a
spare) and, once the node is empty, terminates its instance (graceful: the node answers) and
taints it out of service. A silent node's fence, by contrast, skips the OS shutdown.

Emulated here: the Kubernetes API (the JSON the API server returns for Nodes, Pods and the
kubelet's ``FailedMount`` Events, filtered on the fencer's field selectors) and EC2 (moto in
server mode, the real Query API; it enforces no IAM). What cannot run here: a real kubelet and
FSx CSI node plugin failing a mount; the event text follows the kubelet's (pkg/kubelet
``syncPod``: "Unable to attach or mount volumes: unmounted volumes=[...]";
pkg/volume/util/operationexecutor: "MountVolume.SetUp failed for volume ...").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from infra.fencer.controller import FAILED_MOUNTS, PENDING_PODS, RUNNING_PODS, Fencer
from infra.fencer.decide import FailedMount, FencePolicy, NodeView, decide
from infra.fencer.ec2 import Ec2
from infra.fencer.settings import FENCER
from ops.cordon import LUSTRE_MOUNT, UNFIT_LABEL, cordon_patch
from podsim import ec2 as fencing

NOW = 1_000_000.0
POLICY = FencePolicy(
    wait_s=FENCER.wait_s,
    max_in_flight=1,
    max_bad_fraction=FENCER.max_bad_fraction,
    mount_timeout_s=FENCER.lustre_mount_s,
)


def _stamp(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).isoformat().replace("+00:00", "Z")


def _nodes(count: int) -> list[NodeView]:
    return [
        NodeView(
            name=f"n{i}", instance_id=f"i-{i}", ready="True", ready_since=0.0, out_of_service=False
        )
        for i in range(count)
    ]


def test_a_failed_mount_ends_its_node_only_past_the_timeout() -> None:
    nodes = _nodes(10)
    early = FailedMount(namespace="t", pod="p", node="n3", failing_since=NOW - 599)
    assert decide(nodes, now=NOW, policy=POLICY, in_flight=0, mounts=[early]).unmountable == ()
    due = FailedMount(namespace="t", pod="p", node="n3", failing_since=NOW - 600)
    decision = decide(nodes, now=NOW, policy=POLICY, in_flight=0, mounts=[due])
    assert decision.unmountable == (due,) and decision.bad == 1 and decision.alert is None
    # A pod on a node of another group (or one already fenced) is not ours to end.
    elsewhere = FailedMount(namespace="t", pod="p", node="other", failing_since=NOW - 3600)
    assert decide(nodes, now=NOW, policy=POLICY, in_flight=0, mounts=[elsewhere]).unmountable == ()


def test_fsx_failing_everywhere_halts_instead_of_marking_the_group_unfit() -> None:
    """An FSx outage fails every node's mount: that is the file system, not the nodes. The
    failing nodes count as bad, so past max_bad_fraction nothing is marked and a person is
    alerted (the same halt as for silent nodes)."""
    nodes = _nodes(10)
    mounts = [
        FailedMount(namespace="t", pod=f"p{i}", node=f"n{i}", failing_since=NOW - 900)
        for i in range(3)
    ]
    decision = decide(nodes, now=NOW, policy=POLICY, in_flight=0, mounts=mounts)
    assert decision.unmountable == () and decision.fence == ()
    assert decision.alert and "failing to mount FSx" in decision.alert and "n2" in decision.alert


@dataclass
class _Api:
    """CoreV1Api's calls of the fencer over the JSON the API server returns, filtered on the
    fencer's own field selectors (kubernetes.io "Field Selectors": pods on ``status.phase``,
    events on ``involvedObject.kind`` and ``reason``)."""

    nodes: dict[str, dict]
    pods: dict[str, dict] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    patches: list[tuple[str, dict]] = field(default_factory=list)
    evictions: list[tuple[str, str, dict]] = field(default_factory=list)

    def list_node(self, *, label_selector: str, **kwargs: Any) -> SimpleNamespace:
        assert label_selector == fencing.SELECTOR and kwargs.get("_request_timeout")
        return SimpleNamespace(items=list(self.nodes.values()))

    def patch_node(self, name: str, body: dict, **kwargs: Any) -> dict:
        assert kwargs.get("_request_timeout")
        self.patches.append((name, body))
        node = self.nodes[name]
        node["spec"].update(body.get("spec", {}))
        node["metadata"].setdefault("labels", {}).update(body.get("metadata", {}).get("labels", {}))
        return node

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> SimpleNamespace:
        assert namespace == "training" and kwargs.get("_request_timeout")
        selector = kwargs["field_selector"]
        keep = {
            RUNNING_PODS: lambda phase: phase not in ("Succeeded", "Failed"),
            PENDING_PODS: lambda phase: phase == "Pending",
        }[selector]
        return SimpleNamespace(items=[p for p in self.pods.values() if keep(p["status"]["phase"])])

    def list_namespaced_event(self, namespace: str, **kwargs: Any) -> SimpleNamespace:
        assert namespace == "training" and kwargs.get("_request_timeout")
        assert kwargs["field_selector"] == FAILED_MOUNTS
        return SimpleNamespace(
            items=[
                e
                for e in self.events
                if e["involvedObject"]["kind"] == "Pod" and e["reason"] == "FailedMount"
            ]
        )

    def create_namespaced_pod_eviction(
        self, name: str, namespace: str, body: dict, **kwargs: Any
    ) -> dict:
        assert kwargs.get("_request_timeout")
        self.evictions.append((name, namespace, body))
        # The API server deletes the pod with the DisruptionTarget condition (reason
        # EvictionByEvictionAPI: kubernetes.io "Disruptions", *Pod disruption conditions*); the
        # kubelet then sets its terminal phase, Failed, since its containers never ran.
        pod = self.pods[name]
        pod["status"] = {
            "phase": "Failed",
            "conditions": [{"type": "DisruptionTarget", "status": "True"}],
        }
        return {}


def _node(name: str, iid: str) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"providerID": f"aws:///us-east-2a/{iid}"},
        "status": {
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": _stamp(0)}]
        },
    }


def _trainer(name: str, node: str, uid: str) -> dict:
    """A trainer pod as the Job makes it: the FSx claim (manifests/objects/job.py) beside
    volumes of no claim."""
    return {
        "metadata": {"name": name, "uid": uid},
        "spec": {
            "nodeName": node,
            "volumes": [
                {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        },
        "status": {"phase": "Pending"},
    }


def _failed_mount(pod: dict, *, first: float, message: str) -> dict:
    return {
        "metadata": {"name": f"{pod['metadata']['name']}.1"},
        "involvedObject": {
            "kind": "Pod",
            "name": pod["metadata"]["name"],
            "uid": pod["metadata"]["uid"],
        },
        "reason": "FailedMount",
        "type": "Warning",
        "message": message,
        "firstTimestamp": _stamp(first),
        "lastTimestamp": _stamp(first + 500),
        "count": 7,
    }


@dataclass(frozen=True, kw_only=True)
class _RecordingEc2(Ec2):
    """The real client, its requests noted (moto accepts ``SkipOsShutdown`` but keeps no
    trace of it)."""

    calls: list[tuple[str, dict]] = field(default_factory=list)

    def call(self, action: str, params: dict[str, str]):  # type: ignore[override]
        self.calls.append((action, dict(params)))
        return super().call(action, params)


@pytest.mark.requires(reason=fencing.moto_reason())
def test_a_pod_stuck_on_a_failed_lustre_mount_moves_and_its_node_is_replaced(
    tmp_path: Path,
) -> None:
    """Before the timeout nothing happens. Past it: the node gets the product's cordon body
    with reason ``lustre-mount`` and the pod is evicted; a pod whose failing volume is not the
    FSx claim (a ConfigMap, say) is left alone. Next pass: the node is unfit and empty, its
    instance terminated with a graceful shutdown (no SkipOsShutdown), then tainted out of
    service. A silent node is fenced with SkipOsShutdown."""
    with fencing.moto_server(tmp_path) as url, fencing.aws_environment(url):
        ec2 = _RecordingEc2(region=os.environ["AWS_REGION"])
        cloud = fencing.Cloud(plane=None, ec2=ec2)  # type: ignore[arg-type]
        bad_iid = cloud.instance("bad-mount")
        nodes = {f"n{i}": _node(f"n{i}", cloud.instance(f"n{i}")) for i in range(8)}
        nodes["bad-mount"] = _node("bad-mount", bad_iid)
        stuck = _trainer("fsdp-0-abc", "bad-mount", "uid-0")
        other = _trainer("fsdp-1-def", "n1", "uid-1")
        api = _Api(nodes=nodes, pods={"fsdp-0-abc": stuck, "fsdp-1-def": other})
        now = [NOW]
        api.events = [
            _failed_mount(
                stuck,
                first=NOW - FENCER.lustre_mount_s + 1,
                message='MountVolume.SetUp failed for volume "fsx" : rpc error: code = '
                "Internal desc = Could not mount ... lustre",
            ),
            _failed_mount(
                stuck,
                first=NOW - 100,
                message="Unable to attach or mount volumes: unmounted volumes=[fsx], "
                "unattached volumes=[fsx dshm kube-api-access-x]: timed out waiting for the "
                "condition",
            ),
            _failed_mount(
                other,
                first=NOW - 3600,
                message='MountVolume.SetUp failed for volume "config" : configmap "c" not found',
            ),
        ]
        fencer = Fencer(
            nodes=api,
            ec2=ec2,
            policy=POLICY,
            label_selector=fencing.SELECTOR,
            unfit_label=UNFIT_LABEL,
            namespaces=("training",),
            mount_cordon=cordon_patch(LUSTRE_MOUNT),
            clock=lambda: now[0],
        )
        fencer.reconcile()
        assert api.patches == [] and api.evictions == []
        now[0] += 1
        fencer.reconcile()
        assert api.patches == [("bad-mount", cordon_patch(LUSTRE_MOUNT))]
        assert [(n, ns) for n, ns, _ in api.evictions] == [("fsdp-0-abc", "training")]
        assert api.evictions[0][2]["kind"] == "Eviction"
        assert ec2.states([bad_iid]) == {bad_iid: "running"}  # its pod was still there
        fencer.reconcile()
        assert ec2.states([bad_iid]) == {bad_iid: "terminated"}
        assert api.patches[-1][0] == "bad-mount"
        assert (
            api.patches[-1][1]["spec"]["taints"][-1]["key"] == "node.kubernetes.io/out-of-service"
        )
        assert fencer.fenced == ["bad-mount"]
        (terminate,) = [p for a, p in ec2.calls if a == "TerminateInstances"]
        assert terminate == {"InstanceId.1": bad_iid}  # graceful: the node answers
        assert len(api.evictions) == 1  # the evicted pod is not evicted again

        # A silent node: fenced with SkipOsShutdown (its kernel would never finish a shutdown).
        silent_iid = cloud.instance("silent")
        nodes["silent"] = _node("silent", silent_iid)
        nodes["silent"]["status"]["conditions"] = [
            {"type": "Ready", "status": "Unknown", "lastTransitionTime": _stamp(now[0] - 60)}
        ]
        del nodes["bad-mount"]  # deleted once its instance was (cloud node lifecycle)
        fencer.reconcile()
        assert ec2.states([silent_iid]) == {silent_iid: "terminated"}
        *_, fence = [p for a, p in ec2.calls if a == "TerminateInstances"]
        assert fence == {"InstanceId.1": silent_iid, "SkipOsShutdown": "true"}
