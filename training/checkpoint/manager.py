"""The checkpoint manager: save through one engine (``engines.py``), commit, retain, take the
snapshots of the run's snapshot tiers on their schedule, and load from the cheapest restore tier
that holds the newest sound state (``tiers.py``). Engines and tiers come from one registry
(``registry.py``); the manager only iterates them.

The on-disk layout and the commit protocol are in ``training.checkpoint.layout``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from training import stop
from training.checkpoint import registry
from training.checkpoint.committer import Committer
from training.checkpoint.engines import EngineContext, Pending, Phases, collective_device
from training.checkpoint.layout import (
    apply_retention,
    commit,
    fresh_step_dir,
    remove_torn,
    step_dir,
)
from training.checkpoint.registry import needs_cpu_collectives
from training.checkpoint.restore import Restore
from training.checkpoint.storage import StorageTier
from training.checkpoint.tiers import RestoreTier, SnapshotTier, TierContext, by_cost
from training.config import CheckpointConfig, JobConfig
from training.modes import snapshot_plan
from training.runlog.metrics import EventLog

__all__ = ["CheckpointManager", "collective_device", "needs_cpu_collectives"]


class StatefulTrainer(Protocol):
    step: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointManager:
    """Save, commit, retain, snapshot and load. Collective: call on every rank in step.

    Build it with :meth:`for_job` (the run, the probes and the benchmarks do): the job's config
    owns the root, the engine and the tiers."""

    @classmethod
    def for_job(
        cls,
        *,
        config: JobConfig,
        rank: int,
        world_size: int,
        events: EventLog,
        point_hook=None,
        keepalive: Callable[[], None] | None = None,
    ) -> CheckpointManager:
        """The job's checkpoint manager: ``config.checkpoint`` under ``config.checkpoint_dir``,
        with the snapshot tiers ``registry.build`` makes for the job's restart mode
        (``training.modes.snapshot_plan`` picks the memory tier)."""
        c = config.checkpoint
        root = Path(config.checkpoint_dir)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))) or 1
        # torchrun's nodes; peer.for_job checks the ring itself and says why a copy is off.
        nodes = world_size // local_world_size
        context = TierContext(
            config=c,
            root=root,
            rank=rank,
            world_size=world_size,
            local_world_size=local_world_size,
            events=events,
            keepalive=stop.reporting_progress(keepalive or _nothing),
            plan=snapshot_plan(checkpoint=c, restart=config.resilience.restart, nodes=nodes),
        )
        return cls(
            config=c,
            root=root,
            rank=rank,
            world_size=world_size,
            events=events,
            point_hook=point_hook,
            keepalive=keepalive,
            snapshot_tiers=registry.build(context),
        )

    def __init__(
        self,
        *,
        config: CheckpointConfig,
        root: Path,
        rank: int,
        world_size: int,
        events: EventLog,
        point_hook=None,
        keepalive: Callable[[], None] | None = None,
        snapshot_tiers: Sequence[SnapshotTier] = (),
    ) -> None:
        """``snapshot_tiers``: the run's (:meth:`for_job`), in the order a step takes them; their
        restore tiers and ``storage`` are the restore tiers."""
        self.config = config
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.events = events
        # Called at each point of a save (staged, written, commit): fault injection uses it.
        self.point_hook = point_hook or (lambda point, step: None)
        # Called between the passes of every blocking wait of a save, a snapshot or the final
        # commit (``StepHooks.keepalive``): the restart layer's heartbeat or progress report,
        # which its timeouts would otherwise miss for as long as the wait lasts; and progress
        # for a SIGTERM's grace (``stop.reporting_progress``).
        self.keepalive = stop.reporting_progress(keepalive or _nothing)
        self._pending: list[Pending] = []
        self._latest_committed: int | None = None
        self._committer = Committer()  # rank 0's commits of asynchronous saves
        self.engine = registry.engine_for(
            config,
            EngineContext(
                rank=rank,
                keepalive=self.keepalive,
                pending=self._pending,
                finalize=self._finalize,
                plan_key=f"{type(self).__name__}/{os.getpid()}/{id(self)}/{world_size}",
            ),
        )
        self.snapshot_tiers: list[SnapshotTier] = list(snapshot_tiers)
        self._storage = StorageTier(
            root=root, rank=rank, world_size=world_size, verify_on_load=config.verify_on_load
        )
        restore = [r for tier in self.snapshot_tiers for r in tier.restore_tiers()]
        self.tiers: list[RestoreTier] = by_cost([*restore, self._storage])
        """The restore tiers, cheapest first (``tiers.TIERS``)."""
        self.restore = Restore(tiers=self.tiers, storage=self._storage, events=events, root=root)
        self._closing = False
        self.last_save_phases: dict[str, float] = {}
        self.last_plan_reused = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Create the root and clear torn checkpoints of earlier attempts, and what no restore
        of this run can use of the tiers' (collective). The engine's worker is started later,
        by :meth:`prepare` after the first step (``NvrxEngine.start``)."""
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_torn(self.root)
        for tier in self.snapshot_tiers:
            tier.start()
        dist.barrier()

    def close(self) -> None:
        """Commit what is pending, stop the background writer, give back the snapshots
        (collective)."""
        self._closing = True  # the run is over: an abandon from here on cleans up as well
        self.wait()
        self._committer.close()
        self.engine.close()
        for tier in self.snapshot_tiers:
            tier.close()

    def abandon(self) -> None:
        """After a fault: drop pending saves (they stay uncommitted) without collectives. A
        commit already handed to rank 0's committer (every rank's files durable) finishes."""
        self._pending.clear()
        self._committer.close()
        for tier in self.snapshot_tiers:
            tier.abandon()
        self.engine.abandon()
        if self._closing:
            # A fault (an in-process restart) during close(), after the run's end: the final
            # checkpoint is committed (the trainer waited for it), so the snapshots go as
            # close() would have removed them, instead of filling /dev/shm until the pod ends.
            # Local files only: no collective.
            for tier in self.snapshot_tiers:
                tier.release()

    # -- saving --------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self._latest_committed

    def prepare(self, trainer: StatefulTrainer) -> None:
        """Ready what the first save and snapshot of this attempt would otherwise pay for (call
        once the optimizer state exists, after the first step): the engine's worker, started
        and not waited for, its save plan and staging buffer; the tiers' slots. Collective (the
        plan gathers every rank's local plan): every rank calls it at the same step."""
        self.engine.start()
        for tier in self.snapshot_tiers:
            tier.prepare(trainer)
        if self.config.interval or self.config.save_final:  # else no save will use the plan
            self.engine.prepare(trainer, root=self.root)

    def after_step(
        self,
        trainer: StatefulTrainer,
        *,
        step: int,
        section: Callable[[str], contextlib.AbstractContextManager] = lambda name: (
            contextlib.nullcontext()
        ),
    ) -> None:
        """The checkpoint schedule, after every step but the run's last (collective): a shared
        save every ``checkpoint.interval`` steps, then each snapshot tier's take when it is
        due (``SnapshotTier.due``). ``section``: the trainer's ``StepHooks.section``; a save and
        an I/O tier's take run in its ``checkpoint_save`` section. A copy in host memory runs
        outside it, between two steps: its pinger thread and reports would cost more than the
        copy of a small model."""
        shared = bool(self.config.interval) and step % self.config.interval == 0
        if shared:
            with section("checkpoint_save"):
                self.save(trainer, step=step, blocking=False)
            stop.progress()  # each piece done is progress (training/stop.py)
        for tier in self.snapshot_tiers:
            if tier.due(step, shared=shared):
                with section("checkpoint_save") if tier.io else contextlib.nullcontext():
                    tier.take(trainer, step=step)
                stop.progress()

    def save(self, trainer: StatefulTrainer, *, step: int, blocking: bool) -> float:
        """Save ``trainer``'s state for ``step``. Returns the time training was blocked; the
        time of each phase is in ``last_save_phases`` and the ``checkpoint_staged`` event."""
        started = time.perf_counter()
        phases = Phases()
        path = fresh_step_dir(self.root, step) if self.rank == 0 else step_dir(self.root, step)
        state = {"trainer": trainer.state_dict()}
        phases.mark("state_dict")
        # Collective: the directory exists before any rank writes into it, and every rank
        # agrees whether the cached plan still fits (one all-reduce, in place of a barrier).
        fits = torch.tensor(
            [1 if self.engine.plan_fits(state) else 0],
            dtype=torch.int32,
            device=collective_device(),
        )
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # a changed rank: every rank plans afresh
        reuse_plan = bool(fits.item())
        phases.mark("agree")
        pending = Pending(step=step, path=path, started=time.time())
        self.engine.write(state, pending=pending, reuse_plan=reuse_plan, mark=phases.mark)
        blocking_s = time.perf_counter() - started
        self.last_save_phases = dict(phases.seconds)
        self.last_plan_reused = reuse_plan
        self.events.emit(
            "checkpoint_staged",
            step=step,
            blocking_s=blocking_s,
            engine=self.config.engine,
            phases=self.last_save_phases,
            plan_reused=reuse_plan,
        )
        self.point_hook("staged", step)
        if blocking:
            self.wait()
        return blocking_s

    def before_update(self) -> None:
        """Call before the optimizer changes the state in place: on a GPU the compute stream
        waits for the newest snapshot's device-to-host copies (no host wait)."""
        for tier in self.snapshot_tiers:
            tier.before_update()

    def poll(self) -> None:
        """Commit every save that all ranks have finished writing, and finish the engine's
        worker start once every rank's is up (collective; cheap when nothing is pending)."""
        self.engine.tick()
        self._committer.raise_if_failed()
        if self._pending:
            self.engine.poll(blocking=False)
        for tier in self.snapshot_tiers:
            tier.poll()

    def wait(self) -> None:
        """Block until every pending save is committed."""
        self.engine.poll(blocking=True)
        for tier in self.snapshot_tiers:
            tier.wait()
        self._committer.drain(keepalive=self.keepalive)

    def _finalize(self, pending: Pending) -> None:
        """Every rank's files are durable: rank 0 commits, then applies retention."""
        if pending in self._pending:
            self._pending.remove(pending)
        self.point_hook("written", pending.step)
        dist.barrier()  # every rank's manifest is on disk before rank 0 reads them
        if self.rank == 0:
            if self.engine.commits_inline:
                self._commit(pending)  # the synchronous engine: committed when save returns
            else:
                self._committer.submit(partial(self._commit, pending))
        self._latest_committed = pending.step

    def _commit(self, pending: Pending) -> None:
        """Rank 0: the commit record, then retention (on the committer's thread for the
        asynchronous engines: training.checkpoint.committer)."""
        self.point_hook("commit", pending.step)
        commit(
            pending.path,
            step=pending.step,
            world_size=self.world_size,
            engine=self.config.engine,
        )
        write_s = time.time() - pending.started
        self.events.emit(
            "checkpoint_committed", step=pending.step, path=str(pending.path), write_s=write_s
        )
        # Written now, not at the writer's next flush: a SIGKILL in that half second would
        # leave a committed checkpoint that the run's events never name.
        self.events.flush()
        apply_retention(
            self.root, keep_last=self.config.keep_last, keep_every=self.config.keep_every
        )

    # -- loading -------------------------------------------------------------------------------
    def resume_expected(self) -> bool:
        """Whether ``load_latest`` has something to load (collective): the trainer then skips
        initialising the weights it is about to overwrite."""
        return self.config.resume and bool(self.restore.candidates())

    def load_latest(self, trainer: StatefulTrainer) -> int | None:
        """Load the newest sound state into ``trainer`` from the cheapest tier that holds it
        (``restore.Restore.load_newest``); None if there is none (or ``checkpoint.resume`` is
        off). Then every snapshot tier forgets what this rank holds of later steps, the
        timeline that died, so that no restart can offer it again and no snapshot of a replayed
        step sits beside one of the old timeline (on a GPU the two differ, and ranks could
        restore a mix): each rank removes its own files and the peer copies it holds, before
        its first step (local, no collective). Storage keeps its committed checkpoints: one
        newer than the step is there only when it was rejected as damaged, and every restore
        rejects it again (its next save replaces it)."""
        loaded = self.restore.load_newest(trainer) if self.config.resume else None
        for tier in self.snapshot_tiers:
            tier.discard_newer(loaded.step if loaded is not None else 0)
        if loaded is None:
            self.restore.raise_if_all_damaged()
            return None
        self._latest_committed = loaded.latest_committed
        return loaded.step


def _nothing() -> None:
    pass
