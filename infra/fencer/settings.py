"""The fencer's shipped settings: one owner. The Deployment's environment (infra/node_fencer.py),
the pod emulation (tests/pods, scaled), docs/node-loss.md's timeline, bench/node_loss.py and the
planner's silent-node term all read these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class FencerSettings:
    wait_s: float = 30.0
    """Ready=Unknown this long (after the 50 s node-monitor grace, 80 s of silence in all, 8
    missed 10 s Lease renewals) before the instance is terminated. Shorter fences nodes that
    a brief network blip silenced; every second of it is paid by every lost node."""
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
    terminate_s: float = 60.0
    """TerminateInstances to the instance reported ``terminated``: an estimate for a hung p5
    (only a real cluster can measure it; moto answers at once)."""


FENCER = FencerSettings()

USAGE = 2
"""The exit code of a bad setting: ``training.exits.USAGE``, which the fencer's image does not
carry (its context is infra/fencer alone); tests/infra/test_node_fencer.py holds them equal."""
