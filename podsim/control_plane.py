"""The control plane's rules for nodes, emulated: scheduling onto nodes and hot spares, and what
happens to a pod whose node stops answering (docs/node-loss.md has the timeline and sources).

Emulated because no API server, scheduler or EKS repair service can run here. Each rule follows
its documentation or source, with the production durations scaled down by `SCALE`:
- the node lifecycle controller marks a silent node `Ready=Unknown` and taints it
  `node.kubernetes.io/unreachable:NoExecute` after the node-monitor grace period;
- the taint eviction controller deletes a pod that tolerates the taint for `tolerationSeconds`
  (the Job's own, `render.NODE_LOSS_TOLERATION_SECONDS`) once that has passed: the pod gets
  `DisruptionTarget` and stays Terminating, since no kubelet confirms anything;
- EKS node auto repair replaces the node after its wait for the `Ready` condition (the value
  this product asks infra to set, `NodeRepairConfigOverrides`; the default is 30 min):
  the instance is terminated, a new one launched;
- once the Node object is gone, PodGC marks the pod `Failed` (`DisruptionTarget`,
  `DeletionByPodGC`) after its 40 s quarantine and 20 s loop, and force-deletes it;
- only then does the Job controller replace it (`podReplacementPolicy: Failed`, the only value
  allowed with a `podFailurePolicy`: cluster.run_job);
- the scheduler places a pod on a free node that is not cordoned (`spec.unschedulable`: the
  NodeUnschedulable filter plugin, kubernetes.io "Scheduler Configuration"; `kubectl cordon`
  and "Safely Drain a Node"), a node whose pod ended being free again; else it preempts a
  spare's placeholder (priority below the trainers', grace 0: it is killed and the node is
  free at once; kubernetes.io, "Pod Priority and Preemption"), else leaves it Pending until
  the repaired node has booted, joined and pulled the image;
- the spares' Deployment replaces a preempted placeholder; the new one stays Pending until the
  repaired node joins and then lands there: the group is back at N + K spares.
The lost pod's processes are never killed by any of this: its node cannot be reached. They stay
frozen, cut off, until the test thaws them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from infra.fencer.settings import KUBE
from manifests import render
from podsim.cluster import Cluster, Node, Pod


@dataclass(frozen=True, kw_only=True)
class NodeLossTimes:
    """How long each step of a node loss takes, in seconds."""

    monitor_grace_s: float
    """Node-monitor grace period: 50 s (kube-controller-manager, 1.32+; 40 s before)."""
    toleration_s: float
    """The trainer pod's tolerationSeconds for the unreachable/not-ready taints."""
    repair_wait_s: float
    """EKS node auto repair's wait on a bad `Ready` condition: 60 s, the 1-minute
    `MinRepairWaitTimeMins` override asked of infra (default 30 min: node-repair.html)."""
    terminate_s: float
    """From the repair's action to the Node object's deletion: an estimate (EC2 terminates
    the instance; the node is deregistered). Only a real cluster can measure it."""
    podgc_s: float
    """PodGC: 40 s quarantine + up to 20 s until its next loop (pkg/controller/podgc)."""
    boot_and_pull_s: float
    """A new p5 boots, joins and pulls the 15-20 GB image: an estimate of 10 min."""
    podgc_loop_s: float = 20.0
    """PodGC's loop (`gcCheckPeriod`): a terminating pod on a node tainted out-of-service is
    force-deleted, marked Failed, at its next pass (`gcTerminating`), with no quarantine."""

    def scaled(self, factor: float) -> NodeLossTimes:
        return replace(self, **{f.name: getattr(self, f.name) * factor for f in fields(self)})


EKS = NodeLossTimes(
    monitor_grace_s=KUBE.node_monitor_grace_s,
    toleration_s=render.NODE_LOSS_TOLERATION_SECONDS,
    # The 1-minute `Ready` repair override docs/node-loss.md proposes. The stack does not set it
    # yet (whether EKS accepts `Ready` is unconfirmed): with EKS's default, 30 min, every
    # measured node-loss recovery here would take 58 s (29 min on EKS) longer.
    repair_wait_s=60,
    terminate_s=60,
    podgc_s=KUBE.podgc_quarantine_s + KUBE.podgc_loop_s,
    boot_and_pull_s=600,
    podgc_loop_s=KUBE.podgc_loop_s,
)
EKS_DEFAULT_REPAIR_WAIT_S = 30 * 60
"""EKS node auto repair's default wait on a bad `Ready` (node-repair.html): the fencer test keeps
it, so the fencer alone moves the pod."""
SCALE = 1 / 30
"""Emulated seconds per production second: 1 s here is 30 s on EKS."""


