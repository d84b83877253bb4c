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


def lighthouse_command(*, groups: int, port: int, join_timeout_ms: int = 1000) -> list[str]:
    """The Lighthouse's command line (``torchft_lighthouse --help``). Waiting semantics: no
    quorum forms with fewer than every group (``--min_replicas``), so the survivors wait at the
    step's quorum for the failed group. ``--join_timeout_ms``: how long a quorum waits for
    heartbeating stragglers once it could form; a restarted group has a new replica id, so
    without a short wait every rejoin would add torchft's 60 s default."""
    return [
        LIGHTHOUSE_BIN,
        f"--min_replicas={groups}",
        f"--bind=[::]:{port}",
        f"--join_timeout_ms={join_timeout_ms}",
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
