"""One pass of the fencer over the GPU nodes: read them, fence what `decide` says, and mark a
node out of service only once EC2 reports its instance terminated.

The order is the point: the out-of-service taint makes PodGC fail the node's pods at once, and
the Job then starts their replacements, which must never run beside an old incarnation that
still writes (kubernetes.io "Node Shutdowns", *Non-graceful node shutdown*: the taint is for a
node "already in shutdown or power off state"). A terminated instance cannot write again; the
node group then launches a new instance, which joins as the new spare.

Kubernetes calls: ``list_node`` (label selector: this node group) and ``patch_node`` (the taint)
of ``kubernetes.client.CoreV1Api``; the fencer's RBAC allows only get/list/watch/patch on Nodes
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

API_TIMEOUT_S = 10.0
"""One Kubernetes request's connect + read timeout (the client's default is none): a hung call
would stop the loop for good, and the next pass retries anyway (as ``ops/cordon.py``'s)."""


class NodeApi(Protocol):
    def list_node(self, **kwargs: Any) -> Any: ...

    def patch_node(self, name: str, body: Any, **kwargs: Any) -> Any: ...


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


def view(node: Any) -> NodeView:
    """The fencer's reading of one Node (a client model or the API's JSON)."""
    ready = next(
        (c for c in _get(node, "status", "conditions") or [] if _get(c, "type") == "Ready"),
        None,
    )
    taints = _get(node, "spec", "taints") or []
    return NodeView(
        name=_get(node, "metadata", "name"),
        instance_id=instance_id(
            _get(node, "spec", "provider_id") or _get(node, "spec", "providerID") or ""
        ),
        ready=_get(ready, "status") or "Unknown",
        ready_since=_epoch(
            _get(ready, "last_transition_time") or _get(ready, "lastTransitionTime")
        ),
        out_of_service=any(_get(t, "key") == OUT_OF_SERVICE_TAINT["key"] for t in taints),
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
    clock: Callable[[], float] = time.time
    terminating: dict[str, str] = field(default_factory=dict)
    """Node name -> instance id: terminated by us, not yet marked out of service."""
    alert: str | None = None
    fenced: list[str] = field(default_factory=list)
    """Every node this fencer marked out of service, in order."""

    def reconcile(self) -> None:
        items = self.nodes.list_node(
            label_selector=self.label_selector, _request_timeout=API_TIMEOUT_S
        ).items
        raw = {_get(n, "metadata", "name"): n for n in items}
        views = [view(n) for n in items]
        # Gone from the API (deleted once its instance was): nothing left to mark.
        self.terminating = {k: v for k, v in self.terminating.items() if k in raw}
        self._mark_terminated(raw)
        in_flight = sum(v.out_of_service for v in views) + len(self.terminating)
        decision = decide(views, now=self.clock(), policy=self.policy, in_flight=in_flight)
        if decision.alert != self.alert:
            if decision.alert:
                log("FencingHalted", reason=decision.alert)
            else:
                log("FencingResumed")
            self.alert = decision.alert
        for node in decision.fence:
            if node.name in self.terminating:
                continue
            assert node.instance_id is not None  # decide() fences only nodes with one
            state = self.ec2.terminate(node.instance_id)
            log(
                "Terminated",
                node=node.name,
                instance=node.instance_id,
                state=state,
                silent_s=round(self.clock() - node.ready_since, 1),
            )
            self.terminating[node.name] = node.instance_id
        self._mark_terminated(raw)

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