KUBELET_HOUSEKEEPING_S = 2.0
"""How soon a kubelet back on the network acts on a pod that is gone from the API server: its
housekeeping period (kubernetes pkg/kubelet/kubelet.go, `housekeepingPeriod`)."""
KUBELET_MIN_GRACE_S = 2.0
"""SIGTERM to SIGKILL for a pod force-deleted with grace 0: the runtime's floor (pkg/kubelet/
kuberuntime, `minimumGracePeriodInSeconds`)."""


@dataclass
class _Loss:
    node: Node
    pod: str
    process: subprocess.Popen
    """The lost pod's container main process."""
    at: float
    """time.time() of the loss."""
    reported: bool = False
    out_of_service_at: float | None = None
    """time.time() the fencer tainted the node out-of-service (infra/fencer), if it did."""


class ControlPlane:
    """`nodes` free nodes for the Job's pods and `spares` nodes held by placeholders running
    the spare Deployment's exact command (`render.spare_objects`)."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        nodes: int,
        spares: int,
        spare_command: list[str],
        times: NodeLossTimes,
        root: Path,
    ) -> None:
        self.cluster = cluster
        self.times = times
        self.root = root
        self.free = [cluster.add_node() for _ in range(nodes)]
        self.spare_command = spare_command
        self.spares: list[tuple[Node, subprocess.Popen]] = []
        for _ in range(spares):
            self._hold(cluster.add_node())
        self.joins: list[float] = []
        """time.time() at which a repaired (new) node has joined with the image pulled."""
        self.pods: dict[int, Pod] = {}
        self.losses: list[_Loss] = []
        self.preempted = 0
        """Placeholders preempted and not yet back: the Deployment's Pending replicas."""
        self.events: list[tuple[float, str]] = []
        self.cordoned: set[str] = set()
        self.unfit: dict[str, str] = {}
        """Node -> the product's reason (ops.cordon.UNFIT_LABEL's value), set with its cordon."""
        self.bound_at: dict[str, float] = {}
        self.deleted: set[str] = set()
        """Node objects deleted (their instance terminated)."""
        """Pod name -> time.time() the kubelet started its container (the latest start)."""
        self._lock = threading.Lock()
        self.started = time.time()

    def _event(self, what: str, at: float | None = None) -> None:
        self.events.append((time.time() if at is None else at, what))

    def _hold(self, node: Node) -> None:
        log = self.root / f"spare-{node.name}.log"
        self.spares.append((node, self.cluster.run_on_node(node, argv=self.spare_command, log=log)))

    # --- the scheduler ------------------------------------------------------------------------

    def cordon(self, node: str, reason: str = "") -> None:
        """`spec.unschedulable: true` on `node` (the API call, kube_api.py), with the product's
        unfit label when `reason` is given."""
        with self._lock:
            self.cordoned.add(node)
            if reason:
                self.unfit[node] = reason
        self._event(f"{node} cordoned" + (f" (unfit: {reason})" if reason else ""))

    def released(self, pod: Pod) -> None:
        """`pod` ended on its node (the kubelet reported its exit): the node is free again."""
        with self._lock:
            (node,) = [n for n in self.cluster.nodes if n.netns == pod.netns]
            self.free.append(node)

    def place(self, index: int) -> Node | None:
        """A node for the pod of `index`, or None: Pending (`node_ready_at` says until when)."""
        with self._lock:
            now = time.time()
            schedulable = [n for n in self.free if n.name not in self.cordoned]
            if schedulable:
                self.free.remove(schedulable[0])
                return schedulable[0]
            if self.spares:
                node, placeholder = self.spares.pop(0)
                # Preemption: the victim is deleted with its grace period (0 s: SIGKILL).
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(placeholder.pid, signal.SIGKILL)
                placeholder.wait()
                self.preempted += 1
                self._event(f"pod {index}: preempted the spare on {node.name}")
                return node
            due = [t for t in self.joins if t <= now]
            if due:
                self.joins.remove(due[0])
                node = self.cluster.add_node()
                self._event(f"pod {index}: {node.name} joined (booted, image pulled)")
                return node
            return None

    def node_ready_at(self) -> float:
        """When a Pending pod is next worth placing (time.monotonic())."""
        with self._lock:
            wait = min(self.joins, default=time.time() + 0.5) - time.time()
        return time.monotonic() + max(wait, 0.0)

    def bound(self, index: int, pod: Pod) -> None:
        with self._lock:
            self.pods[index] = pod
            self.bound_at[pod.name] = time.time()

    # --- a node lost, and the controllers that notice -----------------------------------------

    def lose(self, index: int) -> Node:
        """The node under pod `index` stops answering: its network is cut (its veth to the
        bridge down) and every process on it frozen (SIGSTOP), as a hung kernel or a power
        loss leaves them: no exit, no FIN, nothing."""
        with self._lock:
            pod = self.pods[index]
        (node,) = [n for n in self.cluster.nodes if n.netns == pod.netns]
        self.cluster.set_link(node, up=False)
        # Twice: a process forked while the first pass ran is stopped by the second.
        for _ in range(2):
            self.cluster.signal_netns(node.netns, signal.SIGSTOP)
        with self._lock:
            self.losses.append(_Loss(node=node, pod=pod.name, process=pod.process, at=time.time()))
        self._event(f"pod {index}: {node.name} lost (network cut, processes frozen)")
        return node

    def node_returns(self) -> int | None:
        """The lost node comes back (a partition heals, a hung kernel resumes): its link up,
        its processes running again (SIGCONT). Its kubelet finds the pod gone from the API
        server (PodGC force-deleted it) and stops it at its next housekeeping: SIGTERM to the
        container's main process, SIGKILL of what is left after the minimum grace. Until then
        the old pod runs beside its replacement. Returns its main process's exit status."""
        with self._lock:
            (loss,) = self.losses
        self.cluster.set_link(loss.node, up=True)
        self.cluster.signal_netns(loss.node.netns, signal.SIGCONT)
        self._event(f"{loss.node.name} back: {loss.pod}'s processes run again")
        time.sleep(KUBELET_HOUSEKEEPING_S)
        self._event(f"kubelet on {loss.node.name}: SIGTERM to the deleted pod")
        with contextlib.suppress(ProcessLookupError):
            loss.process.send_signal(signal.SIGTERM)
        try:
            loss.process.wait(timeout=KUBELET_MIN_GRACE_S)
        except subprocess.TimeoutExpired:
            self._event(f"kubelet on {loss.node.name}: SIGKILL")
        self.cluster.kill_netns(loss.node.netns)
        return loss.process.wait()

    # --- what the fencer (infra/fencer) reads and writes ----------------------------------------

    def node_states(self) -> list[tuple[str, str, str, list[dict]]]:
        """Every Node object: (name, its Ready status, the status's lastTransitionTime as
        RFC 3339 with microseconds, its taints). A lost node reads `Unknown` from the
        node-monitor grace period after its loss on (the node lifecycle controller), tainted
        unreachable:NoExecute, plus the out-of-service taint once the fencer set it."""
        from datetime import UTC, datetime

        def stamp(at: float) -> str:
            return datetime.fromtimestamp(at, tz=UTC).isoformat()

        now = time.time()
        with self._lock:
            losses = {loss.node.name: loss for loss in self.losses}
            out = []
            for node in self.cluster.nodes:
                if node.name in self.deleted:
                    continue
                loss = losses.get(node.name)
                unknown = loss.at + self.times.monitor_grace_s if loss else None
                if unknown is None or now < unknown:
                    out.append((node.name, "True", stamp(self.started), []))
                    continue
                taints = [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]
                if loss.out_of_service_at is not None:
                    taints.append(
                        {
                            "key": "node.kubernetes.io/out-of-service",
                            "value": "nodeshutdown",
                            "effect": "NoExecute",
                        }
                    )
                out.append((node.name, "Unknown", stamp(unknown), taints))
        return out

    def out_of_service(self, name: str) -> None:
        """The fencer tainted `name` node.kubernetes.io/out-of-service:NoExecute. A lost node's
        pod is then failed by PodGC (`failed_pods`). A node that was not lost (an unfit one the
        fencer replaced, its instance terminated) has no pod of the Job left: its Node object
        goes (the cloud node lifecycle controller deletes the Node of an instance that no
        longer runs) and the node group's new instance joins after the boot and image pull,
        where a Pending spare placeholder lands (`failed_pods`)."""
        now = time.time()
        with self._lock:
            lost = [loss for loss in self.losses if loss.node.name == name]
            if lost:
                (loss,) = lost
                loss.out_of_service_at = now
            else:
                self.deleted.add(name)
                self.joins.append(now + self.times.boot_and_pull_s)
        self._event(f"{name} tainted out-of-service by the fencer")

    def running_pods(self) -> list[tuple[str, str]]:
        """(pod name, node name) of the Job's pods whose container still runs (phase Running,
        as the kubelet reports it); a lost node's pod counts too (its phase is never updated)."""
        with self._lock:
            pods = list(self.pods.values())
        by_netns = {n.netns: n.name for n in self.cluster.nodes}
        return [(p.name, by_netns[p.netns]) for p in pods if p.process.poll() is None]

    def silent(self, pod: Pod) -> bool:
        """`pod` runs on a lost node: whatever its processes do, no kubelet reports it."""
        with self._lock:
            return any(
                loss.pod == pod.name and loss.node.netns == pod.netns for loss in self.losses
            )

    def spare_nodes(self) -> list[str]:
        """The nodes a placeholder holds now."""
        with self._lock:
            return [node.name for node, _ in self.spares]

    def failed_pods(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """Pods PodGC has just made Failed: pod name -> (its node, its True conditions). Also
        lands the spares' Pending placeholders on repaired nodes that have joined."""
        t = self.times
        out: dict[str, tuple[str, tuple[str, ...]]] = {}
        with self._lock:
            now = time.time()
            for at in [at for at in self.joins if at <= now and self.preempted > 0]:
                self.joins.remove(at)
                self.preempted -= 1
                node = self.cluster.add_node()
                self._hold(node)
                self._event(f"{node.name} joined: the spares' placeholder lands on it")
            for loss in self.losses:
                if loss.reported:
                    continue
                if loss.out_of_service_at is not None:
                    failed = loss.out_of_service_at + t.podgc_loop_s
                    if now < failed:
                        continue
                    loss.reported = True
                    # The node group replaced the terminated instance; the cloud node lifecycle
                    # controller deletes the Node of an instance that no longer runs.
                    self.joins.append(loss.out_of_service_at + t.boot_and_pull_s)
                    self.deleted.add(loss.node.name)
                    self._event(
                        f"{loss.pod} Failed by PodGC (out-of-service), force-deleted", failed
                    )
                    out[loss.pod] = (loss.node.name, ("DisruptionTarget",))
                    continue
                unknown = loss.at + t.monitor_grace_s
                evicted = unknown + t.toleration_s
                repair = unknown + t.repair_wait_s
                deleted = repair + t.terminate_s
                failed = deleted + t.podgc_s
                if now < failed:
                    continue
                loss.reported = True
                self.joins.append(repair + t.boot_and_pull_s)
                for at, what in (
                    (unknown, f"{loss.node.name} Ready=Unknown, tainted unreachable:NoExecute"),
                    (evicted, f"{loss.pod} deleted by taint eviction: Terminating"),
                    (repair, f"repair replaces {loss.node.name}: a new instance boots"),
                    (deleted, f"Node {loss.node.name} deleted"),
                    (failed, f"{loss.pod} Failed by PodGC (DisruptionTarget), force-deleted"),
                ):
                    self._event(what, at)
                out[loss.pod] = (loss.node.name, ("DisruptionTarget",))
        return out

    def timeline(self, *, since: float) -> str:
        return "\n".join(f"  {at - since:+7.2f} s  {what}" for at, what in sorted(self.events))
