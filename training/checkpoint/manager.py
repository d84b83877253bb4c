"""The checkpoint manager: save (three engines), commit, retain, take the memory snapshots
restarts restore (``pod_memory.py``, ``memory.py``), and load from the cheapest restore tier
that holds the newest sound state (``tiers.py``).

The on-disk layout and the commit protocol are in ``training.checkpoint.layout``."""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from training.checkpoint import peer
from training.checkpoint.committer import Committer
from training.checkpoint.integrity import ChecksummingWriter
from training.checkpoint.layout import (
    COMMIT,
    SHARDS,
    STEP_DIR,
    CheckpointError,
    commit,
    committed_steps,
    retention_victims,
    step_dir,
    write_rank_manifest,
)
from training.checkpoint.memory import (
    SNAPSHOTS,
    MemorySnapshots,
    ProcessMemoryTier,
)
from training.checkpoint.pod_memory import (
    PodMemorySnapshots,
    PodMemoryTier,
    remove_run_dir_if_empty,
    run_identity,
    run_root,
)
from training.checkpoint.staging import staged_bytes, structure_key
from training.checkpoint.storage import StorageTier
from training.checkpoint.tiers import Rejected, RestoreTier, by_cost
from training.config import CheckpointConfig, JobConfig
from training.modes import snapshot_plan
from training.runlog.metrics import EventLog


class StatefulTrainer(Protocol):
    step: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ---------------------------------------------------------------------------------------------
# the manager
# ---------------------------------------------------------------------------------------------


class CachingSavePlanner(DefaultSavePlanner):
    """torch's save planner with its plan caching on (torch 2.13 ``default_planner.py``:
    ``enable_plan_caching``; each rank still compares its local plan with the cached one and
    sends an empty plan when it is unchanged), under a key of its own: torch keys its
    class-level cache by class name, so two managers (a restart with another world size in the
    same process) would otherwise share, and mix, their plans. Module-level: torch_async pickles
    it into its background process, where the cache then lives."""

    def __init__(self, *, key: str) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key


