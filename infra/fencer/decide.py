"""Which GPU nodes to end now: a pure function of the Nodes' state, the clock and the policy.

Two kinds of bad node end the same way (their instance terminated, then the out-of-service
taint; the node group launches a new instance, the next spare):
- *silent*: its ``Ready`` condition has been ``Unknown`` (the node lifecycle controller's
  verdict when the kubelet stops renewing its Lease: kubernetes.io "Nodes", *Node status* and
  *Heartbeats*) for ``wait_s`` since its ``lastTransitionTime``: fenced, its pods still bound;
- *unfit*: the product cordoned it (``spec.unschedulable`` and the ``ops.cordon.UNFIT_LABEL``
  label: a failed start-up check, ``NODE_UNFIT``, or a straggler eviction) and no pod of the
  training namespaces runs there any more (its work moved to a spare): replaced. A node a person
  cordoned carries no label and is never acted on; uncordoning a marked node keeps it too;
- *never joined*: an instance of the node group (EC2 tags) that has had no Node for
  ``join_timeout_s`` after its launch: its boot failed before the kubelet registered (the
  Lustre client set-up, infra/gpu_nodegroup.py ``LUSTRE_SCRIPT``, keeps a node out on purpose;
  a bad bootstrap does too). EKS marks the group degraded (``NodeCreationFailure``) but the
  Auto Scaling group's EC2 health check sees a running instance and keeps it, billed.
- *unmountable*: a training pod bound to the node stays ``Pending`` with kubelet ``FailedMount``
  events on its FSx for Lustre volume for ``mount_timeout_s`` (the kubelet retries a mount for
  as long as the pod exists; the container never starts, so the start-up check never runs):
  the node is marked unfit (``lustre-mount``) and the pod evicted; the Job replaces it on a
  spare, and the node, now unfit and empty, is replaced as above.
``Ready=False`` (a kubelet that answers and says it is unhealthy) is left to EKS node repair:
that node can still be drained. Both kinds share one pace and one halt:
- never more nodes ended and not yet gone than ``max_in_flight`` (the hot spares: each ended
  node's pods, or the pods that left it, hold a spare until its replacement joins); silent
  nodes first (their pods wait for the fence), then unfit ones;
- no fencing or replacing at all while more than ``max_bad_fraction`` of the group (and more
  than ``max_in_flight`` nodes) is bad (not Ready, or unfit): a
  partition of the control plane, an AZ event or a bad AMI looks like many dead nodes, and
  terminating them would make it worse (EKS node repair's own guard:
  ``MaxUnhealthyNodeThresholdPercentage``, node-repair.html). The fencer then raises an alert
  and waits for a person.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    join_timeout_s: float = math.inf
    """An instance with no Node this long after its launch never joined (inf: not looked at)."""
    mount_timeout_s: float = math.inf
    """A training pod failing to mount its FSx volume this long ends its node (inf: off)."""

    def __post_init__(self) -> None:
        if self.wait_s < 0:
            raise ValueError(f"wait_s: {self.wait_s} is negative; give seconds >= 0")
        if self.max_in_flight < 1:
            raise ValueError(
                f"max_in_flight: {self.max_in_flight}; give at least 1 (the spare count)"
            )
        if self.mount_timeout_s <= 0:
            raise ValueError(
                f"mount_timeout_s: {self.mount_timeout_s}; give seconds > 0 (kubelet mount retries)"
            )
        if self.join_timeout_s <= 0:
            raise ValueError(
                f"join_timeout_s: {self.join_timeout_s}; give seconds > 0 (a p5's boot and join)"
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
    unfit: str | None = None
    """The product's reason (``ops.cordon.UNFIT_LABEL``'s value) when the node carries the
    label *and* is cordoned (``spec.unschedulable``); None otherwise."""
    busy: bool = False
    """A pod of the training namespaces runs on it (phase neither Succeeded nor Failed)."""

    @property
    def bad(self) -> bool:
        """Counted against ``max_bad_fraction``: not Ready, or unfit, and not yet ended."""
        return not self.out_of_service and (self.ready != "True" or self.unfit is not None)


@dataclass(frozen=True, kw_only=True)
class Instance:
    """One live EC2 instance of the node group (DescribeInstances)."""

    instance_id: str
    state: str
    """``pending``, ``running`` or ``shutting-down``."""
    launched: float
    """``launchTime``, epoch seconds."""


@dataclass(frozen=True, kw_only=True)
class FailedMount:
    """A training pod bound to a node, ``Pending``, whose FSx volume the kubelet fails to mount."""

    namespace: str
    pod: str
    node: str
    failing_since: float
    """The first ``FailedMount`` event's time (epoch seconds)."""


