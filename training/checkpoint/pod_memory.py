"""Snapshots of each rank's state in the pod's memory (``/dev/shm``): the ``pod_memory`` tier.

Every ``checkpoint.memory_interval`` steps each rank copies its shard of the state (local
DTensor shards, optimizer state, sampler, step, RNG) into one of two slots in
``checkpoint.pod_memory_dir`` (format and protocol: ``snapshot_files.py``). The directory is a
tmpfs that belongs to the pod (a memory-backed ``emptyDir``, manifests/render.py), not to a
rank: a SIGKILLed, frozen or OOM-killed rank's replacement, started by ``ft_launcher`` in the
same pod (``injob``, the dead-rank half of ``nested``), finds the snapshots and restores the
newest one every rank holds, when no sound checkpoint on storage is newer, instead of reading
the whole checkpoint back from FSx and replaying up to a checkpoint interval. In-process
restarts (``inprocess``, ``nested``) restore from the same files.

Each run's files live in ``<pod_memory_dir>/<run key>/`` (:func:`run_root`), the key a digest
of :func:`run_identity` (the checkpoint root and the launcher's rendezvous id, unique per job),
which every snapshot also carries as its owner: another run, or a later job of this one, never
restores them. :meth:`PodMemorySnapshots.close` removes them when the run ends (completed or
stopped with a final checkpoint), so a finished run leaves nothing in ``/dev/shm``.

Writing: on the CPU the copy is synchronous, in the training thread, straight into the mapped
file; the ``meta`` that completes the slot (and the CRC32, only when a peer copy carries it:
``checksum``) follow on a background thread. No room in the tmpfs is an ``OSError`` from
:meth:`PodMemorySnapshots.take` (``snapshot_files.reserve``), which the manager turns into
pod memory off on that rank, with a warning and an event. On a
GPU the mapping is registered with CUDA (``cudaHostRegister``), the copies run on a side stream
beside the next step's forward and backward, the optimizer's update waits for them on the
device (:meth:`before_update`), and the background thread waits for their event before the
CRC and the ``meta``.

Restoring: the newest snapshot of a step every rank holds, checked for its owner, rank, world
size, structure and size, then copied into the state in place (:meth:`PodMemorySnapshots.check`
says why its data gets no CRC32 pass).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from training.checkpoint import device_threads
from training.checkpoint import snapshot_files as sf
from training.checkpoint.tiers import (
    Rejected,
    Restored,
    RestoreTier,
    SnapshotTier,
    TierContext,
    agree,
    common_steps,
)
from training.runlog.metrics import EventLog
from training.runlog.verdict import RUN_ID_ENV

PUBLISH_POLL_S = 0.05
"""The longest pause between two ``keepalive`` calls while a publish is waited for."""


def run_identity(checkpoint_root: Path, *, launch: str = "") -> str:
    """The owner of a run's snapshots: its checkpoint root and the launcher's rendezvous id
    (``TORCHELASTIC_RUN_ID``: the same for every attempt of one job in one launcher, a new one
    for another job or a cold restart; `launch` gives it from outside the ranks). Without a
    launcher, the process id: only in-process restarts of this process restore them."""
    launch = launch or os.environ.get(RUN_ID_ENV) or f"pid-{os.getpid()}"
    return f"{Path(checkpoint_root).resolve()}#{launch}"


def run_root(pod_memory_dir: Path | str, owner: str) -> Path:
    """The run's directory under ``checkpoint.pod_memory_dir`` (the ``own`` and ``peer`` kinds
    live below it)."""
    return Path(pod_memory_dir) / f"run-{zlib.crc32(owner.encode()):08x}"


class PodMemorySnapshots:
    """One rank's snapshots in the pod's memory; see the module docstring.

    Use :meth:`for_rank`: attempts of one process (in-process restarts) share one object, so a
    publish still in flight from the previous attempt is joined before a slot is reused."""

    _LIVE: dict[tuple, PodMemorySnapshots] = {}

    @classmethod
    def for_rank(cls, *, root: Path, owner: str, rank: int, world_size: int) -> PodMemorySnapshots:
        key = (str(root), owner, rank, world_size)
        if key not in cls._LIVE:
            cls._LIVE[key] = cls(root=root, owner=owner, rank=rank, world_size=world_size)
        return cls._LIVE[key]

    def __init__(self, *, root: Path, owner: str, rank: int, world_size: int) -> None:
        self.root = Path(root)
        self.owner = owner
        self.rank = rank
        self.world_size = world_size
        self._files: dict[int, sf.SlotFile] = {}
        self._publisher: Any = None  # the publish thread of the newest snapshot
        self._copying: Any = None
        self._stream: Any = None
        self._failure: OSError | None = None
        self.last_take_s = 0.0
        self.checksum = False
        """Whether each snapshot's CRC32 is taken when it is published: only when it will
        cross the network (the peer copy checks it on arrival and before a restore); an own
        snapshot is restored without one (:meth:`check`), so a CRC pass nobody checks would
        cost a read of the shard per interval."""
        self._lock: int | None = None
        """A shared lock on the run's directory, taken at the start (:meth:`prune`) or the
        first snapshot, held for the life of the process: no other run prunes it meanwhile."""

    # -- taking --------------------------------------------------------------------------------
    @torch.no_grad()
    def take(
        self, state: dict[str, Any], *, step: int, keepalive: Callable[[], None] = lambda: None
    ) -> None:
        """Copy ``state`` (a trainer's ``state_dict()``) into the next slot; complete once the
        background publish is (:meth:`wait`)."""
        # The previous snapshot is published before its slot's neighbour is chosen.
        self.wait(keepalive=keepalive)
        if self._lock is None:
            self._lock = _hold_run_lock(self.root)
        if self._failure is not None:  # the previous publish failed (no room for its meta)
            failure, self._failure = self._failure, None
            raise failure
        meta = sf.meta_for(
            state, owner=self.owner, rank=self.rank, world_size=self.world_size, step=step
        )
        slot = sf.next_slot(self.root, kind="own", rank=self.rank, step=step)
        leaves, _ = sf.walk(state)
        device = next(
            (v.device for _, _, v in leaves if isinstance(v, torch.Tensor) and v.is_cuda), None
        )
        index = device_threads.device_index(device)
        target = self._slot_file(slot, nbytes=meta.nbytes, device=index)
        target.wait_pinned()  # the registration (started by ``prepare``, or just now) is done
        ready = None
        if device is None:
            sf.pack(state, target.data, meta)
        else:
            # On a side stream, after the step that made the state; the next step's forward and
            # backward only read it, and ``before_update`` holds the optimizer back.
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                sf.pack(state, target.data, meta)
                ready = torch.cuda.Event()
                ready.record(self._stream)
            self._copying = ready
        self._start_publish(target, meta, ready=ready, device=index)

    def _start_publish(
        self, target: sf.SlotFile, meta: sf.SnapshotMeta, *, ready: Any, device: int | None
    ) -> None:
        """The publish thread of a snapshot: it waits for the copies' event ``ready`` (None on
        the CPU), then writes the CRC32 and the meta. Bound to the rank's GPU first: the
        event's synchronize would otherwise bind (or create) a context on GPU 0 in it
        (``device_threads``)."""
        self._publisher = device_threads.start(
            self._publish,
            args=(target, meta, ready, self.checksum),
            name=f"pod-memory-publish-{meta.step}",
            device=device if ready is not None else None,
        )

    def prepare(self, state: dict[str, Any]) -> None:
        """Map both slots for snapshots of ``state`` and, on a GPU, start their CUDA
        registration in the background (``SlotFile``): the first snapshots of this process then
        find them pinned instead of registering on the training thread (seconds per slot of GBs,
        at every new process). A complete snapshot in a slot stays offered. Call once the
        state's structure is final (``CheckpointManager.prepare``, after the first step)."""
        self.wait()
        meta = sf.meta_for(
            state, owner=self.owner, rank=self.rank, world_size=self.world_size, step=0
        )
        leaves, _ = sf.walk(state)
        device = next(
            (v.device for _, _, v in leaves if isinstance(v, torch.Tensor) and v.is_cuda), None
        )
        for slot in range(sf.SLOTS):
            self._slot_file(
                slot,
                nbytes=meta.nbytes,
                device=device_threads.device_index(device),
                keep_meta=True,
            )

    def publication(self) -> Callable[[], None]:
        """A wait for the newest snapshot's publish that any thread may call (the peer
        exchange's, while the training thread goes on and may start the next snapshot)."""
        thread = self._publisher
        return _nothing if thread is None else thread.join

    def _slot_file(
        self, slot: int, *, nbytes: int, device: int | None, keep_meta: bool = False
    ) -> sf.SlotFile:
        current = self._files.get(slot)
        if current is not None and current.nbytes == nbytes and current.current():
            if not keep_meta:
                current.reopen()
            return current
        if current is not None:
            current.close()
        directory = sf.slot_dir(self.root, kind="own", rank=self.rank, slot=slot)
        self._files.pop(slot, None)
        try:
            self._files[slot] = sf.SlotFile(
                directory,
                nbytes=nbytes,
                pin=device is not None,
                device=device,
                keep_meta=keep_meta,
            )
        except RuntimeError as err:  # the mapping failed (a CUDA registration fails later:
            # SlotFile.wait_pinned warns and the copies go unpinned)
            problem = f"cannot map the snapshot in {directory}: {err}"
            raise OSError(errno.ENOMEM, problem) from err
        return self._files[slot]

    def _publish(
        self, target: sf.SlotFile, meta: sf.SnapshotMeta, ready: Any, checksum: bool
    ) -> None:
        if ready is not None:
            try:
                ready.synchronize()
            except RuntimeError:  # the device failed: the copies may not have finished
                return
        try:
            sf.publish(target.directory, sf.with_checksum(meta, target.data) if checksum else meta)
        except OSError as err:  # no room for the meta: raised by the next take
            self._failure = err

    def wait(self, *, keepalive: Callable[[], None] = lambda: None) -> None:
        """Until the newest snapshot is published (complete), calling ``keepalive`` every
        ``PUBLISH_POLL_S`` meanwhile (the CRC32 of a big shard takes seconds)."""
        if self._publisher is not None:
            while self._publisher.is_alive():
                self._publisher.join(timeout=PUBLISH_POLL_S)
                keepalive()
            self._publisher = None

    def before_update(self) -> None:
        """Call before the state changes in place (the optimizer step): on a GPU the compute
        stream waits for the newest snapshot's copies (no host wait); nothing otherwise."""
        if self._copying is not None:
            torch.cuda.current_stream().wait_event(self._copying)
            self._copying = None

    def discard_newer(self, step: int) -> list[int]:
        """After a restore of ``step`` (from any tier): remove this rank's snapshots of later
        steps, which belong to the timeline that died, before the replay writes its own
        snapshots of those steps; the steps removed. Local, no collective: every rank does
        this for its own files before its first step, whose collectives no rank passes alone,
        so no snapshot of the new timeline exists beside one of the old."""
        self.wait()
        self._failure = None
        return sf.discard_newer(self.root, kind="own", rank=self.rank, step=step)

    def disable(self) -> None:
        """A snapshot failed (no room in the tmpfs): drop this rank's snapshots and their
        mappings, giving their pages back to the pod (the tier has nothing whole to offer
        from here on; restarts read storage)."""
        self.close(remove=False)
        sf.remove_rank(self.root, kind="own", rank=self.rank)

    def prune(self) -> list[str]:
        """Remove what this pod's memory holds that no restore of this run can use: snapshots
        of another world size (an elastic restart: they are refused, and every shard grows),
        and other runs' directories no live process holds (:func:`prune_other_runs`). Safe
        before the restore: nothing removed here is ever offered. Returns what was removed."""
        if self._lock is None:
            self._lock = _hold_run_lock(self.root)
        removed = prune_other_runs(self.root.parent, keep=self.root)
        for kind in sf.KINDS:
            for rank in sf.held_ranks(self.root, kind=kind):
                for directory, meta in sf.list_snapshots(self.root, kind=kind, rank=rank):
                    if meta.world_size != self.world_size or meta.owner != self.owner:
                        sf.remove(directory)
                        removed.append(str(directory))
                        with contextlib.suppress(OSError):
                            directory.parent.rmdir()  # the rank's, once no slot is left
        return removed

    def prune_other_nodes(self, *, local_world_size: int) -> list[str]:
        """After the restore: remove the own snapshots of ranks that no longer run on this
        node (the rendezvous placed them on another; ranks are ``node * L .. node * L + L - 1``
        on node ``node``, torchrun's order). Not before: the peer tier may need them. No
        live rank writes them, so ranks of one pod may do this at once."""
        node = self.rank // max(local_world_size, 1)
        here = range(node * local_world_size, (node + 1) * local_world_size)
        removed = []
        for rank in sf.held_ranks(self.root, kind="own"):
            if rank not in here:
                sf.remove_rank(self.root, kind="own", rank=rank)
                removed.append(f"own/rank-{rank:05d}")
        return removed

    # -- restoring -----------------------------------------------------------------------------
    def held(self) -> list[tuple[Path, sf.SnapshotMeta]]:
        """This rank's complete snapshots of this run, newest first (local, no collective)."""
        self.wait()
        return [
            (path, meta)
            for path, meta in sf.list_snapshots(self.root, kind="own", rank=self.rank)
            if meta.refusal(owner=self.owner, rank=self.rank, world_size=self.world_size) is None
        ]

    def check(self, state: dict[str, Any], *, step: int) -> tuple[Path | None, str | None]:
        """The snapshot of ``step`` and None when it can be restored into ``state`` (complete,
        its data as long as its meta says, owner, rank, world size, structure); else why not.

        No CRC32 pass over the data. This rank of this run wrote it into this pod's memory (or
        received it from a peer and checked its CRC32 on arrival, ``peer.py``) and published it
        atomically once every byte was in place (``snapshot_files``: meta unlinked before a
        rewrite, written last), so a torn copy is never offered; its bytes crossed no disk and
        no network since, only the host memory that the live state lives in too, and a CRC pass
        would cost a full read of the shard on every restore (``bench/restore.py``). The CRC32
        taken at publish time goes with the copy sent to a peer, which checks it on arrival and
        again when it restores a peer's copy (``peer.py``)."""
        found = [(p, m) for p, m in self.held() if m.step == step]
        if not found:
            return None, f"no complete snapshot of step {step}"
        path, meta = found[0]
        key = sf.walk(state)[1]
        return path, meta.refusal(
            owner=self.owner, rank=self.rank, world_size=self.world_size, key=key
        )

    def restore(self, state: dict[str, Any], *, path: Path) -> int:
        """Copy the snapshot in ``path`` (checked) into ``state`` in place; returns its bytes."""
        meta = sf.read_meta(path)
        if meta is None:
            raise ValueError(f"{path}: the snapshot is no longer complete")
        sf.load(state, path, meta)
        return meta.nbytes

    # -- the end -------------------------------------------------------------------------------
    def close(self, *, remove: bool) -> None:
        """Release the mappings (and CUDA registrations); with ``remove`` (the run ended), delete
        this rank's files and the run's directory once no rank's are left."""
        with contextlib.suppress(RuntimeError):
            self.wait()
        for target in self._files.values():
            target.close()
        self._files.clear()
        if remove:
            sf.remove_rank(self.root, kind="own", rank=self.rank)
            if self._lock is not None:
                os.close(self._lock)  # the run is over (its other ranks hold their own)
                self._lock = None
            remove_run_dir_if_empty(self.root)
            self._LIVE.pop((str(self.root), self.owner, self.rank, self.world_size), None)


