"""One pass of the fencer over the GPU nodes: read them, end what `decide` says (fence a silent
node, replace an unfit, empty one: both by terminating its instance), and mark a node out of
service only once EC2 reports its instance terminated.

The order is the point: the out-of-service taint makes PodGC fail the node's pods at once, and
the Job then starts their replacements, which must never run beside an old incarnation that
still writes (kubernetes.io "Node Shutdowns", *Non-graceful node shutdown*: the taint is for a
node "already in shutdown or power off state"). A terminated instance cannot write again; the
node group then launches a new instance, which joins as the new spare.

An unfit node (cordoned by the product: ``ops.cordon``) goes the same way once no pod of the
training namespaces runs on it: its pods left it already (the trainer pod exited ``NODE_UNFIT``
and the Job replaced it elsewhere), so the taint only clears what else was bound there
(DaemonSet pods); the node group launches a new instance, the next spare (EKS User Guide,
"Managed node groups": the Auto Scaling group keeps the desired size).

A training pod that never starts because its FSx for Lustre volume does not mount on its node
(kubelet ``FailedMount`` events; the kubelet retries for as long as the pod exists, so nothing
else ends it) goes the same way: past ``mount_timeout_s`` the node gets the product's cordon
(``ops.cordon.cordon_patch``, reason ``lustre-mount``) and the pod is evicted (the Eviction API
adds ``DisruptionTarget``, which the Job's ``podFailurePolicy`` Ignores: kubernetes.io
"Disruptions", *Pod disruption conditions*), so the Job's replacement lands on a spare and the
node, unfit and empty, is replaced.

Kubernetes calls: ``list_node`` (label selector: this node group) and ``patch_node`` (the taint;
the ``lustre-mount`` cordon) of ``kubernetes.client.CoreV1Api``; in each training namespace
``list_namespaced_pod`` (field selector ``status.phase!=Succeeded,status.phase!=Failed`` only
while some node is unfit; ``status.phase=Pending`` only while a ``FailedMount`` event exists:
kubernetes.io "Field Selectors"), ``list_namespaced_event`` (field selector
``involvedObject.kind=Pod,reason=FailedMount``: the fields core/v1 Events select on) and
``create_namespaced_pod_eviction``. The fencer's RBAC allows only get/list/watch/patch on
Nodes, and list on pods and events and create on pods/eviction in those namespaces
(infra/node_fencer.py).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from infra.fencer.decide import (
    OUT_OF_SERVICE_TAINT,
    FailedMount,
    FencePolicy,
    NodeView,
    decide,
    instance_id,
)
from infra.fencer.ec2 import GONE, Ec2
from infra.fencer.metrics import FencerMetrics

API_TIMEOUT_S = 10.0
"""One Kubernetes request's connect + read timeout (the client's default is none): a hung call
would stop the loop for good, and the next pass retries anyway (as ``ops/cordon.py``'s)."""


class NodeApi(Protocol):
    def list_node(self, **kwargs: Any) -> Any: ...

    def patch_node(self, name: str, body: Any, **kwargs: Any) -> Any: ...

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> Any: ...

    def list_namespaced_event(self, namespace: str, **kwargs: Any) -> Any: ...

    def create_namespaced_pod_eviction(
        self, name: str, namespace: str, body: Any, **kwargs: Any
    ) -> Any: ...


RUNNING_PODS = "status.phase!=Succeeded,status.phase!=Failed"
"""Pods that still run or will (Pending, Running, Unknown): kubernetes.io "Field Selectors"."""
PENDING_PODS = "status.phase=Pending"
FAILED_MOUNTS = "involvedObject.kind=Pod,reason=FailedMount"
"""The kubelet's mount failures (reason ``FailedMount``, kubernetes pkg/kubelet/events)."""
UNMOUNTED = re.compile(r"unmounted volumes=\[([^\]]*)\]")
"""The kubelet's summary after its wait for a pod's volumes ends (pkg/kubelet, ``syncPod``:
"Unable to attach or mount volumes: unmounted volumes=[fsx], unattached volumes=[...]: ...")."""
FAILED_VOLUME = re.compile(r'for volume "([^"]*)"')
"""``MountVolume.SetUp failed for volume "fsx" : ...`` (pkg/volume/util/operationexecutor)."""


def _get(obj: Any, *path: str) -> Any:
    """A field of a client model or of a plain dict (the API's JSON), None when absent."""
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
    return obj


def _epoch(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str):
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return float(value or 0.0)


def _taint_dict(taint: Any) -> dict[str, str]:
    return {k: v for k in ("key", "value", "effect") if (v := _get(taint, k)) is not None}


def view(node: Any, *, unfit_label: str = "", busy: frozenset[str] = frozenset()) -> NodeView:
    """The fencer's reading of one Node (a client model or the API's JSON). `unfit_label`: the
    product's label (``ops.cordon.UNFIT_LABEL``); `busy`: nodes a training pod runs on."""
    ready = next(
        (c for c in _get(node, "status", "conditions") or [] if _get(c, "type") == "Ready"),
        None,
    )
    taints = _get(node, "spec", "taints") or []
    name = _get(node, "metadata", "name")
    reason = (_get(node, "metadata", "labels") or {}).get(unfit_label) if unfit_label else None
    cordoned = bool(_get(node, "spec", "unschedulable"))
    return NodeView(
        name=name,
        instance_id=instance_id(
            _get(node, "spec", "provider_id") or _get(node, "spec", "providerID") or ""
        ),
        ready=_get(ready, "status") or "Unknown",
        ready_since=_epoch(
            _get(ready, "last_transition_time") or _get(ready, "lastTransitionTime")
        ),
        out_of_service=any(_get(t, "key") == OUT_OF_SERVICE_TAINT["key"] for t in taints),
        unfit=reason if reason and cordoned else None,
        busy=name in busy,
    )


def _event_time(event: Any) -> float:
    """When the kubelet first reported it: ``firstTimestamp`` (the kubelet's legacy event
    recorder sets it and keeps it as it counts repeats), else ``eventTime``."""
    for path in (("first_timestamp",), ("firstTimestamp",), ("event_time",), ("eventTime",)):
        if (value := _get(event, *path)) is not None:
            return _epoch(value)
    return _epoch(
        _get(event, "metadata", "creation_timestamp")
        or _get(event, "metadata", "creationTimestamp")
    )


def _volumes_named(message: str) -> set[str]:
    """The pod volume names a ``FailedMount`` message names."""
    names = set(FAILED_VOLUME.findall(message))
    for group in UNMOUNTED.findall(message):
        names |= set(group.split())
    return names


def log(event: str, **fields: Any) -> None:
    """One JSON line on stderr (the container log; the alert rule matches `event`)."""
    print(json.dumps({"fencer": event, **fields}, sort_keys=True), file=sys.stderr, flush=True)


@dataclass
class Fencer:
    nodes: NodeApi
    ec2: Ec2
    policy: FencePolicy
    label_selector: str
    """This node group's Nodes (``eks.amazonaws.com/nodegroup=<name>``)."""
    unfit_label: str = ""
    """The product's unfit label (``ops.cordon.UNFIT_LABEL``); empty: unfit nodes are not
    replaced."""
    namespaces: tuple[str, ...] = ()
    """The training namespaces: a node with a running pod of theirs is not replaced."""
    mount_cordon: dict[str, Any] = field(default_factory=dict)
    """The request body that marks a node unfit for ``lustre-mount``: ``ops.cordon.cordon_patch``'s,
    handed over by the Deployment (``FENCE_MOUNT_CORDON``; the image carries infra/fencer
    alone); empty: pods failing to mount are not looked for."""
    cluster_name: str = ""
    nodegroup_name: str = ""
    """The EC2 tags of the group's instances (``eks:cluster-name``, ``eks:nodegroup-name``);
    empty: instances that never joined are not looked for."""
    metrics: FencerMetrics = field(default_factory=FencerMetrics)
    clock: Callable[[], float] = time.time
    terminating: dict[str, str] = field(default_factory=dict)
    """Node name -> instance id: terminated by us, not yet marked out of service."""
    alert: str | None = None
    fenced: list[str] = field(default_factory=list)
    """Every node this fencer marked out of service, in order."""

    def __post_init__(self) -> None:
        if self.unfit_label and not self.namespaces:
            # Without them every unfit node would look empty, its training pod included.
            raise ValueError("namespaces: none given beside unfit_label; name the training ones")

    def reconcile(self) -> None:
        items = self.nodes.list_node(
            label_selector=self.label_selector, _request_timeout=API_TIMEOUT_S
        ).items
        raw = {_get(n, "metadata", "name"): n for n in items}
        views = [view(n, unfit_label=self.unfit_label) for n in items]
        if any(v.unfit for v in views):  # only then: one pod list per training namespace
            busy = self._busy_nodes()
            views = [view(n, unfit_label=self.unfit_label, busy=busy) for n in items]
        # Gone from the API (deleted once its instance was): nothing left to mark.
        self.terminating = {k: v for k, v in self.terminating.items() if k in raw}
        self._mark_terminated(raw)
        instances = (
            self.ec2.group_instances(cluster=self.cluster_name, nodegroup=self.nodegroup_name)
            if self.cluster_name and self.nodegroup_name
            else []
        )
        joined = {v.instance_id for v in views}
        leaving = sum(i.state == "shutting-down" and i.instance_id not in joined for i in instances)
        in_flight = sum(v.out_of_service for v in views) + len(self.terminating) + leaving
        watch_mounts = self.mount_cordon and math.isfinite(self.policy.mount_timeout_s)
        mounts = self._failed_mounts() if watch_mounts else []
        decision = decide(
            views,
            now=self.clock(),
            policy=self.policy,
            in_flight=in_flight,
            instances=instances,
            mounts=mounts,
        )
        self.metrics.observe(
            nodes=len(views), bad=decision.bad, in_flight=in_flight, halted=bool(decision.alert)
        )
        if decision.alert != self.alert:
            if decision.alert:
                log("FencingHalted", reason=decision.alert)
            else:
                log("FencingResumed")
            self.alert = decision.alert
        for node in decision.fence:
            self._terminate(
                node,
                "Terminated",
                skip_os_shutdown=True,
                silent_s=round(self.clock() - node.ready_since, 1),
            )
        for node in decision.replace:
            self._terminate(node, "Replaced", reason=node.unfit)
        for mount in decision.unmountable:
            self._end_unmountable(mount)
        for instance in decision.never_joined:
            # No Node to mark: the instance is all there is.
            state = self.ec2.terminate(instance.instance_id)
            log(
                "NeverJoined",
                instance=instance.instance_id,
                state=state,
                launched_s=round(self.clock() - instance.launched, 1),
            )
            self.metrics.ended(kind="unjoined")
        self._mark_terminated(raw)

    def _terminate(
        self, node: NodeView, event: str, *, skip_os_shutdown: bool = False, **fields: Any
    ) -> None:
        if node.name in self.terminating:
            return
        assert node.instance_id is not None  # decide() ends only nodes with one
        state = self.ec2.terminate(node.instance_id, skip_os_shutdown=skip_os_shutdown)
        log(event, node=node.name, instance=node.instance_id, state=state, **fields)
        self.metrics.ended(kind="fenced" if event == "Terminated" else "replaced")
        self.terminating[node.name] = node.instance_id

    def _failed_mounts(self) -> list[FailedMount]:
        """Pending training pods, bound to a node and not being deleted, with ``FailedMount``
        events on a volume backed by a PersistentVolumeClaim (the trainer pod's one claim is
        the FSx for Lustre one: manifests/objects/job.py); since the first such event."""
        found = []
        for namespace in self.namespaces:
            events = self.nodes.list_namespaced_event(
                namespace, field_selector=FAILED_MOUNTS, _request_timeout=API_TIMEOUT_S
            ).items
            if not events:
                continue
            pods = self.nodes.list_namespaced_pod(
                namespace, field_selector=PENDING_PODS, _request_timeout=API_TIMEOUT_S
            ).items
            for pod in pods:
                node = _get(pod, "spec", "node_name") or _get(pod, "spec", "nodeName")
                if (
                    not node
                    or _get(pod, "metadata", "deletion_timestamp")
                    or _get(pod, "metadata", "deletionTimestamp")
                ):
                    continue
                claims = {
                    _get(v, "name")
                    for v in _get(pod, "spec", "volumes") or []
                    if _get(v, "persistent_volume_claim") or _get(v, "persistentVolumeClaim")
                }
                uid = _get(pod, "metadata", "uid")
                times = [
                    _event_time(e)
                    for e in events
                    if _get(e, "involved_object", "uid") == uid
                    or _get(e, "involvedObject", "uid") == uid
                    if claims & _volumes_named(_get(e, "message") or "")
                ]
                if times:
                    found.append(
                        FailedMount(
                            namespace=namespace,
                            pod=_get(pod, "metadata", "name"),
                            node=node,
                            failing_since=min(times),
                        )
                    )
        return found

    def _end_unmountable(self, mount: FailedMount) -> None:
        """Mark its node unfit (the product's own cordon body), then evict the pod."""
        self.nodes.patch_node(mount.node, self.mount_cordon, _request_timeout=API_TIMEOUT_S)
        self.nodes.create_namespaced_pod_eviction(
            mount.pod,
            mount.namespace,
            {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": mount.pod, "namespace": mount.namespace},
            },
            _request_timeout=API_TIMEOUT_S,
        )
        log(
            "LustreMountFailed",
            node=mount.node,
            pod=f"{mount.namespace}/{mount.pod}",
            failing_s=round(self.clock() - mount.failing_since, 1),
        )

    def _busy_nodes(self) -> frozenset[str]:
        """Nodes a pod of the training namespaces runs on (or is bound to and will)."""
        busy = set()
        for namespace in self.namespaces:
            pods = self.nodes.list_namespaced_pod(
                namespace, field_selector=RUNNING_PODS, _request_timeout=API_TIMEOUT_S
            )
            busy |= {
                n
                for p in pods.items
                if (n := _get(p, "spec", "node_name") or _get(p, "spec", "nodeName"))
            }
        return frozenset(busy)

    def _mark_terminated(self, raw: dict[str, Any]) -> None:
        """Taint the nodes whose instance EC2 now reports terminated."""
        if not self.terminating:
            return
        states = self.ec2.states(list(self.terminating.values()))
        for name, iid in list(self.terminating.items()):
            # An id EC2 no longer lists is long terminated (it keeps them about an hour).
            if states.get(iid, "terminated") not in GONE:
                continue
            taints = [_taint_dict(t) for t in _get(raw[name], "spec", "taints") or []]
            self.nodes.patch_node(
                name,
                {"spec": {"taints": [*taints, OUT_OF_SERVICE_TAINT]}},
                _request_timeout=API_TIMEOUT_S,
            )
            log("OutOfService", node=name, instance=iid)
            del self.terminating[name]
            self.fenced.append(name)