class _Phases:
    """Seconds spent in each phase of one save (the blocking part), in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


@dataclass
class _Pending:
    step: int
    path: Path
    started: float
    future: Any = None  # torch_async only


class CheckpointManager:
    """Save, commit, retain and load checkpoints. Collective: call on every rank in step.

    Build it with :meth:`for_job` (the run, the probes and the benchmarks do): the job's config
    owns the root and the engine."""

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
        and the restore tiers of the job's restart mode.

        Snapshots every ``checkpoint.memory_interval`` steps in the tier
        ``training.modes.snapshot_plan`` picks for the restart mode: the pod's memory
        (``pod_memory.py``: in-job and in-process restarts restore them) or the process's
        (``memory.py``: in-process restarts only).

        Restore tiers: the manager builds ``memory`` / ``pod_memory`` from the snapshots it
        takes, ``local`` and ``storage`` from its config, and takes any other tier in ``tiers``;
        it orders all of them by ``tiers.TIERS``. A new tier (``peer``) registers here, by
        appending its object to ``tiers``."""
        c = config.checkpoint
        root = Path(config.checkpoint_dir)
        # torchrun's nodes; peer.for_job checks the ring itself and says why a copy is off.
        nodes = world_size // (int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))) or 1)
        plan = snapshot_plan(checkpoint=c, restart=config.resilience.restart, nodes=nodes)
        memory = pod_memory = None
        tiers: list[RestoreTier] = []  # other tiers register here (``peer``)
        if plan.tier == "pod_memory":
            owner = run_identity(root)
            pod_memory = PodMemorySnapshots.for_rank(
                root=run_root(c.pod_memory_dir, owner),
                owner=owner,
                rank=rank,
                world_size=world_size,
            )
            copies = peer.for_job(
                config=c,
                root=pod_memory.root,
                owner=owner,
                rank=rank,
                world_size=world_size,
                events=events,
                published=pod_memory.publication,
                keepalive=keepalive or _nothing,
            )
            if copies is not None:
                tiers.append(peer.PeerTier(copies))
            pod_memory.checksum = copies is not None  # a CRC32 only for a copy that travels
        elif plan.tier == "memory":
            memory = SNAPSHOTS
        return cls(
            config=c,
            root=root,
            rank=rank,
            world_size=world_size,
            events=events,
            point_hook=point_hook,
            keepalive=keepalive,
            memory=memory,
            pod_memory=pod_memory,
            tiers=tiers,
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
        memory: MemorySnapshots | None = None,
        pod_memory: PodMemorySnapshots | None = None,
        tiers: Sequence[RestoreTier] = (),
    ) -> None:
        """``memory`` / ``pod_memory``: where :meth:`snapshot` copies the state (their restore
        tiers are added here); ``tiers``: any other restore tier (:meth:`for_job`)."""
        self.config = config
        self._memory = memory
        self._pod_memory = pod_memory
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.events = events
        # Called at each point of a save (staged, written, commit): fault injection uses it.
        self.point_hook = point_hook or (lambda point, step: None)
        # Called between the passes of every blocking wait of a save, a snapshot or the final
        # commit (``StepHooks.keepalive``): the restart layer's heartbeat or progress report,
        # which its timeouts would otherwise miss for as long as the wait lasts.
        self.keepalive = keepalive or _nothing
        self._pending: list[_Pending] = []
        self._latest_committed: int | None = None
        self._committer = Committer()  # rank 0's commits of asynchronous saves
        self._nvrx = None
        self._local = None
        if config.local_dir:
            from training.checkpoint.local import LocalCheckpoints, session_id_for

            self._local = LocalCheckpoints(
                root=Path(config.local_dir),
                session_id=session_id_for(root),
                world_size=world_size,
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
            )
        if config.engine == "nvrx":
            from training.checkpoint.nvrx_async import AsyncCheckpointQueue

            self._nvrx = AsyncCheckpointQueue(keepalive=self.keepalive)
        self._worker_started = False
        self._local_pending = False
        restore: list[RestoreTier] = list(tiers)
        if memory is not None:
            restore.append(
                ProcessMemoryTier(memory, owner=str(root), rank=rank, world_size=world_size)
            )
        if pod_memory is not None:
            restore.append(PodMemoryTier(pod_memory))
        if self._local is not None:
            from training.checkpoint.local import LocalTier

            restore.append(LocalTier(self._local, path=Path(config.local_dir)))
        self._storage = StorageTier(
            root=root, rank=rank, world_size=world_size, verify_on_load=config.verify_on_load
        )
        restore.append(self._storage)
        self.tiers: list[RestoreTier] = by_cost(restore)
        self._peer = next((t.copies for t in self.tiers if isinstance(t, peer.PeerTier)), None)
        """The restore tiers, cheapest first (``tiers.TIERS``)."""
        self._candidates: list[tuple[int, RestoreTier]] | None = None
        self._closing = False
        self._pod_memory_off = False
        """A pod-memory snapshot failed in this attempt: none is taken any more (the peer
        exchange, a collective, still runs: it sends nothing)."""
        self._local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        self._committed: list[int] = []
        # The structure the cached save plan was made for (nvrx), and torch's cache key.
        self._plan_key: tuple | None = None
        self._torch_plan_key = f"{type(self).__name__}/{os.getpid()}/{id(self)}/{world_size}"
        self.last_save_phases: dict[str, float] = {}
        self.last_plan_reused = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Create the root and clear torn checkpoints of earlier attempts (collective). The NVRx
        worker is started later, by :meth:`prepare` after the first step."""
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_torn()
        if self._pod_memory is not None:
            # Before the restore, which may need room for a peer's copy: what no restore of
            # this run can use (another world size's snapshots, dead runs' directories).
            self._pod_memory.prune()
        dist.barrier()

    def _start_worker(self) -> None:
        """Spawn (or rebind) this attempt's NVRx worker, once, without waiting for it; the steps'
        :meth:`poll` find it ready. Not in :meth:`start`: a fresh worker imports torch (seconds
        of CPU) and the write-results server's start blocks (~0.1 s, a fresh Python); both sat
        on a restart's critical path, between the model build and the first step (on 2 CPU
        ranks the load took 0.45-0.65 s beside them, 0.2-0.3 s without). The first save is an
        interval later. Collective (the worker's binding): every rank calls it at the same
        point, which :meth:`prepare` and :meth:`save` are."""
        if self._nvrx is not None and not self._worker_started:
            self._worker_started = True
            self._nvrx.start_worker()

    def _remove_torn(self) -> None:
        # Only called at start, on rank 0, before any save of this attempt: an uncommitted
        # directory then belongs to an attempt that died, never to a write in flight.
        for entry in self.root.iterdir():
            if STEP_DIR.match(entry.name) and not (entry / COMMIT).is_file():
                shutil.rmtree(entry, ignore_errors=True)

    def close(self) -> None:
        """Commit what is pending and stop the background worker (collective)."""
        self._closing = True  # the run is over: an abandon from here on cleans up as well
        self.wait()
        self._committer.close()
        if self._nvrx is not None:
            self._nvrx.close()
            self._nvrx = None
        if self._local is not None:
            self._local.close()
        self._release_snapshots()

    def abandon(self) -> None:
        """After a fault: drop pending saves (they stay uncommitted) without collectives. A
        commit already handed to rank 0's committer (every rank's files durable) finishes."""
        self._pending.clear()
        self._committer.close()
        if self._peer is not None:
            self._peer.abandon()  # its exchange thread publishes nothing more
        if self._nvrx is not None:
            self._nvrx.abandon()
            self._nvrx = None
        if self.config.engine == "torch_async":
            from training.checkpoint.torch_async import drop_background_process

            drop_background_process()  # every rank: the next attempt makes a new one alike
        if self._local is not None:
            self._local.abandon()
            self._local_pending = False
        if self._closing:
            # A fault (an in-process restart) during close(), after the run's end: the final
            # checkpoint is committed (the trainer waited for it), so the memory snapshots
            # go as close() would have removed them, instead of filling /dev/shm until the
            # pod ends. Local files only: no collective.
            self._release_snapshots()

    def _release_snapshots(self) -> None:
        if self._memory is not None:
            self._memory.clear()  # the run is over: nothing restarts into this process
        if self._pod_memory is not None:
            self._pod_memory.close(remove=True)  # nor into this pod: /dev/shm is left empty
        if self._peer is not None:
            self._peer.close()
        if self._pod_memory is not None:
            remove_run_dir_if_empty(self._pod_memory.root)

    # -- saving --------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self._latest_committed

    def prepare(self, trainer: StatefulTrainer) -> None:
        """Ready what the first save of this attempt would otherwise pay for (call once the
        optimizer state exists, after the first step): the save plan, made here and cached
        (:meth:`AsyncCheckpointQueue.plan_ahead`); the staging buffer of CPU state, reserved in
        the background; the NVRx worker, started here and not waited for: a fresh one imports
        torch for seconds, which :meth:`poll` lets the steps overlap.
        Collective (the plan gathers every rank's local plan): every rank calls it at the same
        step."""
        self._start_worker()
        if self._pod_memory is not None:
            self._pod_memory.prepare(trainer.state_dict())  # slots mapped, pinned off-thread
        if self._nvrx is None or not (self.config.interval or self.config.save_final):
            return  # no save will use the plan
        state = {"trainer": trainer.state_dict()}  # as :meth:`save` builds it
        self._nvrx.plan_ahead(state_dict=state, checkpoint_root=str(self.root))
        self._plan_key = structure_key(state)
        nbytes = staged_bytes(state)
        if nbytes:
            self._nvrx.reserve_staging(nbytes)

    def save(self, trainer: StatefulTrainer, *, step: int, blocking: bool) -> float:
        """Save ``trainer``'s state for ``step``. Returns the time training was blocked; the
        time of each phase is in ``last_save_phases`` and the ``checkpoint_staged`` event."""
        started = time.perf_counter()
        phases = _Phases()
        path = step_dir(self.root, step)
        if self.rank == 0:
            if path.exists():
                # A checkpoint of this step from an earlier attempt (found damaged, or torn):
                # un-commit it first, so its old record never vouches for new, partial files.
                (path / COMMIT).unlink(missing_ok=True)
                shutil.rmtree(path)
            path.mkdir(parents=True)
        state = {"trainer": trainer.state_dict()}
        phases.mark("state_dict")
        # Collective: the directory exists before any rank writes into it, and every rank
        # agrees whether the cached plan still fits (one all-reduce, in place of a barrier).
        reuse_plan = self._agree_plan_reuse(state)
        phases.mark("agree")
        engine = self.config.engine
        pending = _Pending(step=step, path=path, started=time.time())
        if engine == "sync":
            dcp.save(state, storage_writer=self._writer(path), planner=self._torch_planner())
            phases.mark("write")
            self._finalize(pending)
            phases.mark("commit")
        elif engine == "torch_async":
            # torch's async_save stages on the caller and writes in a background process.
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            # On CPU nothing copies the live tensors before the background write: clone them.
            staged = state if torch.cuda.is_available() else _snapshot(state)
            phases.mark("snapshot")
            pending.future = dcp.async_save(
                staged,
                storage_writer=self._writer(path),
                planner=self._torch_planner(),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            phases.mark("schedule")
            self._pending.append(pending)
        else:
            assert self._nvrx is not None
            self._start_worker()  # a save before any prepare (none in the trainer's loop)
            self._wait_for_own_writes()
            phases.mark("wait_previous")
            self._nvrx.schedule_save(
                state_dict=state,
                checkpoint_dir=str(path),
                reuse_plan=reuse_plan,
                after_write=partial(write_rank_manifest, str(path), self.rank),
                finalize=partial(self._finalize, pending),
                phases=phases.mark,
            )
            self._pending.append(pending)
        blocking_s = time.perf_counter() - started
        self.last_save_phases = dict(phases.seconds)
        self.last_plan_reused = reuse_plan
        self.events.emit(
            "checkpoint_staged",
            step=step,
            blocking_s=blocking_s,
            engine=engine,
            phases=self.last_save_phases,
            plan_reused=reuse_plan,
        )
        self.point_hook("staged", step)
        if blocking:
            self.wait()
        return blocking_s

    def _writer(self, path: Path) -> ChecksummingWriter:
        return ChecksummingWriter(path, rank=self.rank)

    def _torch_planner(self) -> CachingSavePlanner:
        return CachingSavePlanner(key=self._torch_plan_key)

    def _agree_plan_reuse(self, state: dict[str, Any]) -> bool:
        """Whether every rank's state has the structure of its cached plan (nvrx). Collective;
        a changed rank makes every rank plan afresh (the plan's collectives need all ranks)."""
        key = structure_key(state) if self._nvrx is not None else None
        fits = key is not None and key == self._plan_key and self._nvrx.has_plan()
        self._plan_key = key
        flag = torch.tensor([1 if fits else 0], dtype=torch.int32, device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _wait_for_own_writes(self) -> None:
        """Wait, in Python, until the worker has written this rank's earlier saves.

        The persistent worker writes one request at a time, and NVRx's schedule then blocks in
        ``JoinableQueue.join()`` (a wait inside C) until the worker has staged the new request,
        that is, after it finished the previous write. NVRx's in-process watchdog times out
        when either of its timestamps is stale (``progress_watchdog.py`` ``is_timed_out``), and
        the automatic one only moves while the main thread runs Python: a write slowed by a
        busy file system would read as a hang. Polling for the rank's manifest (written by the
        worker right after the files) keeps it moving; the wait is the same length."""
        for pending in list(self._pending):
            manifest = pending.path / SHARDS / f"rank_{self.rank:05d}.json"
            while not manifest.exists() and self._nvrx is not None and self._nvrx.worker_alive():
                self.keepalive()
                time.sleep(0.05)

    def save_local(self, trainer: StatefulTrainer, *, step: int) -> None:
        """GPU only: an NVRx local checkpoint of this rank's shard on node-local NVMe."""
        assert self._local is not None
        started = time.perf_counter()
        self._local.save(trainer, step=step)  # its own non-persistent queue (local_checkpoint.py)
        self._local_pending = True
        self.events.emit(
            "checkpoint_staged",
            step=step,
            engine="nvrx_local",
            blocking_s=time.perf_counter() - started,
        )

    def snapshot(self, trainer: StatefulTrainer, *, step: int) -> None:
        """A memory snapshot of ``trainer`` (in the pod's memory, or the process's: see
        :meth:`for_job`); nothing when snapshots are off. Local to this rank: no collective."""
        if self._memory is None and self._pod_memory is None:
            return
        started = time.perf_counter()
        if self._peer is not None:
            self._peer.settle()  # collective: the previous copies are in before a slot is reused
        if self._pod_memory_off:
            if self._peer is not None:
                self._peer.exchange(step=step)  # collective: sends nothing, receives the source's
            return
        if self._pod_memory is not None:
            try:
                self._pod_memory.take(trainer.state_dict(), step=step, keepalive=self.keepalive)
            except OSError as err:  # no room, or no mapping (PodMemorySnapshots.take)
                self._pod_memory_failed(err, step=step)
                if self._peer is not None:
                    self._peer.exchange(step=step)  # collective: sends nothing, receives
                return
            tier = "pod_memory"
        else:
            self._memory.take(
                trainer.state_dict(),
                owner=str(self.root),
                step=step,
                rank=self.rank,
                world_size=self.world_size,
            )
            tier = "memory"
        self.events.emit(
            "memory_snapshot", step=step, blocking_s=time.perf_counter() - started, tier=tier
        )
        if self._peer is not None:
            self._peer.exchange(step=step)  # collective: every rank snapshots at the same steps

    def _pod_memory_failed(self, err: Exception, *, step: int) -> None:
        """A pod-memory snapshot failed (no room in the tmpfs: ENOSPC from the reservation,
        or the CUDA registration of its mapping): this rank takes no more for the rest of the
        attempt, its snapshots go (their pages back to the pod), and restarts read storage.
        A warning and a ``memory_snapshot_off`` event say why; training goes on."""
        assert self._pod_memory is not None
        self._pod_memory.disable()
        self._pod_memory_off = True
        message = (
            f"pod-memory snapshots off on rank {self.rank} from step {step}: {err}; restarts "
            "restore from storage (free /dev/shm, or raise the pod's shm size)"
        )
        warnings.warn(message, stacklevel=3)
        print(f"WARNING: {message}", flush=True)
        self.events.emit("memory_snapshot_off", step=step, tier="pod_memory", reason=str(err))

    def before_update(self) -> None:
        """Call before the optimizer changes the state in place: on a GPU the compute stream
        waits for the newest snapshot's device-to-host copies (no host wait)."""
        if self._pod_memory is not None:
            self._pod_memory.before_update()
        if self._memory is not None:
            self._memory.before_update()

    @property
    def snapshots_in_memory(self) -> bool:
        """Whether :meth:`snapshot` takes snapshots (pod or process memory)."""
        return self._memory is not None or self._pod_memory is not None

    def poll(self) -> None:
        """Commit every save that all ranks have finished writing, and finish the NVRx worker's
        start once every rank's worker is up (collective; cheap when nothing is pending)."""
        if self._nvrx is not None:
            self._nvrx.await_worker(blocking=False)  # a no-op once the worker is up
        self._committer.raise_if_failed()
        if not self._pending and not self._local_pending:
            return
        if self._nvrx is not None:
            self._nvrx.poll(blocking=False)
        if self._local is not None and self._local_pending:
            self._local.poll(blocking=False)
            self._local_pending = self._local.pending() > 0
        if self.config.engine == "torch_async":
            self._poll_torch_async(blocking=False)

    def wait(self) -> None:
        """Block until every pending save is committed."""
        if self._nvrx is not None:
            self._nvrx.poll(blocking=True)
        if self._local is not None:
            self._local.poll(blocking=True, keepalive=self.keepalive)
            self._local_pending = False
        if self.config.engine == "torch_async" and self._pending:
            self._poll_torch_async(blocking=True)
        self._committer.drain(keepalive=self.keepalive)

    def _poll_torch_async(self, *, blocking: bool) -> None:
        while self._pending:
            head = self._pending[0]
            while blocking and not head.future.done():
                self.keepalive()
                time.sleep(0.05)
            done = torch.tensor(
                [1 if head.future.done() else 0], dtype=torch.int32, device=collective_device()
            )
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if not done.item():
                return
            head.future.result()  # re-raises a failed write; the manifest is written by then
            self._finalize(head)

    def _finalize(self, pending: _Pending) -> None:
        """Every rank's files are durable: rank 0 commits, then applies retention."""
        if pending in self._pending:
            self._pending.remove(pending)
        self.point_hook("written", pending.step)
        dist.barrier()  # every rank's manifest is on disk before rank 0 reads them
        if self.rank == 0:
            if self.config.engine == "sync":
                self._commit(pending)  # the synchronous engine: committed when save returns
            else:
                self._committer.submit(partial(self._commit, pending))
        self._latest_committed = pending.step

    def _commit(self, pending: _Pending) -> None:
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
        self._apply_retention()

    def _apply_retention(self) -> None:
        steps = committed_steps(self.root)
        for victim in retention_victims(
            steps, keep_last=self.config.keep_last, keep_every=self.config.keep_every
        ):
            path = step_dir(self.root, victim)
            # Drop the commit record first: a half-deleted directory is then merely torn.
            (path / COMMIT).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)

    # -- loading -------------------------------------------------------------------------------
    def _restore_candidates(self) -> list[tuple[int, RestoreTier]]:
        """Every (step, tier) some tier can restore on every rank: newest step first, the
        cheaper tier first at equal steps. Collective; listed once per manager."""
        if self._candidates is None:
            candidates = []
            for tier in self.tiers:
                steps = tier.steps()
                if tier is self._storage:
                    self._committed = steps
                candidates += [(step, tier) for step in steps]
            order = {id(tier): index for index, tier in enumerate(self.tiers)}
            candidates.sort(key=lambda c: (-c[0], order[id(c[1])]))
            self._candidates = candidates
        return self._candidates

    def resume_expected(self) -> bool:
        """Whether ``load_latest`` has something to load (collective): the trainer then skips
        initialising the weights it is about to overwrite."""
        if not self.config.resume:
            return False
        return bool(self._restore_candidates())

    def load_latest(self, trainer: StatefulTrainer) -> int | None:
        """Load the newest sound state into ``trainer`` from the cheapest tier that holds it;
        None if there is none.

        All ranks walk the same candidates (:meth:`_restore_candidates`) in the same order and
        agree on each verdict, so they always load the same step from the same tier. A rejected
        candidate (damaged, another structure) changes nothing and the next is tried; a tier's
        step older than the newest sound committed checkpoint is reached only after that
        checkpoint was rejected. Every load emits ``checkpoint_load`` with its ``source`` (the
        tier), ``seconds`` and ``bytes`` (this rank's state restored)."""
        if not self.config.resume:
            self._discard_newer(0)
            return None
        candidates = self._restore_candidates()
        newest_committed = max(self._committed, default=None)
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
            self._latest_committed = step if tier is self._storage else newest_committed
            self._discard_newer(step)
            return step
        self._discard_newer(0)  # a fresh start: every snapshot left is another timeline's
        if self._committed:
            raise CheckpointError(
                f"every committed checkpoint under {self.root} is damaged; "
                "move them aside to start fresh (checkpoint.resume=false ignores them)"
            )
        return None

    def _discard_newer(self, step: int) -> None:
        """Once ``step`` is restored (0: nothing was): every tier forgets what this rank holds
        of later steps, the timeline that died, so that no restart can offer it again and no
        snapshot of a replayed step sits beside one of the old timeline (on a GPU the two
        differ, and ranks could restore a mix). Each rank removes its own files and the peer
        copies it holds, before its first step: local, no collective. Storage keeps its
        committed checkpoints: one newer than ``step`` is there only when it was rejected as
        damaged, and every restore rejects it again (its next save replaces it)."""
        if self._memory is not None:
            self._memory.discard_newer(step)
        if self._pod_memory is not None:
            self._pod_memory.discard_newer(step)
            self._pod_memory.prune_other_nodes(local_world_size=self._local_world_size)
        if self._peer is not None:
            self._peer.discard_newer(step)
        if self._local is not None:
            self._local.discard_newer(step)


def needs_cpu_collectives(config: CheckpointConfig) -> bool:
    """Whether the checkpoint engine needs a CPU backend in the process group: torch's
    ``async_save`` (engine ``torch_async``) plans with collectives on CPU tensors and refuses a
    group without one, so on a GPU the group is "cpu:gloo,cuda:nccl" (training/parallel.py)."""
    return config.engine == "torch_async"


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: the rank's current CUDA device
    when the group's backend is NCCL (NCCL takes CUDA tensors only: ``ProcessGroupNCCL`` rejects
    a CPU tensor with "Tensors must be CUDA and dense"), the CPU otherwise (gloo). Mixed
    backends ("cpu:gloo,cuda:nccl") take CPU tensors on gloo, so only a pure NCCL group needs
    the device."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _nothing() -> None:
    pass


def _snapshot(state: Any) -> Any:
    """Deep copy of the tensors in a state dict (DTensors keep their sharding)."""
    if isinstance(state, dict):
        return {key: _snapshot(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_snapshot(value) for value in state]
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state