@dataclass(frozen=True)
class Decision:
    fence: tuple[NodeView, ...]
    """Silent nodes to fence now."""
    alert: str | None
    """Set when fencing stopped itself: the reason, for a person."""
    replace: tuple[NodeView, ...] = ()
    """Unfit, empty nodes to replace now."""
    never_joined: tuple[Instance, ...] = ()
    """Instances that never became a Node, to terminate now."""
    bad: int = 0
    """Bad nodes seen (`NodeView.bad`, and instances that never joined)."""
    unmountable: tuple[FailedMount, ...] = ()
    """Pods whose mount failed past ``mount_timeout_s``: mark their node unfit, evict them."""


def instance_id(provider_id: str) -> str | None:
    """The EC2 instance id of ``spec.providerID`` (``aws:///us-east-2a/i-0123...``: the AWS
    cloud provider's format, kubernetes/cloud-provider-aws ``KubernetesInstanceID``)."""
    if not provider_id.startswith("aws://"):
        return None
    last = provider_id.rstrip("/").rsplit("/", 1)[-1]
    return last if last.startswith("i-") else None


def allowed_bad(*, size: int, max_bad_fraction: float, max_in_flight: int) -> int:
    """Bad nodes a group of `size` may have before ending any stops: `max_bad_fraction` of it,
    but never fewer than the spares (2 nodes + 1 spare: one lost node is a third of the group,
    the normal case, not an incident). EKS node repair's threshold derives from it
    (infra/cluster.py ``gpu_node_repair``), so the two never disagree on when to halt."""
    return max(math.floor(max_bad_fraction * size), max_in_flight)


def unjoined(
    nodes: Sequence[NodeView], instances: Sequence[Instance], *, now: float, policy: FencePolicy
) -> list[Instance]:
    """Running instances of the group with no Node for ``join_timeout_s`` since launch."""
    joined = {n.instance_id for n in nodes}
    return [
        i
        for i in instances
        if i.state in ("pending", "running")
        and i.instance_id not in joined
        and now - i.launched >= policy.join_timeout_s
    ]


def decide(
    nodes: list[NodeView],
    *,
    now: float,
    policy: FencePolicy,
    in_flight: int,
    instances: Sequence[Instance] = (),
    mounts: Sequence[FailedMount] = (),
) -> Decision:
    """The nodes to end now: silent ones (oldest silence first), then unfit, empty ones (by
    name), then instances that never joined (oldest first). `in_flight`: nodes ended whose Node
    object is still there, and instances ended that EC2 still shows shutting down (their
    replacement has not joined yet). `instances`: the group's live instances (empty: the
    never-joined check is off). `mounts`: training pods failing to mount their FSx volume; a
    node with one past ``mount_timeout_s`` counts as bad, so an FSx outage (every node failing)
    halts instead of marking the whole group unfit."""
    lost = sorted(unjoined(nodes, instances, now=now, policy=policy), key=lambda i: i.launched)
    if not nodes and not lost:
        return Decision(fence=(), alert=None)
    bad = [n for n in nodes if n.bad]
    members = {n.name for n in nodes if not n.out_of_service}
    stuck = sorted(
        (
            m
            for m in mounts
            if m.node in members and now - m.failing_since >= policy.mount_timeout_s
        ),
        key=lambda m: (m.failing_since, m.pod),
    )
    bad_names = {n.name for n in bad}
    size = len(nodes) + len(lost)
    bad_count = len(bad) + len(lost) + len({m.node for m in stuck} - bad_names)
    allowed = allowed_bad(
        size=size, max_bad_fraction=policy.max_bad_fraction, max_in_flight=policy.max_in_flight
    )
    if bad_count > allowed:
        names = ", ".join(
            [
                *sorted(bad_names | {m.node for m in stuck}),
                *(i.instance_id for i in lost),
            ]
        )
        return Decision(
            fence=(),
            alert=(
                f"{bad_count} of {size} GPU nodes are bad (not Ready, unfit, failing to mount "
                f"FSx or never joined: "
                f"{names}), more than max_bad_fraction={policy.max_bad_fraction}: fencing and "
                "replacing stopped; look at the cluster (a control-plane partition, an AZ event "
                "or a bad AMI looks like this)"
            ),
            bad=bad_count,
        )
    due = sorted(
        (
            n
            for n in bad
            if n.ready == "Unknown" and n.instance_id and now - n.ready_since >= policy.wait_s
        ),
        key=lambda n: n.ready_since,
    )
    silent = {n.name for n in due}
    empty = sorted(
        (n for n in bad if n.unfit and not n.busy and n.instance_id and n.name not in silent),
        key=lambda n: n.name,
    )
    room = max(policy.max_in_flight - in_flight, 0)
    fence = tuple(due[:room])
    room -= len(fence)
    replace = tuple(empty[:room])
    room -= len(replace)
    return Decision(
        fence=fence,
        alert=None,
        replace=replace,
        never_joined=tuple(lost[:room]),
        bad=bad_count,
        # Not paced: marking a node and evicting its pod ends no node (the pod was never
        # running); the node's replacement then takes the unfit path and its pace.
        unmountable=tuple(stuck),
    )
