"""The restore walk: load the newest sound state from the cheapest restore tier that holds it.

All ranks walk the same candidates (:meth:`Restore.candidates`) in the same order and agree on
each verdict (every ``RestoreTier.load`` is collective), so they always load the same step from
the same tier. A rejected candidate (damaged, another structure) changes nothing and the next is
tried; a tier's step older than the newest sound committed checkpoint is reached only after that
checkpoint was rejected."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.checkpoint.layout import CheckpointError
from training.checkpoint.storage import StorageTier
from training.checkpoint.tiers import Rejected, RestoreTier
from training.runlog.metrics import EventLog


@dataclass(frozen=True, kw_only=True)
class Loaded:
    step: int
    latest_committed: int | None
    """The newest committed checkpoint on storage (the step itself when storage served it)."""


class Restore:
    """The walk over one manager's restore tiers (cheapest first, ``storage`` among them)."""

    def __init__(
        self, *, tiers: list[RestoreTier], storage: StorageTier, events: EventLog, root: Path
    ) -> None:
        self.tiers = tiers
        self.storage = storage
        self.events = events
        self.root = root
        self.committed: list[int] = []
        """The committed steps on storage, once listed."""
        self._candidates: list[tuple[int, RestoreTier]] | None = None

    def candidates(self) -> list[tuple[int, RestoreTier]]:
        """Every (step, tier) some tier can restore on every rank: newest step first, the
        cheaper tier first at equal steps. Collective; listed once."""
        if self._candidates is None:
            candidates = []
            for tier in self.tiers:
                steps = tier.steps()
                if tier is self.storage:
                    self.committed = steps
                candidates += [(step, tier) for step in steps]
            order = {id(tier): index for index, tier in enumerate(self.tiers)}
            candidates.sort(key=lambda c: (-c[0], order[id(c[1])]))
            self._candidates = candidates
        return self._candidates

    def load_newest(self, trainer: Any) -> Loaded | None:
        """Load the newest sound candidate into ``trainer``; None when none is. Every load
        emits ``checkpoint_load`` with its ``source`` (the tier), ``seconds`` and ``bytes``
        (this rank's state restored); every rejection ``checkpoint_rejected``."""
        candidates = self.candidates()
        newest_committed = max(self.committed, default=None)
        tried: set[tuple[int, str]] = set()
        for step, tier in candidates:
            if (step, tier.name) in tried:
                continue
            tried.add((step, tier.name))
            started = time.perf_counter()
            result = tier.load(trainer, step=step)
            seconds = time.perf_counter() - started
            if isinstance(result, Rejected):
                self.events.emit(
                    "checkpoint_rejected",
                    step=step,
                    path=result.path,
                    problem=result.problem,
                    source=tier.name,
                )
                continue
            self.events.emit(
                "checkpoint_load",
                step=step,
                path=result.path,
                seconds=seconds,
                bytes=result.nbytes,
                source=tier.name,
            )
            latest = step if tier is self.storage else newest_committed
            return Loaded(step=step, latest_committed=latest)
        return None

    def raise_if_all_damaged(self) -> None:
        """After a walk that loaded nothing: committed checkpoints that all failed are an
        error, not a fresh start."""
        if self.committed:
            raise CheckpointError(
                f"every committed checkpoint under {self.root} is damaged; "
                "move them aside to start fresh (checkpoint.resume=false ignores them)"
            )