STALE_RUN_S = 600.0
"""Another run's directory is pruned once no process holds its lock and nothing in it changed
for this long: an in-job restart leaves its run's lock unheld for the seconds between the
ranks' death and their replacements' start, and must find its snapshots whole."""


LOCK = ".lock"


def _lock_path(run_dir: Path) -> Path:
    return run_dir / LOCK


def remove_run_dir_if_empty(run_dir: Path) -> None:
    """The last rank out removes the run's directory: once only its lock is left in it."""
    for kind in sf.KINDS:
        with contextlib.suppress(OSError):
            (run_dir / kind).rmdir()  # only when empty
    with contextlib.suppress(OSError):
        if {p.name for p in run_dir.iterdir()} <= {LOCK}:
            _lock_path(run_dir).unlink(missing_ok=True)
            run_dir.rmdir()


def _hold_run_lock(run_dir: Path) -> int | None:
    """A shared ``flock`` on the run's lock file, held for the life of the process (the kernel
    drops it when the process dies, SIGKILL included): while one is held, no other run prunes
    this run's directory."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(_lock_path(run_dir), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None  # a read-only or missing parent: the first snapshot says so
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _newest_change(directory: Path) -> float:
    """The newest modification under ``directory``, its lock aside (a pruner creates it)."""
    newest = 0.0
    for path in directory.rglob("*"):
        if path.name != LOCK:
            with contextlib.suppress(OSError):
                newest = max(newest, path.stat().st_mtime)
    return newest


def prune_other_runs(
    pod_memory_dir: Path, *, keep: Path, stale_after_s: float = STALE_RUN_S
) -> list[str]:
    """Remove the ``run-*`` directories under ``pod_memory_dir`` but ``keep`` that belong to
    runs no live process holds (their lock free: killed, ended, or a previous job) and that
    did not change for ``stale_after_s``; the directories removed. In a pod the emptyDir holds
    one job's runs; on a shared machine (the local launcher, benchmarks, tests) it holds other
    live runs too, which their lock keeps."""
    removed = []
    for directory in sorted(Path(pod_memory_dir).glob("run-*")):
        if directory == keep or not directory.is_dir():
            continue
        if time.time() - _newest_change(directory) < stale_after_s:
            continue
        try:
            fd = os.open(_lock_path(directory), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live run's
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(str(directory))
        finally:
            os.close(fd)
    return removed


class PodMemoryTier:
    """The ``pod_memory`` restore tier (``tiers.RestoreTier``) over a rank's snapshots."""

    name = "pod_memory"

    def __init__(self, snapshots: PodMemorySnapshots) -> None:
        self.snapshots = snapshots

    def steps(self) -> list[int]:
        return common_steps([meta.step for _, meta in self.snapshots.held()])

    def load(self, trainer: Any, *, step: int) -> Restored | Rejected:
        state = trainer.state_dict()
        path, problem = self.snapshots.check(state, step=step)
        problem = agree(problem)  # all ranks restore this step, or none does
        where = str(path or self.snapshots.root)
        if problem is not None:
            return Rejected(path=where, problem=problem)
        nbytes = self.snapshots.restore(state, path=path)
        trainer.load_state_dict(state)
        return Restored(path=where, nbytes=nbytes)


