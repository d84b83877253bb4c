"""A copy of each node's newest pod-memory snapshot in another node's memory, and the restore of
a lost node's shards from it.

Ring over nodes. Rank r's copy is held by the rank with the same local rank on the next node,
``(r + L) mod W`` (W ranks, L per node): every node holds the copies of the node before it, so
one lost node's shards all survive on its successor. One node has no other node to hold its
copies: the copy is then off, with the reason logged (:func:`ring_problem`), not refused as a
configuration error: the node count is the rendezvous's, not the config's (an elastic job that
shrinks to one node keeps training), and the same recipe runs on one node and on sixteen.

The exchange (:meth:`PeerCopies.exchange`, after each pod-memory snapshot, every
``checkpoint.memory_interval`` steps). Every rank sends its own snapshot of that step (``meta``
and ``data``, ``snapshot_files``) to its holder and receives its source's into its pod's
``/dev/shm`` as kind ``peer``, in the slot-by-slot protocol of ``snapshot_files`` (the meta
unlinked first, the data received straight into the slot's mapping, kept mapped from one
exchange to the next, its CRC32 taken bucket by bucket as it lands, the meta published last),
in buckets (``transfer.py``, two rounds on the wire at once). It runs beside training: before
each snapshot every rank waits until every previous exchange is over (:meth:`PeerCopies.settle`:
at once, unless one outlasted a memory interval), and after it the training thread creates the
exchange's own gloo group at the first exchange (collective, same order on every rank) and
starts the exchange thread, which waits for the snapshot's publish and does the rest.
gloo, not the job's NCCL: a second NCCL communicator used from another thread beside the
training's collectives may deadlock (:meth:`PeerCopies._exchange_group`); gloo moves the host
mappings themselves, without staging or device memory, over the pod's TCP network.
Cost per node and interval: it sends the shards of its L ranks and receives as many, i.e. the
node's share of the state (``W / L`` nodes): 12 bytes per parameter (fp32 sharded params,
AdamW's two fp32 moments), so ``p5_70b`` (70.6B) on 16 nodes sends and receives ~52.9 GB per
node per interval: 0.13 s at EFA's 3,200 Gb/s (32 x 100 Gb/s), ~4.2 s at 100 Gb/s of TCP, in the
background; the training thread pays one all-reduce and a thread start
(``bench/peer.py`` measures both against the wire floor; docs/restore-tiers.md, "Peer copy").
Memory: each node's ``/dev/shm`` holds two own slots and two peer slots, 197.1 GiB of the pod's
256 GiB ``shm`` limit at 70B / 16. The exchange thread never calls ``keepalive``: a training
thread that hangs must not look alive; :meth:`PeerCopies.wait` (the run's end) does.

The restore (:meth:`PeerCopies.restore`), when some rank has no snapshot of its own (a pod
replaced after its node was lost). Every rank lists what its pod holds, own and peer copies, by
saved rank and step (``all_gather_object``); the ranks pick the newest step S, not older than
the floor the manager gives (the newest sound committed checkpoint), of which every saved rank's
shard is somewhere. Ranks are matched by saved rank, not by position: after the rendezvous has
permuted ranks across nodes, rank q restores shard q wherever it lies. A rank whose pod holds
shard q reads it there; otherwise a rank whose pod holds it sends it, the same local rank
first (the copy lands as the rank's own snapshot, so a later in-pod restart finds it there).
Every rank checks its shard's meta (run, rank, world size, structure) and, for a copy that
crossed the network (received now, or a peer's copy held in its pod), its CRC32; the ranks
agree (every verdict gathered, ``tiers.agree``) before any state changes: a damaged or missing
shard rejects the step on every rank (the manager's ``checkpoint_rejected`` names the problem)
and the manager falls back to the next tier (storage). Two simultaneous losses, a node and its
holder, lose that node's shards from memory altogether: no step is complete in memory, and the
run restores from storage.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.checkpoint import device_threads
from training.checkpoint import snapshot_files as files
from training.checkpoint.layout import crc32
from training.checkpoint.pod_memory import PodMemorySnapshotTier, remove_run_dir_if_empty
from training.checkpoint.tiers import (
    Rejected,
    Restored,
    RestoreTier,
    SnapshotTier,
    TierContext,
    agree,
    state_bytes,
)
from training.checkpoint.transfer import (
    BUCKET_BYTES,
    Incoming,
    Outgoing,
    transfer,
    transfer_device,
)
from training.config import CheckpointConfig
from training.runlog.metrics import EventLog

log = logging.getLogger(__name__)

SOURCE = "peer"
"""The restore source's name in events and in the tiers' order."""


def ring_problem(*, world_size: int, local_world_size: int) -> str | None:
    """Why no ring of nodes can hold the copies (None when one can)."""
    if local_world_size < 1 or world_size % local_world_size:
        return (
            f"the world ({world_size} ranks) is not whole nodes of {local_world_size} ranks "
            "(LOCAL_WORLD_SIZE)"
        )
    if world_size // local_world_size < 2:
        return "the job runs on one node: no other node's memory can hold its copy"
    return None


def holder_of(rank: int, *, world_size: int, local_world_size: int) -> int | None:
    """The rank that holds ``rank``'s copy: the same local rank on the next node."""
    if ring_problem(world_size=world_size, local_world_size=local_world_size):
        return None
    return (rank + local_world_size) % world_size


