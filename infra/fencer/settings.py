"""The fencer's shipped settings: one owner. The Deployment's environment (infra/node_fencer.py),
the pod emulation (tests/pods, scaled), docs/node-loss.md's timeline, bench/node_loss.py and the
planner's silent-node term all read these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class FencerSettings:
    wait_s: float = 30.0
    """Ready=Unknown this long (after the 50 s node-monitor grace, 80 s of silence in all, 8
    missed 10 s Lease renewals) before the instance is terminated. The blip tolerance: a node
    silent for less than 80 s is never fenced. Held equal to the trainer pod's own toleration
    of the unreachable taint (``manifests.render.NODE_LOSS_TOLERATION_SECONDS``, 30 s;
    tests/infra/test_node_fencer.py): at 80 s of silence the pod is evicted anyway, so a shorter
    wait would end nodes whose pods would have lived (a 60-80 s blip), and a longer one buys
    no pod back and delays every lost node's replacement."""
    poll_s: float = 5.0
    """Seconds between passes over the Nodes."""
    max_bad_fraction: float = 0.2
    """EKS node repair's own default threshold (node-repair.html): above it, stop and alert."""
    join_timeout_s: float = 1200.0
    """An instance of the group with no Node this long after launch is terminated (it never
    joined: a failed Lustre client set-up keeps it out on purpose). Covers a p5's boot, the
    user data (the Lustre part alone may retry for 150 s) and nodeadm with room to spare: a
    node that is slow but healthy must never be cut off (EKS documents no boot time)."""
    metrics_port: int = 9102
    """``GET /metrics`` (infra/fencer/metrics.py): the container port named ``metrics`` that the
    stack's scraper reads (infra/observability.py)."""
    terminate_s: float = 30.0
    """TerminateInstances to the instance reported ``terminated``, for a fenced (silent) node:
    an estimate. The fence sends ``SkipOsShutdown`` (infra/fencer/ec2.py): EC2 does not wait
    for a graceful OS shutdown, which a hung kernel never completes (EC2 User Guide, "Methods
    for terminating an instance": default terminate attempts a graceful OS shutdown; "Troubleshoot
    instance termination": an instance can stay ``shutting-down`` for minutes, stuck ones for
    hours), so what is left is the hypervisor's stop and the state change. AWS documents no
    figure for it; only a real cluster can measure it (moto answers at once)."""
    lustre_mount_s: float = 600.0
    """A trainer pod whose FSx for Lustre volume fails to mount (kubelet ``FailedMount`` events,
    the pod ``Pending`` in ``ContainerCreating``) this long after its first failure: its node is
    marked unfit (``lustre-mount``) and the pod deleted, so the Job's replacement lands on a
    spare. The kubelet itself never gives up: its volume manager retries a failed mount with
    exponential backoff from 500 ms, capped at about 2 min (kubernetes
    pkg/util/goroutinemap/exponentialbackoff, ``initialDurationBeforeRetry``,
    ``maxDurationBeforeRetry``), for as long as the pod exists; the pod worker's wait for its
    volumes (pkg/kubelet/volumemanager, ``podAttachAndMountTimeout``, about 2 min) ends in an
    event and a retry at the next sync. 10 min: about five capped retries, room for the FSx CSI
    node plugin starting late on a new node (it too needs its Lustre client), while a mount
    that never works stops holding a completion index and a billed p5 after minutes."""


FENCER = FencerSettings()


@dataclass(frozen=True, kw_only=True)
class KubeTimers:
    """The Kubernetes timers a lost node's timeline rests on: not settings of ours but the
    control plane's defaults, held once here (standard library, the lowest layer that needs them)
    so docs/node-loss.md's timeline, the pod emulation (podsim.control_plane.EKS), the planner's
    silent-node term (planner.costs) and bench/node_loss.py read the same numbers."""

    node_monitor_grace_s: float = 50.0
    """A silent node's ``Ready`` turns ``Unknown`` (kube-controller-manager
    ``--node-monitor-grace-period``; 50 s from Kubernetes 1.32, kubernetes/kubernetes#127352)."""
    podgc_loop_s: float = 20.0
    """PodGC's period (kubernetes pkg/controller/podgc/gc_controller.go, ``gcCheckPeriod``):
    a terminating pod on a node tainted out-of-service is failed at its next pass
    (``gcTerminating``): 0-20 s after the taint, 10 s at the median."""
    podgc_quarantine_s: float = 40.0
    """PodGC's wait before it fails a pod bound to a deleted Node (same file,
    ``quarantineTime``; ``gcOrphaned``)."""


KUBE = KubeTimers()

USAGE = 2
"""The exit code of a bad setting: ``training.exits.USAGE``, which the fencer's image does not
carry (its context is infra/fencer alone); tests/infra/test_node_fencer.py holds them equal."""
