"""What a replica group's events say about the groups (``restart=replica``): one definition
for the run report, TensorBoard and the Prometheus exporter.

The trainer of each group (``training/replica/trainer.py``) writes, from every rank, into its
group's run directory (``<run_dir>/group-<g>``)::

    replica_quorum   {step, group, participants, groups, quorum_id, wait_s}  members changed,
                     or a wait for an out group ended
    replica_waiting  {step, group, since}      a quorum has not formed for WAITING_EVENT_S:
                     a group is out (waiting semantics form no quorum without every group)
    replica_step_discarded {step, group, cause}  a cross-group collective failed in the step
    replica_stall    {step, group, stall_s}    a survivor's seconds without a step, per failure
    replica_heal     {step, from_step, group, heal_s, bytes}  this group healed from a peer
    replica_samples_skipped {step, group, missing_group, position, epoch, samples, indices}
                     shrinking semantics: a step committed without ``missing_group``; its
                     samples (each rank: its counterpart's indices) are skipped, not replayed

Every rank writes its own line; one occurrence is the same event of all ranks (a rank's k-th
event of a kind at a step): seconds are the slowest rank's, bytes the sum (each rank heals its
own shard); skipped samples are summed over every line (each rank wrote its own
counterpart's). Standard library only.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

QUORUM = "replica_quorum"
WAITING = "replica_waiting"
DISCARDED = "replica_step_discarded"
STALL = "replica_stall"
HEAL = "replica_heal"
SKIPPED = "replica_samples_skipped"
KINDS = frozenset({QUORUM, WAITING, DISCARDED, STALL, HEAL, SKIPPED})

_ENDS_A_WAIT = frozenset({QUORUM, HEAL, "run_start", "attempt_start", "run_end", "fault"})
"""A rank's later event of one of these kinds ends its open wait (a quorum formed, or the rank
itself went on or down)."""
READ_KINDS = KINDS | _ENDS_A_WAIT
"""The kinds ``summarize_replica`` reads: a reader may keep only these."""


@dataclass(frozen=True, kw_only=True)
class QuorumChange:
    time: float
    """Unix time the first rank saw the quorum."""
    step: int
    participants: int
    """Groups in the quorum."""
    groups: int | None
    """Groups the job has."""
    wait_s: float
    """The slowest rank's wait for it."""


@dataclass(frozen=True, kw_only=True)
class Heal:
    time: float
    step: int
    """The step the group healed to (its peers')."""
    from_step: int
    """The step it restarted from (its restore tiers')."""
    heal_s: float
    """The slowest rank's quorum-and-heal time."""
    bytes: int
    """Bytes every rank of the group received."""


@dataclass(frozen=True, kw_only=True)
class Stall:
    time: float
    step: int
    """The step that waited."""
    stall_s: float
    """The slowest rank's seconds without a step."""


@dataclass(frozen=True, kw_only=True)
class ReplicaSummary:
    """One group's view of the replica groups (or nothing: ``summarize_replica`` is None for a
    run without replica events)."""

    group: int | None
    groups: int | None
    quorum_changes: tuple[QuorumChange, ...]
    heals: tuple[Heal, ...]
    stalls: tuple[Stall, ...]
    steps_discarded: int
    waiting_since: float | None
    """Unix time this group's ranks started a wait that has not ended (a group is out now)."""
    samples_skipped: int = 0
    """Shrinking semantics: samples of missing groups that steps committed without (written
    by the lowest group present, so a run's total is the sum over its groups)."""
    steps_skipped: tuple[tuple[int, int], ...] = ()
    """(missing group, step) of each step committed without that group, in order."""

    @property
    def participants(self) -> int | None:
        return self.quorum_changes[-1].participants if self.quorum_changes else None

    @property
    def stall_p50_s(self) -> float | None:
        return statistics.median(s.stall_s for s in self.stalls) if self.stalls else None

    @property
    def stall_max_s(self) -> float | None:
        return max((s.stall_s for s in self.stalls), default=None)

    @property
    def heal_bytes_total(self) -> int:
        return sum(h.bytes for h in self.heals)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def occurrences(events: Iterable[dict[str, Any]], kind: str) -> list[list[dict[str, Any]]]:
    """The events of ``kind``, one list per occurrence (every rank's line of it), in time order.
    A rank's k-th line at a step is occurrence k of that step: a step discarded twice is two
    occurrences, the same discard seen by four ranks is one."""
    seen: dict[tuple[Any, Any], int] = defaultdict(int)
    grouped: dict[tuple[Any, int], list[dict[str, Any]]] = {}
    for e in sorted(
        (e for e in events if e.get("kind") == kind and _num(e.get("time")) is not None),
        key=lambda e: float(e["time"]),
    ):
        key = (e.get("step"), e.get("rank"))
        grouped.setdefault((e.get("step"), seen[key]), []).append(e)
        seen[key] += 1
    return sorted(grouped.values(), key=lambda lines: min(float(e["time"]) for e in lines))