def source_of(rank: int, *, world_size: int, local_world_size: int) -> int | None:
    """The rank whose copy ``rank`` holds: the same local rank on the node before."""
    if ring_problem(world_size=world_size, local_world_size=local_world_size):
        return None
    return (rank - local_world_size) % world_size


@dataclass(frozen=True)
class Held:
    """One complete snapshot in this pod's memory, by the rank it was saved by."""

    kind: files.Kind
    rank: int
    step: int
    directory: Path


def for_job(
    *,
    config: CheckpointConfig,
    root: Path,
    owner: str,
    rank: int,
    world_size: int,
    events: EventLog,
    published: Callable[[], None],
    keepalive: Callable[[], None] = lambda: None,
) -> PeerCopies | None:
    """The job's peer copies when ``checkpoint.peer_copy`` asks for them (None otherwise):
    ``root`` and ``owner`` are the pod-memory snapshots' (``pod_memory.run_root``,
    ``run_identity``), ``published`` waits until the newest own snapshot is complete,
    ``keepalive`` is called between the transfers' rounds (``StepHooks.keepalive``). The
    nodes are torchrun's: ``LOCAL_WORLD_SIZE`` ranks each. On one node it is off, said once."""
    if not config.peer_copy:
        return None
    copies = PeerCopies(
        root=root,
        owner=owner,
        rank=rank,
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        events=events,
        published=published,
        keepalive=keepalive,
    )
    copies.announce()
    return copies if copies.enabled else None


