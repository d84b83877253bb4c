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

Kubernetes calls: ``list_node`` (label selector: this node group) and ``patch_node`` (the taint)
of ``kubernetes.client.CoreV1Api``, and ``list_namespaced_pod`` in each training namespace
(field selector ``status.phase!=Succeeded,status.phase!=Failed``: kubernetes.io "Field
Selectors", which pods support on ``status.phase``), only while some node is unfit. The
fencer's RBAC allows only get/list/watch/patch on Nodes and list on pods of those namespaces
(infra/node_fencer.py).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from infra.fencer.decide import (
    OUT_OF_SERVICE_TAINT,
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


RUNNING_PODS = "status.phase!=Succeeded,status.phase!=Failed"
"""Pods that still run or will (Pending, Running, Unknown): kubernetes.io "Field Selectors"."""


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
        decision = decide(
            views, now=self.clock(), policy=self.policy, in_flight=in_flight, instances=instances
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
            self._terminate(node, "Terminated", silent_s=round(self.clock() - node.ready_since, 1))
        for node in decision.replace:
            self._terminate(node, "Replaced", reason=node.unfit)
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

    def _terminate(self, node: NodeView, event: str, **fields: Any) -> None:
        if node.name in self.terminating:
            return
        assert node.instance_id is not None  # decide() ends only nodes with one
        state = self.ec2.terminate(node.instance_id)
        log(event, node=node.name, instance=node.instance_id, state=state, **fields)
        self.metrics.ended(kind="fenced" if event == "Terminated" else "replaced")
        self.terminating[node.name] = node.instance_id

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