def _slowest(lines: list[dict[str, Any]], field: str) -> float:
    return max((_num(e.get(field)) or 0.0 for e in lines), default=0.0)


def _waiting_since(events: list[dict[str, Any]]) -> float | None:
    """The start of the wait some rank is still in, if any (the earliest such rank's)."""
    open_since: dict[Any, float] = {}
    for e in sorted(events, key=lambda e: float(e["time"])):
        rank = e.get("rank")
        if e.get("kind") == WAITING:
            open_since[rank] = _num(e.get("since")) or float(e["time"])
        elif e.get("kind") in _ENDS_A_WAIT:
            open_since.pop(rank, None)
    return min(open_since.values(), default=None)


def summarize_replica(events: Iterable[dict[str, Any]]) -> ReplicaSummary | None:
    """The `ReplicaSummary` of one group's events (None when it has no replica events)."""
    events = [e for e in events if _num(e.get("time")) is not None]
    mine = [e for e in events if e.get("kind") in KINDS]
    if not mine:
        return None
    quorums = []
    for lines in occurrences(mine, QUORUM):
        groups = next((e["groups"] for e in lines if isinstance(e.get("groups"), int)), None)
        quorums.append(
            QuorumChange(
                time=min(float(e["time"]) for e in lines),
                step=int(lines[0].get("step") or 0),
                participants=int(lines[0].get("participants") or 0),
                groups=groups,
                wait_s=_slowest(lines, "wait_s"),
            )
        )
    heals = [
        Heal(
            time=min(float(e["time"]) for e in lines),
            step=int(lines[0].get("step") or 0),
            from_step=int(lines[0].get("from_step") or 0),
            heal_s=_slowest(lines, "heal_s"),
            bytes=sum(int(_num(e.get("bytes")) or 0) for e in lines),
        )
        for lines in occurrences(mine, HEAL)
    ]
    stalls = [
        Stall(
            time=min(float(e["time"]) for e in lines),
            step=int(lines[0].get("step") or 0),
            stall_s=_slowest(lines, "stall_s"),
        )
        for lines in occurrences(mine, STALL)
    ]
    skipped = [e for e in mine if e.get("kind") == SKIPPED]
    steps_skipped = sorted(
        {(int(e.get("missing_group") or 0), int(e.get("step") or 0)) for e in skipped}
    )
    group = next((e["group"] for e in mine if isinstance(e.get("group"), int)), None)
    return ReplicaSummary(
        group=group,
        groups=next((q.groups for q in reversed(quorums) if q.groups is not None), None),
        quorum_changes=tuple(quorums),
        heals=tuple(heals),
        stalls=tuple(stalls),
        steps_discarded=len(occurrences(mine, DISCARDED)),
        samples_skipped=sum(int(_num(e.get("samples")) or 0) for e in skipped),
        steps_skipped=tuple(steps_skipped),
        waiting_since=_waiting_since(
            [e for e in events if e.get("kind") in _ENDS_A_WAIT | {WAITING}]
        ),
    )
