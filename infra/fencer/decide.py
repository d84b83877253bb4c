"""Which GPU nodes to fence now: a pure function of the Nodes' state, the clock and the policy.

A node is a candidate once its ``Ready`` condition has been ``Unknown`` (the node lifecycle
controller's verdict when the kubelet stops renewing its Lease: kubernetes.io "Nodes", *Node
status* and *Heartbeats*) for ``wait_s`` since its ``lastTransitionTime``. ``Ready=False`` (a
kubelet that answers and says it is unhealthy) is left to EKS node repair: that node can still
be drained. Fencing is paced and can stop itself:
- never more nodes fenced and not yet gone than ``max_in_flight`` (the hot spares: each fenced
  node's pods need a spare to land on at once);
- no fencing at all while more than ``max_bad_fraction`` of the group (and more than
  ``max_in_flight`` nodes) is not Ready: a
  partition of the control plane, an AZ event or a bad AMI looks like many dead nodes, and
  terminating them would make it worse (EKS node repair's own guard:
  ``MaxUnhealthyNodeThresholdPercentage``, node-repair.html). The fencer then raises an alert
  and waits for a person.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

OUT_OF_SERVICE_TAINT = {
    "key": "node.kubernetes.io/out-of-service",
    "value": "nodeshutdown",
    "effect": "NoExecute",
}
"""The taint of Kubernetes' non-graceful node shutdown (kubernetes.io "Node Shutdowns",
*Non-graceful node shutdown*: applied "after the user has verified the node is already in
shutdown or power off state"; PodGC then force-deletes its terminating pods, marked Failed,
``gcTerminating`` in pkg/controller/podgc/gc_controller.go). The value is the doc's example."""


@dataclass(frozen=True, kw_only=True)
class FencePolicy:
    wait_s: float
    """How long ``Ready`` stays ``Unknown`` before the node is fenced."""
    max_in_flight: int
    """Nodes fenced at once, at most: the spares that absorb their pods."""
    max_bad_fraction: float
    """Above this share of the group not Ready, fence nothing and alert."""

    def __post_init__(self) -> None:
        if self.wait_s < 0:
            raise ValueError(f"wait_s: {self.wait_s} is negative; give seconds >= 0")
        if self.max_in_flight < 1:
            raise ValueError(
                f"max_in_flight: {self.max_in_flight}; give at least 1 (the spare count)"
            )
        if not 0 < self.max_bad_fraction <= 1:
            raise ValueError(
                f"max_bad_fraction: {self.max_bad_fraction}; give a share in (0, 1], e.g. 0.2"
            )


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """What the fencer reads of one Node."""

    name: str
    instance_id: str | None
    """From ``spec.providerID`` (``aws:///<zone>/<instance id>``); None when it has none."""
    ready: str
    """The ``Ready`` condition's status: "True", "False" or "Unknown"."""
    ready_since: float
    """Its ``lastTransitionTime`` (epoch seconds)."""
    out_of_service: bool
    """Already carries the out-of-service taint (fenced)."""


@dataclass(frozen=True)
class Decision:
    fence: tuple[NodeView, ...]
    alert: str | None
    """Set when fencing stopped itself: the reason, for a person."""


def instance_id(provider_id: str) -> str | None:
    """The EC2 instance id of ``spec.providerID`` (``aws:///us-east-2a/i-0123...``: the AWS
    cloud provider's format, kubernetes/cloud-provider-aws ``KubernetesInstanceID``)."""
    if not provider_id.startswith("aws://"):
        return None
    last = provider_id.rstrip("/").rsplit("/", 1)[-1]
    return last if last.startswith("i-") else None


def decide(nodes: list[NodeView], *, now: float, policy: FencePolicy, in_flight: int) -> Decision:
    """The nodes to fence now (oldest silence first). `in_flight`: nodes fenced whose Node
    object is still there (their pods may not have moved yet)."""
    if not nodes:
        return Decision(fence=(), alert=None)
    bad = [n for n in nodes if n.ready != "True" and not n.out_of_service]
    # A small group may always lose as many nodes as it has spares (2 nodes + 1 spare: one
    # lost node is a third of the group, the normal case, not an incident).
    allowed_bad = max(math.floor(policy.max_bad_fraction * len(nodes)), policy.max_in_flight)
    if len(bad) > allowed_bad:
        names = ", ".join(sorted(n.name for n in bad))
        return Decision(
            fence=(),
            alert=(
                f"{len(bad)} of {len(nodes)} GPU nodes are not Ready ({names}), more than "
                f"max_bad_fraction={policy.max_bad_fraction}: fencing stopped; look at the "
                "cluster (a control-plane partition, an AZ event or a bad AMI looks like this)"
            ),
        )
    due = sorted(
        (
            n
            for n in bad
            if n.ready == "Unknown" and n.instance_id and now - n.ready_since >= policy.wait_s
        ),
        key=lambda n: n.ready_since,
    )
    room = max(policy.max_in_flight - in_flight, 0)
    return Decision(fence=tuple(due[:room]), alert=None)