def _nothing() -> None:
    pass


class PodMemorySnapshotTier(SnapshotTier):
    """The ``pod_memory`` snapshot tier: every ``checkpoint.memory_interval`` steps a copy of
    the rank's state in the pod's ``/dev/shm`` (:class:`PodMemorySnapshots`). Local to the
    rank: no collective. A failed take turns it off for the rest of the attempt
    (:meth:`_failed`)."""

    name = "pod_memory"

    def __init__(
        self,
        *,
        snapshots: PodMemorySnapshots,
        interval: int,
        local_world_size: int,
        events: EventLog,
        keepalive: Callable[[], None] = _nothing,
    ) -> None:
        self.snapshots = snapshots
        self.interval = interval
        self.local_world_size = local_world_size
        self.events = events
        self.keepalive = keepalive
        self.off = False
        """A snapshot failed in this attempt: none is taken any more."""

    def restore_tiers(self) -> list[RestoreTier]:
        return [PodMemoryTier(self.snapshots)]

    def due(self, step: int, *, shared: bool) -> bool:
        return step % self.interval == 0  # also at a shared save's step, as ``memory``

    def start(self) -> None:
        # Before the restore, which may need room for a peer's copy: what no restore of this
        # run can use (another world size's snapshots, dead runs' directories).
        self.snapshots.prune()

    def prepare(self, trainer: Any) -> None:
        self.snapshots.prepare(trainer.state_dict())  # slots mapped, pinned off-thread

    def take(self, trainer: Any, *, step: int) -> None:
        if self.off:
            return
        started = time.perf_counter()
        try:
            self.snapshots.take(trainer.state_dict(), step=step, keepalive=self.keepalive)
        except OSError as err:  # no room, or no mapping (PodMemorySnapshots.take)
            self._failed(err, step=step)
            return
        self.events.emit(
            "memory_snapshot", step=step, blocking_s=time.perf_counter() - started, tier=self.name
        )

    def _failed(self, err: Exception, *, step: int) -> None:
        """A snapshot failed (no room in the tmpfs: ENOSPC from the reservation, or the CUDA
        registration of its mapping): this rank takes no more for the rest of the attempt, its
        snapshots go (their pages back to the pod), and restarts read storage. A warning and a
        ``memory_snapshot_off`` event say why; training goes on."""
        self.snapshots.disable()
        self.off = True
        message = (
            f"pod-memory snapshots off on rank {self.snapshots.rank} from step {step}: {err}; "
            "restarts restore from storage (free /dev/shm, or raise the pod's shm size)"
        )
        warnings.warn(message, stacklevel=3)
        print(f"WARNING: {message}", flush=True)
        self.events.emit("memory_snapshot_off", step=step, tier=self.name, reason=str(err))

    def before_update(self) -> None:
        self.snapshots.before_update()

    def discard_newer(self, step: int) -> None:
        self.snapshots.discard_newer(step)
        self.snapshots.prune_other_nodes(local_world_size=self.local_world_size)

    def release(self) -> None:
        self.snapshots.close(remove=True)  # nor into this pod: /dev/shm is left empty

    def abandon(self) -> None:
        pass  # a restart that keeps the pod restores from it


def snapshot_tier(context: TierContext) -> PodMemorySnapshotTier | None:
    """The registry's row: on when ``training.modes.snapshot_plan`` picks the pod's memory."""
    if context.plan.tier != "pod_memory":
        return None
    owner = run_identity(context.root)
    snapshots = PodMemorySnapshots.for_rank(
        root=run_root(context.config.pod_memory_dir, owner),
        owner=owner,
        rank=context.rank,
        world_size=context.world_size,
    )
    snapshots.checksum = False  # the peer tier turns it on for a copy that travels
    return PodMemorySnapshotTier(
        snapshots=snapshots,
        interval=context.config.memory_interval,
        local_world_size=context.local_world_size,
        events=context.events,
        keepalive=context.keepalive,
    )