class PeerCopies:
    """This rank's side of the ring (see the module docstring). Collective methods: call on
    every rank at the same point."""

    _IN_FLIGHT: dict[tuple[str, int], threading.Thread] = {}
    """The exchange thread of each (root, rank) in this process, across attempts: an
    in-process restart's new object sees the previous attempt's exchange still running."""

    def __init__(
        self,
        *,
        root: Path,
        owner: str,
        rank: int,
        world_size: int,
        local_world_size: int,
        events: EventLog,
        staging: torch.device | str | None = "auto",
        bucket_bytes: int = BUCKET_BYTES,
        published: Callable[[], Callable[[], None]] = lambda: _nothing,
        keepalive: Callable[[], None] = lambda: None,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        self.root = Path(root)
        self.owner = owner
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.events = events
        self._staging = staging
        self.bucket_bytes = bucket_bytes
        self._published = published
        self.keepalive = keepalive
        self.problem = ring_problem(world_size=world_size, local_world_size=local_world_size)
        self.holder = holder_of(rank, world_size=world_size, local_world_size=local_world_size)
        self.source = source_of(rank, world_size=world_size, local_world_size=local_world_size)
        self._pruned = False
        self.timeout = timeout
        self._key = (str(self.root), rank)
        self._group: dist.ProcessGroup | None = None
        self._slots: dict[int, files.SlotFile] = {}
        self._abandoned = False
        self._settle_s = 0.0
        self.last_blocked_s = 0.0
        """Seconds the training thread spent in the last :meth:`settle` and :meth:`exchange`."""
        self.last_exchange_s = 0.0
        """Seconds the last exchange took on its thread, start to publish."""

    @property
    def enabled(self) -> bool:
        return self.problem is None

    def announce(self) -> None:
        """Say once, on rank 0, that the copy is off and why (a log line and an event)."""
        if self.problem is not None and self.rank == 0:
            log.warning("peer copy of pod-memory snapshots off: %s", self.problem)
            print(f"peer copy of pod-memory snapshots off: {self.problem}", flush=True)
            self.events.emit("peer_copy_off", reason=self.problem)

    def staging(self) -> torch.device | None:
        if self._staging == "auto":
            return transfer_device()
        return self._staging  # type: ignore[return-value]

    # -- the exchange after each snapshot -------------------------------------------------------
    def settle(self) -> None:
        """Before the next pod-memory snapshot (collective, on the training thread): until every
        rank's exchange in flight is over (each waits for its own, then one all-reduce). A
        snapshot overwrites its rank's older own slot, so a snapshot taken while some copy of
        the newest step is still on its way would leave no step whole in memory after a node
        loss: the own slots one step ahead of the copies. Training waits here only when an
        exchange outlasts a memory interval (event ``peer_copy_waited``)."""
        if not self.enabled:
            return
        started = time.perf_counter()
        busy = self.in_flight()
        self.wait()
        if busy:
            self.events.emit("peer_copy_waited", seconds=time.perf_counter() - started)
        _everyone(True)
        self._settle_s = time.perf_counter() - started

    def exchange(self, *, step: int | None = None, blocking: bool = False) -> bool:
        """Start sending this rank's own snapshot of ``step`` (the one just taken; None: the
        newest) to its holder and receiving its source's into this pod's memory (kind
        ``peer``), on the exchange thread; returns whether it started. The step is fixed here:
        by the time the thread sends, a newer snapshot may be complete. Collective over every
        rank, on the training thread, at the same step everywhere (the manager's snapshot
        steps), after :meth:`settle` and the snapshot.

        The training thread only creates the exchange group the first time and starts the
        thread: the wait for the snapshot's publish, the transfer and the checksum on arrival
        all run beside the next steps. ``last_blocked_s``: the training thread's time in
        :meth:`settle` and here."""
        if not self.enabled:
            return False
        assert self.holder is not None and self.source is not None
        started = time.perf_counter()
        self.wait()  # a no-op after settle
        group = self._exchange_group()
        wait_published = self._published()
        self._abandoned = False
        thread = device_threads.start(
            self._exchange,
            args=(wait_published, group, step, time.perf_counter()),
            name=f"peer-exchange-{self.rank}",
            device=device_threads.current_device(),
        )
        PeerCopies._IN_FLIGHT[self._key] = thread
        self.last_blocked_s = self._settle_s + time.perf_counter() - started
        self._settle_s = 0.0
        if blocking:
            self.wait()
        return True

    def wait(self, *, keepalive: Callable[[], None] | None = None) -> None:
        """Until this rank's exchange in flight (if any) is over, calling ``keepalive`` (the
        restart layer's heartbeat) meanwhile: the exchange thread itself never calls it, or a
        training thread that hangs would look alive."""
        keepalive = keepalive or self.keepalive
        thread = PeerCopies._IN_FLIGHT.get(self._key)
        while thread is not None and thread.is_alive():
            thread.join(timeout=_POLL_S)
            keepalive()
        if thread is not None and PeerCopies._IN_FLIGHT.get(self._key) is thread:
            del PeerCopies._IN_FLIGHT[self._key]

    def in_flight(self) -> bool:
        thread = PeerCopies._IN_FLIGHT.get(self._key)
        return thread is not None and thread.is_alive()

    def abandon(self) -> None:
        """After a fault (no collective): the exchange in flight publishes nothing more. Its
        thread is not waited for: the restart layer releases its blocked transfer (NVRx's
        abort, or the gloo sockets shut, ``resilience/gloo_abort.py``); the next attempt's
        first :meth:`settle` waits for it (the thread is known by root and rank)."""
        self._abandoned = True

    def _exchange_group(self) -> dist.ProcessGroup:
        """The exchange's own gloo process group, created at the first exchange (collective:
        every rank reaches it at the same snapshot step, the order of group creation is the
        same everywhere). gloo, whatever the default backend: the exchange runs on its own
        thread beside the training's NCCL collectives, and NCCL gives no guarantee for two
        communicators used at once (its user guide, "Using multiple NCCL communicators
        concurrently": operations on different communicators must not overlap, or be issued
        in the same order on every rank, which a background thread cannot ensure). gloo sends
        the host mappings themselves: no staging, no device memory."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    def _exchange(
        self,
        wait_published: Callable[[], None],
        group: dist.ProcessGroup,
        step: int | None,
        started: float,
    ) -> None:
        """The exchange thread (see :meth:`exchange`); a failure is reported, not raised: the
        restart layer handles a lost peer, and training goes on either way."""
        try:
            wait_published()  # the snapshot just taken is complete (its CRC32 and meta written)
            self._prune()
            own = self._own(step)
            if own is not None:
                directory, meta = own
                outgoing = Outgoing(
                    dst=self.holder, meta=meta.to_bytes(), data=files.map_data(directory, meta)
                )
            else:  # nothing complete yet: an empty message keeps the ranks in step
                outgoing = Outgoing(dst=self.holder, meta=b"", data=_EMPTY)
            arrival = _RunningCrc()
            slot: list[files.SlotFile] = []
            (received,) = transfer(
                outgoing=[outgoing],
                incoming=[
                    Incoming(
                        src=self.source,
                        into=lambda blob, n: self._peer_slot(blob, n, slot),
                        landed=arrival.update,
                    )
                ],
                group=group,
                bucket_bytes=self.bucket_bytes,
            )
            problem = self._publish(received, slot[0] if slot else None, crc=arrival.value)
        except Exception as err:  # a peer lost mid-transfer, a full /dev/shm...
            own, problem = None, f"the exchange failed: {type(err).__name__}: {err}"
            outgoing = Outgoing(dst=self.holder, meta=b"", data=_EMPTY)
            received = None
        seconds = time.perf_counter() - started
        self.last_exchange_s = seconds
        if problem is not None:
            message = f"peer copy from rank {self.source} not kept: {problem}"
            warnings.warn(message, stacklevel=2)
            print(f"WARNING: {message}", flush=True)
        self.events.emit(
            "peer_copy",
            step=None if own is None else own[1].step,
            to=self.holder,
            sent_bytes=outgoing.data.numel(),
            received_bytes=0 if received is None else received.data.numel(),
            seconds=seconds,
            problem=problem,
        )

    def _own(self, step: int | None) -> tuple[Path, files.SnapshotMeta] | None:
        """This rank's complete own snapshot of ``step`` (None: the newest), if any. A slot
        rewritten while it is sent is caught by the CRC32 on arrival (never published)."""
        for directory, meta in files.list_snapshots(self.root, kind="own", rank=self.rank):
            refusal = meta.refusal(owner=self.owner, rank=self.rank, world_size=self.world_size)
            if refusal is None and (step is None or meta.step == step):
                return directory, meta
        return None

    def _peer_slot(
        self, blob: bytes, nbytes: int, out: list[files.SlotFile]
    ) -> torch.Tensor | None:
        """The receive buffer of a peer copy: the next peer slot of its rank, its mapping kept
        from one exchange to the next (no fresh pages to fault in each interval); None (the
        data dropped, the ranks still in step) when the message is empty or unusable."""
        meta = _meta_or_none(blob)
        if meta is None or meta.nbytes != nbytes or meta.rank != self.source:
            return None
        slot = files.next_slot(self.root, kind="peer", rank=meta.rank, step=meta.step)
        target = self._slots.get(slot)
        if target is not None and target.nbytes == nbytes and target.current():
            target.reopen()
        else:
            if target is not None:
                target.close()
            directory = files.slot_dir(self.root, kind="peer", rank=meta.rank, slot=slot)
            try:
                target = self._slots[slot] = files.SlotFile(directory, nbytes=nbytes)
            except OSError as err:  # no room in /dev/shm: drop it, but answer the sender
                self._slots.pop(slot, None)
                message = f"peer copy from rank {self.source} dropped: {err}"
                warnings.warn(message, stacklevel=2)
                print(f"WARNING: {message}", flush=True)
                return None
        out.append(target)
        return target.data

    def _publish(self, received: Any, target: files.SlotFile | None, *, crc: int) -> str | None:
        """Publish a received copy once its bytes (CRC32 ``crc``, taken as they landed) match
        its meta's CRC32; the problem otherwise."""
        if not received.meta:
            return None  # the source had no snapshot yet
        meta = _meta_or_none(received.meta)
        if meta is None:
            return "its meta is unreadable"
        refusal = meta.refusal(owner=self.owner, rank=self.source, world_size=self.world_size)
        if refusal is not None or target is None:
            return refusal or "its size differs from its meta"
        if crc != meta.crc32:
            return f"data fails its checksum on arrival (CRC32 {crc:08x}, meta {meta.crc32:08x})"
        if self._abandoned:
            return "abandoned after a fault (not published)"
        files.publish(target.directory, meta)
        return None

    def _prune(self) -> None:
        """Once per manager: drop peer copies this pod no longer holds for (the ranks were
        placed anew by the rendezvous). Every rank of the pod computes the same set."""
        if self._pruned:
            return
        self._pruned = True
        node = self.rank // self.local_world_size
        kept = {
            source_of(r, world_size=self.world_size, local_world_size=self.local_world_size)
            for r in range(node * self.local_world_size, (node + 1) * self.local_world_size)
        }
        base = self.root / "peer"
        for directory in sorted(base.glob("rank-*")) if base.is_dir() else []:
            with contextlib.suppress(ValueError):
                if int(directory.name.split("-", 1)[1]) not in kept:
                    files.remove_rank(self.root, kind="peer", rank=int(directory.name[5:]))

    def discard_newer(self, step: int) -> list[int]:
        """After a restore of ``step``: remove the copies this rank holds (its source's) of
        later steps, a dead timeline's (``PodMemorySnapshots.discard_newer`` says why no
        collective is needed), and the copies this pod no longer holds for (:meth:`_prune`);
        the steps removed."""
        self._prune()
        if self.source is None:
            return []
        return files.discard_newer(self.root, kind="peer", rank=self.source, step=step)

    def close(self) -> None:
        """The run ended: wait for the exchange in flight, then remove the copies this rank
        holds (its source's), as the pod-memory snapshots remove their own, so a finished run
        leaves nothing in ``/dev/shm``."""
        self.wait()
        for target in self._slots.values():
            target.close()
        self._slots.clear()
        if self._group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)
            self._group = None
        if self.source is not None:
            files.remove_rank(self.root, kind="peer", rank=self.source)

    # -- the restore --------------------------------------------------------------------------
    def holdings(self) -> list[Held]:
        """The complete snapshots of this run and world size in this pod, own and peer, newest
        first (every rank's: a pod's memory is shared by its ranks)."""
        held = []
        for kind in files.KINDS:
            for directory, meta in files.list_snapshots(self.root, kind=kind):
                refusal = meta.refusal(owner=self.owner, rank=meta.rank, world_size=self.world_size)
                if refusal is None:
                    held.append(
                        Held(kind=kind, rank=meta.rank, step=meta.step, directory=directory)
                    )
        return held

    def complete_steps(self) -> tuple[list[int], list[set[tuple[int, int]]], list[Held]]:
        """The steps of which every saved rank's shard is held in some pod, newest first; what
        every rank's pod holds, as (saved rank, step); this pod's holdings. Collective."""
        mine = self.holdings()
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, [(h.rank, h.step) for h in mine])
        pods = [{(rank, step) for rank, step in held} for held in gathered]
        everyone = set(range(self.world_size))
        steps = sorted({step for held in pods for _, step in held}, reverse=True)
        complete = [
            step
            for step in steps
            if {rank for held in pods for rank, s in held if s == step} >= everyone
        ]
        return complete, pods, mine

    def restore(
        self,
        state: dict[str, Any],
        *,
        step: int,
        pods: list[set[tuple[int, int]]],
        mine: list[Held],
    ) -> tuple[str | None, str, int]:
        """Put this rank's shard of ``step`` (held somewhere, see :meth:`complete_steps`) into
        ``state`` in place, once every rank has checked its own (collective). Returns the
        problem (None when restored; every rank then gets the same one and ``state`` is
        unchanged everywhere), where the shard came from, and the bytes this rank received."""
        # Who sends what: for each rank whose pod lacks its shard, a rank whose pod holds it
        # (matched by saved rank: the rendezvous may have placed ranks anew), the one of the
        # same local rank first, so each GPU's own network interfaces carry one shard.
        lws = self.local_world_size
        senders = {
            q: min(
                (p for p in range(self.world_size) if (q, step) in pods[p]),
                key=lambda p, q=q: (p % lws != q % lws, p),
            )
            for q in range(self.world_size)
            if (q, step) not in pods[q]
        }
        outgoing = []
        for q, p in sorted(senders.items()):
            if p != self.rank:
                continue
            held = next(h for h in mine if h.rank == q and h.step == step)
            meta = files.read_meta(held.directory)
            outgoing.append(
                Outgoing(
                    dst=q,
                    meta=b"" if meta is None else meta.to_bytes(),
                    data=_EMPTY if meta is None else files.map_data(held.directory, meta),
                )
            )
        slot: list[files.SlotFile] = []
        incoming = []
        arrival = _RunningCrc()
        if self.rank in senders:
            incoming = [
                Incoming(
                    src=senders[self.rank],
                    into=lambda blob, n: self._own_slot(blob, n, slot),
                    landed=arrival.update,
                )
            ]
        key = files.walk(state)[1]
        received_bytes = 0
        directory: Path | None = None
        try:
            received = transfer(
                outgoing=outgoing,
                incoming=incoming,
                staging=self.staging(),
                bucket_bytes=self.bucket_bytes,
                keepalive=self.keepalive,
            )
            if received:
                received_bytes = received[0].data.numel()
                meta = _meta_or_none(received[0].meta)
                where = f"{SOURCE}: rank {senders[self.rank]}"
                problem = self._check(meta, key=key)
                if problem is None and not slot:
                    problem = "its size differs from its meta"
                if problem is None:
                    assert meta is not None
                    crc = arrival.value  # taken as the buckets landed
                    if crc != meta.crc32:
                        problem = (
                            f"the copy from rank {senders[self.rank]} fails its checksum "
                            f"(CRC32 {crc:08x}, meta {meta.crc32:08x})"
                        )
                if problem is None:
                    assert meta is not None
                    # Now this rank's own snapshot: a later in-pod restart finds it there.
                    files.publish(slot[0].directory, meta)
                    directory = slot[0].directory
            else:
                local = next(h for h in mine if h.rank == self.rank and h.step == step)
                where = str(local.directory)
                meta = files.read_meta(local.directory)
                problem = self._check(meta, key=key)
                if problem is None and local.kind == "peer":
                    # A copy that crossed the network is checked again; an own snapshot is
                    # not (``PodMemorySnapshots.check`` says why).
                    assert meta is not None
                    problem = files.verify(local.directory, meta)
                directory = local.directory
        finally:
            for target in slot:
                target.close()
        problem = agree(problem)
        if problem is not None:
            for target in slot:
                files.remove(target.directory)  # never published; nothing half-written stays
            return problem, where, received_bytes
        assert directory is not None and meta is not None
        files.load(state, directory, meta)
        return None, where, received_bytes

    def _own_slot(self, blob: bytes, nbytes: int, out: list[files.SlotFile]) -> torch.Tensor | None:
        """The receive buffer of this rank's shard: its next own slot, mapped (None when the
        meta is unusable: the bytes still arrive, and are dropped)."""
        meta = _meta_or_none(blob)
        if meta is None or meta.nbytes != nbytes:
            return None
        slot = files.next_slot(self.root, kind="own", rank=self.rank, step=meta.step)
        try:
            target = files.SlotFile(
                files.slot_dir(self.root, kind="own", rank=self.rank, slot=slot), nbytes=nbytes
            )
        except OSError:  # no room: the shard is dropped, the step refused on every rank
            return None
        out.append(target)
        return target.data

    def _check(self, meta: files.SnapshotMeta | None, *, key: tuple) -> str | None:
        if meta is None:
            return "its meta is unreadable"
        return meta.refusal(owner=self.owner, rank=self.rank, world_size=self.world_size, key=key)


