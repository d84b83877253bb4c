"""Which replica group a rank is in, and where the groups meet: the environment the replica
launcher sets (locally ``training/launch/local.py``; on EKS each group's Job).

Standard library only: the launchers import it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from training.exits import ConfigError

GROUP_ENV = "REPLICA_GROUP_ID"
"""This group's index, ``0..groups-1`` (the launcher of the group sets it)."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The Lighthouse's ``http://host:port``: torchft's own variable (``torchft/manager.py``
reads it when no ``lighthouse_addr`` is passed), so the address has one name everywhere."""
LIGHTHOUSE_BIN = "torchft_lighthouse"
"""torchft's Lighthouse server (the console script ``torchft._torchft:lighthouse_main``)."""


@dataclass(frozen=True, kw_only=True)
class ReplicaTopology:
    group: int
    groups: int
    lighthouse: str

    @classmethod
    def from_environment(
        cls, *, groups: int, env: Mapping[str, str] = os.environ
    ) -> ReplicaTopology:
        """The replica launcher's settings; one clear error when a rank of a ``replica`` run was
        started without them (by a launcher that is not the replica one)."""
        missing = [name for name in (GROUP_ENV, LIGHTHOUSE_ENV) if not env.get(name)]
        if missing:
            raise ConfigError(
                "resilience.restart",
                f"replica ranks need {' and '.join(missing)} from the replica launcher "
                "(make train RESTART=replica runs it); start them through it",
            )
        group = int(env[GROUP_ENV])
        if not 0 <= group < groups:
            raise ConfigError(
                "resilience.replica_groups",
                f"{GROUP_ENV}={group} is not a group of {groups}: set the same "
                "resilience.replica_groups in every group",
            )
        return cls(group=group, groups=groups, lighthouse=env[LIGHTHOUSE_ENV])


LIGHTHOUSE_JOIN_TIMEOUT_MS = 1000
"""``--join_timeout_ms``: how long a quorum that could form waits for replicas that heartbeat
but have not asked to join (torchft ``src/lighthouse.rs`` ``quorum_compute``: "waiting for
stragglers due to join timeout"). A restarted group has a new replica id (``Manager`` appends a
uuid), so with torchft's 60 s default every rejoin would wait 60 s; every group asks within
a step, so one second is plenty."""
LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 2000
"""``--heartbeat_timeout_ms``: a replica silent this long is dead to the Lighthouse. A failed
group's Manager server (in its rank 0) stops heartbeating when its launcher stops the group's
workers; until this expires, the Lighthouse's split-brain rule (``quorum_compute``: a new
quorum needs more than half of the heartbeating replicas) keeps the survivors of a 2-group
job from shrinking. So the shrinking semantics' stall is about this plus the group's stop.
torchft's default is 5000; the Manager heartbeats every 100 ms (``Manager``'s
``heartbeat_interval``), so 2000 ms is 20 missed beats: not a loaded machine's hiccup."""


def lighthouse_command(*, min_replicas: int, port: int) -> list[str]:
    """The Lighthouse's command line (``torchft_lighthouse --help``). ``min_replicas`` is the
    run's ``ResilienceConfig.replica_min_groups`` (every group in the waiting semantics: the
    survivors wait at the step's quorum for the failed group; one in the shrinking semantics).
    ``--quorum_tick_ms`` stays torchft's 100: a dead replica's expiry is seen at a tick."""
    return [
        LIGHTHOUSE_BIN,
        f"--min_replicas={min_replicas}",
        f"--bind=[::]:{port}",
        f"--join_timeout_ms={LIGHTHOUSE_JOIN_TIMEOUT_MS}",
        f"--heartbeat_timeout_ms={LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS}",
    ]


def group_sizes(*, world_size: int, groups: int) -> int:
    """Ranks per group; a clear error when the ranks do not split evenly."""
    if groups < 1 or world_size % groups:
        raise ConfigError(
            "resilience.replica_groups",
            f"{world_size} ranks do not split into {groups} equal replica groups: "
            "pick a divisor of the rank count",
        )
    return world_size // groups