class PeerTier:
    """The ``peer`` restore tier (``tiers.RestoreTier``): a step every rank's shard of which is
    in some pod's memory, own or peer, fetched from the pod that holds it."""

    name = SOURCE

    def __init__(self, copies: PeerCopies) -> None:
        self.copies = copies
        self._found: tuple[list[set[tuple[int, int]]], list[Held]] | None = None

    def steps(self) -> list[int]:
        if not self.copies.enabled:
            return []
        steps, pods, mine = self.copies.complete_steps()
        self._found = (pods, mine)
        return steps

    def load(self, trainer: Any, *, step: int) -> Restored | Rejected:
        assert self._found is not None, "steps() first"
        pods, mine = self._found
        state = trainer.state_dict()
        problem, where, _ = self.copies.restore(state, step=step, pods=pods, mine=mine)
        if problem is not None:
            if self.copies.rank == 0:
                message = f"peer copy of step {step} refused ({problem}); falling back"
                warnings.warn(message, stacklevel=2)
                print(f"WARNING: {message}", flush=True)
            return Rejected(path=where, problem=problem)
        trainer.load_state_dict(state)
        return Restored(path=where, nbytes=state_bytes(state))


class PeerSnapshotTier(SnapshotTier):
    """The ``peer`` snapshot tier: the pod-memory tier it wraps, plus the exchange of each
    snapshot with the ring's neighbours. Each take is collective: every rank settles the
    previous exchange before a slot is reused, snapshots (unless the pod-memory tier is off:
    then it sends nothing and still receives its source's), and starts the next exchange."""

    name = SOURCE

    def __init__(self, *, pod_memory: PodMemorySnapshotTier, copies: PeerCopies) -> None:
        self.wraps = self.pod_memory = pod_memory
        self.copies = copies

    def restore_tiers(self) -> list[RestoreTier]:
        return [*self.pod_memory.restore_tiers(), PeerTier(self.copies)]

    def due(self, step: int, *, shared: bool) -> bool:
        return self.pod_memory.due(step, shared=shared)

    def start(self) -> None:
        self.pod_memory.start()

    def prepare(self, trainer: Any) -> None:
        self.pod_memory.prepare(trainer)

    def take(self, trainer: Any, *, step: int) -> None:
        self.copies.settle()  # collective: the previous copies are in before a slot is reused
        self.pod_memory.take(trainer, step=step)
        self.copies.exchange(step=step)  # collective: every rank snapshots at the same steps

    def before_update(self) -> None:
        self.pod_memory.before_update()

    def discard_newer(self, step: int) -> None:
        self.pod_memory.discard_newer(step)
        self.copies.discard_newer(step)

    def release(self) -> None:
        self.pod_memory.release()
        self.copies.close()
        remove_run_dir_if_empty(self.pod_memory.snapshots.root)

    def abandon(self) -> None:
        self.copies.abandon()  # its exchange thread publishes nothing more
        self.pod_memory.abandon()


def snapshot_tier(context: TierContext) -> PeerSnapshotTier | None:
    """The registry's row: on over the pod-memory tier (built by the row above) when
    ``checkpoint.peer_copy`` asks for it and the ring has a neighbour (:func:`for_job`)."""
    pod_memory = next((t for t in context.built if isinstance(t, PodMemorySnapshotTier)), None)
    if pod_memory is None:
        return None
    snapshots = pod_memory.snapshots
    copies = for_job(
        config=context.config,
        root=snapshots.root,
        owner=snapshots.owner,
        rank=context.rank,
        world_size=context.world_size,
        events=context.events,
        published=snapshots.publication,
        keepalive=context.keepalive,
    )
    if copies is None:
        return None
    snapshots.checksum = True  # a CRC32 only for a copy that travels
    return PeerSnapshotTier(pod_memory=pod_memory, copies=copies)


_EMPTY = torch.empty(0, dtype=torch.uint8)


_POLL_S = 0.05
"""The longest pause between two ``keepalive`` calls while an exchange is waited for."""


def _nothing() -> None:
    pass


def _everyone(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (collective: one all-reduce of one int)."""
    device = transfer_device() or torch.device("cpu")
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


class _RunningCrc:
    """CRC32 of the buckets of a message, updated as each lands (ISA-L releases the GIL)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, part: torch.Tensor) -> None:
        self.value = crc32(memoryview(part.numpy()).cast("B"), self.value)


def _meta_or_none(blob: bytes) -> files.SnapshotMeta | None:
    if not blob:
        return None
    try:
        return files.SnapshotMeta.from_bytes(blob)
    except (ValueError, pickle.UnpicklingError, EOFError, AttributeError, TypeError):
        return None
