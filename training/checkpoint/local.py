"""NVRx local checkpoints on the node's NVMe (GPU only).

A second, faster tier beside the shared (FSx) checkpoints: every ``checkpoint.local_interval``
steps each rank writes its own shard to ``checkpoint.local_dir`` (the instance-store NVMe RAID0,
``/scratch`` in the pods) through NVRx's ``LocalCheckpointManager``, asynchronously on its own
``AsyncCallsQueue(persistent=False)``: NVRx's local-checkpoint docs require the non-persistent
(forked) caller, and a queue of its own neither waits behind the FSx write nor pickles pinned
buffers into the persistent worker's shared memory.

Replication (NVRx ``LazyCliqueReplicationStrategy``): when the job spans at least two nodes (and
the world divides into pairs of nodes), each rank's shard is also written to the rank with the
same local rank on the paired node (replication jump = ranks per node, factor 2), so a lost
node restores from its peer's NVMe instead of FSx. NVRx 0.4.1 exchanges the shards with one
broadcast per tensor (``GroupWrapper.all_gather_batch``: thousands of small collectives for a
70B shard), and a restore from a peer with one send per tensor; here each rank's tensors travel
packed in buckets of at most ``BUCKET_BYTES``, one broadcast (or send) per bucket
(``BucketedGroupWrapper``), with at most two buckets' memory held at once.
On restart, when every rank's shard of a step is available somewhere (own or replica) and newer
than the newest committed shared checkpoint, it is loaded instead of the shared one.

Integrity: every local file gets a size + CRC32 sidecar, computed in the forked writer after the
file is renamed into place (off the training path). NVRx's ``find_latest`` runs in every save's
finalize, on the training path: there a file is offered when its sidecar exists and its size
matches (a stat, no read). Its content is checked once, at restart, and only for the step about
to be loaded: each rank reads the files it holds of that step (its shard, and the replicas it
keeps for a peer) against their CRC32s, which also brings them into the page cache for the load
that follows; the ranks agree, and a damaged file is renamed aside (``.damaged``) with a
warning, so the step is incomplete and the load falls back to an older local step, a replica,
or the shared checkpoint.

Placement: ``checkpoint.local_dir`` must be on the node's own disk and outlive the pod (a
``hostPath`` on the instance-store NVMe, not an ``emptyDir``, which is deleted with the pod);
NVRx's ``session_id`` (the run id) keeps the files of one run apart from another's.

NVRx's ``BasicTensorAwareStateDict`` accepts CUDA tensors only, so this tier exists only on GPU;
asking for it on CPU is a configuration error. Local shards hold this rank's DTensor shards
(``to_local``) and are only valid for the same world size and sharding, which NVRx checks.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from training.checkpoint.layout import file_crc32
from training.checkpoint.tiers import (
    Restored,
    RestoreTier,
    SnapshotTier,
    TierContext,
    state_bytes,
)
from training.durable import write_json_atomic
from training.exits import ConfigError
from training.runlog.metrics import EventLog

log = logging.getLogger(__name__)
SIDECAR = ".crc32.json"


def write_sidecar(path: Path) -> None:
    """Size and CRC32 of ``path`` beside it (``<name>.crc32.json``), written atomically."""
    record = {"size": path.stat().st_size, "crc32": file_crc32(path)}
    write_json_atomic(path.with_name(path.name + SIDECAR), record)


def _sidecar_record(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    sidecar = path.with_name(path.name + SIDECAR)
    try:
        record = json.loads(sidecar.read_text())
    except (OSError, ValueError) as err:
        return None, f"no readable checksum record ({err.__class__.__name__})"
    size = path.stat().st_size
    if size != record.get("size"):
        return None, f"size {size} != recorded {record.get('size')}"
    return record, None


def check_size(path: Path) -> str | None:
    """None when ``path`` has its sidecar and the recorded size (no read of the file)."""
    return _sidecar_record(path)[1]


def verify_sidecar(path: Path) -> str | None:
    """None when ``path`` matches its sidecar (size and CRC32: one read), else what is wrong."""
    record, problem = _sidecar_record(path)
    if problem is not None:
        return problem
    if file_crc32(path) != record.get("crc32"):
        return "CRC32 mismatch"
    return None


DAMAGED = ".damaged"


def _warn_damaged(path: Path, problem: str) -> None:
    message = (
        f"local checkpoint {path} is damaged ({problem}); not used (an older local "
        "step, a peer's replica or the shared checkpoint is loaded instead)"
    )
    warnings.warn(message, stacklevel=3)
    log.warning(message)


def session_id_for(checkpoint_root: Path) -> str:
    """NVRx's session id for a run's local files: the run's folder name and a digest of its
    shared checkpoint path (the same in every pod of the run and across its restarts, different
    for any other run). NVRx keeps a session's files in ``<local_dir>/<session>/<rank>`` and
    sweeps older iterations there; on a node disk that outlives pods, runs that shared one
    session would load or delete each other's files."""
    import zlib

    return f"{checkpoint_root.parent.name}-{zlib.crc32(str(checkpoint_root).encode()):08x}"


def replication_groups(*, world_size: int, local_world_size: int) -> list[list[int]] | None:
    """The clique groups NVRx forms for replication to another node, or None when the job
    cannot replicate across nodes (one node, or nodes that do not pair up).

    Jump = ranks per node, factor 2: rank r's shard also lives on rank r + local_world_size
    (NVRx ``replication/group_utils.py:parse_group_sequence``)."""
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import (
        parse_group_sequence,
    )

    if local_world_size < 1 or world_size < 2 * local_world_size:
        return None
    if world_size % (2 * local_world_size):
        return None
    groups = parse_group_sequence(
        replication_jump=local_world_size, replication_factor=2, world_size=world_size
    )
    return [list(group) for group in groups]


BUCKET_BYTES = 256 << 20
"""The most bytes one replication broadcast carries (a bigger tensor goes alone)."""
ALIGN = 16
"""Byte alignment of each tensor inside a bucket (the widest element, complex128)."""


def buckets(sizes: list[int], *, limit: int | None = None) -> list[list[int]]:
    """Consecutive indices of ``sizes`` grouped so that each group holds at most ``limit``
    bytes (default ``BUCKET_BYTES``), or a single bigger item."""
    limit = BUCKET_BYTES if limit is None else limit
    groups: list[list[int]] = []
    total = 0
    for index, size in enumerate(sizes):
        if not groups or total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(index)
        total += size
    return groups


class _Layout:
    """Where each of a list of tensors (shapes and dtypes known to both sides) sits in the
    buckets that carry it: each item at a multiple of ``ALIGN`` bytes (its dtype view needs
    it), buckets of at most ``BUCKET_BYTES``."""

    def __init__(self, like: list[torch.Tensor]) -> None:
        self.like = like
        self.sizes = [t.numel() * t.element_size() for t in like]
        self.slots = [-(-size // ALIGN) * ALIGN for size in self.sizes]
        self.buckets = buckets(self.slots)

    def pack(self, tensors: list[torch.Tensor], bucket: list[int], *, device) -> torch.Tensor:
        flat = torch.empty(sum(self.slots[i] for i in bucket), dtype=torch.uint8, device=device)
        offset = 0
        for i in bucket:
            source = tensors[i].contiguous().view(-1).view(torch.uint8)
            flat[offset : offset + self.sizes[i]].copy_(source)
            offset += self.slots[i]
        return flat

    def empty(self, bucket: list[int], *, device) -> torch.Tensor:
        return torch.empty(sum(self.slots[i] for i in bucket), dtype=torch.uint8, device=device)

    def unpack(self, flat: torch.Tensor, bucket: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """(index, view of the bucket) per item; a view, so the caller copies it out before
        the bucket's memory is reused."""
        offset = 0
        for i in bucket:
            part = flat[offset : offset + self.sizes[i]].view(self.like[i].dtype)
            yield i, part.view(self.like[i].shape)
            offset += self.slots[i]


def _comm_device(group) -> torch.device:
    """Where the group's collectives take tensors: the rank's GPU for NCCL, else the CPU."""
    import torch.distributed as dist

    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bucketed_group_wrapper_class():
    import torch.distributed as dist
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper
    from nvidia_resiliency_ext.checkpointing.local.replication.torch_device_utils import (
        TensorPlaceholder,
    )

    class BucketedGroupWrapper(GroupWrapper):
        """NVRx's group wrapper, with the replicas' tensors sent in packed buckets: at save
        (``all_gather_batch``, broadcasts) and at a restore from a peer
        (``isend_state_dict`` / ``irecv_state_dict``, point to point)."""

        def all_gather_batch(self, my_tensors, target_device=None):
            """Every rank's ``my_tensors`` on every rank of the group, as NVRx's version returns
            them (per rank, in order, moved to ``target_device``)."""
            placeholders = self.all_gather_object([TensorPlaceholder(t) for t in my_tensors])
            result = []
            for source, holders in enumerate(placeholders):
                mine = source == self.my_group_rank
                layout = _Layout([h.hollow_tensor for h in holders])
                device = holders[0].device if holders else None
                received: list = []
                for bucket in layout.buckets:
                    if mine:
                        flat = layout.pack(my_tensors, bucket, device=device)
                        received += [
                            my_tensors[i]
                            if target_device is None
                            else my_tensors[i].to(target_device, non_blocking=True)
                            for i in bucket
                        ]
                    else:
                        flat = layout.empty(bucket, device=device)
                    self.broadcast(flat, src=self.get_global_rank(source))
                    if mine:
                        continue
                    # A copy either way: the bucket's memory is reused for the next one
                    # (stream-ordered, so an asynchronous copy out of it is safe).
                    for _, part in layout.unpack(flat, bucket):
                        received.append(
                            part.clone()
                            if target_device is None
                            else part.to(target_device, non_blocking=True)
                        )
                result.append(received)
            return result

        def isend_state_dict(self, state_dict, dst: int) -> dict[str, float]:
            """NVRx's send of a whole shard to a peer restoring from this rank's replica, its
            tensors in buckets (NVRx: one send per tensor)."""
            tensors = state_dict.pop_tensors()
            self.send_object(state_dict, dst)
            layout = _Layout(tensors)
            device = _comm_device(self.group)
            for bucket in layout.buckets:
                dist.send(layout.pack(tensors, bucket, device=device), dst, group=self.group)
            state_dict.insert_tensors(tensors)
            return {"data_sent": sum(layout.sizes)}

        def irecv_state_dict(self, src: int):
            hollow = self.recv_object(src)
            hollow.init_tensors()
            tensors = list(hollow.tensors)
            layout = _Layout(tensors)
            device = _comm_device(self.group)
            for bucket in layout.buckets:
                flat = layout.empty(bucket, device=device)
                dist.recv(flat, src, group=self.group)
                for i, part in layout.unpack(flat, bucket):
                    tensors[i].copy_(part)
            return hollow, {"data_recv": sum(layout.sizes)}

    return BucketedGroupWrapper


def _replication_strategy_class():
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        LazyCliqueReplicationStrategy,
    )

    class BucketedCliqueReplication(LazyCliqueReplicationStrategy):
        """NVRx's clique replication (groups built lazily, at the first save or load), its
        exchange bucketed (``BucketedGroupWrapper``)."""

        def _eager_build(self):
            strategy = super()._eager_build()
            strategy.local_group = _bucketed_group_wrapper_class()(strategy.local_group.group)
            return strategy

    return BucketedCliqueReplication


def _verified_manager_class():
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )

    class VerifiedLocalCheckpointManager(LocalCheckpointManager):
        """NVRx's manager with a checksum per file, checked before a file is offered."""

        def _save(self, state_dict, ckpt_id) -> None:
            super()._save(state_dict, ckpt_id)
            write_sidecar(self._local_ckpt_path_from_id(ckpt_id))

        def _my_ckpt_ids(self):
            """The files whose write finished (their sidecar exists, sizes match): a stat per
            file, since NVRx calls this in every save's finalize."""
            sound = []
            for ckpt_id in super()._my_ckpt_ids():
                path = self._local_ckpt_path_from_id(ckpt_id)
                problem = check_size(path)
                if problem is None:
                    sound.append(ckpt_id)
                    continue
                _warn_damaged(path, problem)
            return sound

        def _cleanup(self, iteration) -> None:
            super()._cleanup(iteration)
            for sidecar in self.local_ckpt_dir.glob(f"*{SIDECAR}"):
                if not sidecar.with_name(sidecar.name[: -len(SIDECAR)]).exists():
                    sidecar.unlink(missing_ok=True)

    return VerifiedLocalCheckpointManager


def _to_local_cuda(tree: Any, specs: dict[str, tuple], prefix: str = "") -> Any:
    """DTensors -> their local CUDA shards (spec remembered); CPU tensors -> CUDA copies."""
    if isinstance(tree, dict):
        return {k: _to_local_cuda(v, specs, f"{prefix}{k}/") for k, v in tree.items()}
    if isinstance(tree, DTensor):
        specs[prefix] = (tree.device_mesh, tree.placements, tree.shape, tree.stride())
        return tree.to_local()
    if isinstance(tree, torch.Tensor):
        specs[prefix] = ("cpu",) if tree.device.type == "cpu" else ("plain",)
        return tree.cuda() if tree.device.type == "cpu" else tree
    return tree


def _from_local(tree: Any, specs: dict[str, tuple], prefix: str = "") -> Any:
    if isinstance(tree, dict):
        return {k: _from_local(v, specs, f"{prefix}{k}/") for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        spec = specs[prefix]
        if spec[0] == "cpu":
            return tree.cpu()
        if spec[0] == "plain":
            return tree
        mesh, placements, shape, stride = spec
        return DTensor.from_local(
            tree, mesh, placements, shape=shape, stride=stride, run_check=False
        )
    return tree


class LocalCheckpoints:
    """Per-rank checkpoints on node-local storage through NVRx (GPU only)."""

    def __init__(
        self,
        *,
        root: Path,
        session_id: str,
        world_size: int,
        local_world_size: int,
        require_cuda: bool = True,
    ) -> None:
        if require_cuda and not torch.cuda.is_available():
            raise ConfigError(
                "checkpoint.local_dir",
                "NVRx local checkpoints need CUDA tensors; leave it empty on CPU",
            )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        self.groups = replication_groups(world_size=world_size, local_world_size=local_world_size)
        strategy = None
        if self.groups is not None:
            # Lazy: its process groups are created (collectively) at the first save or load.
            strategy = _replication_strategy_class()(
                replication_jump=local_world_size, replication_factor=2
            )
        manager_class = _verified_manager_class()
        self._manager = manager_class(str(root), session_id=session_id, repl_strategy=strategy)
        # Non-persistent (forked writer), as NVRx's local checkpointing docs require.
        self._queue = AsyncCallsQueue(persistent=False)

    @property
    def replicated(self) -> bool:
        return self.groups is not None

    def save(self, trainer, *, step: int) -> None:
        """Stage this rank's shard (device-to-host copy; replicas exchanged first) and start the
        forked write (collective)."""
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
            BasicTensorAwareStateDict,
        )

        specs: dict[str, tuple] = {}
        local_state = _to_local_cuda(trainer.state_dict(), specs)
        request = self._manager.save(BasicTensorAwareStateDict(local_state), step, is_async=True)
        self._queue.schedule_async_request(request)

    def poll(self, *, blocking: bool, keepalive: Callable[[], None] = lambda: None) -> None:
        """Finalize the local saves every rank has finished (collective). ``blocking``: until
        all are, one non-blocking pass at a time with ``keepalive`` between the passes (NVRx's
        blocking wait sleeps in its own loop, where no liveness report can run); every rank
        sees each pass's all-reduced verdict, so all make the same passes."""
        self._queue.maybe_finalize_async_calls(blocking=False)
        while blocking and self._queue.get_num_unfinalized_calls():
            keepalive()
            time.sleep(0.05)
            self._queue.maybe_finalize_async_calls(blocking=False)

    def pending(self) -> int:
        return self._queue.get_num_unfinalized_calls()

    def close(self) -> None:
        """Finish pending local saves (collective)."""
        self._queue.close()

    def abandon(self) -> None:
        """After a fault, no collective: forget pending local saves (never finalized, so NVRx
        never counts them as complete)."""
        self._queue.async_calls.clear()

    def latest_step(self) -> int | None:
        """Newest step every rank has locally, its files read against their CRC32s
        (collective); None when there is none."""
        import torch.distributed as dist

        while True:
            step = self._manager.find_latest()
            if step < 0:
                return None
            mine = bool(self._verify_held_files(step))
            damaged = [mine]
            if dist.is_initialized():  # every rank's verdict: all load the same step
                damaged = [None] * dist.get_world_size()
                dist.all_gather_object(damaged, mine)
            if not any(damaged):
                return step
            self._manager.latest_iteration = -1  # NVRx caches its answer: ask again

    def discard_newer(self, step: int) -> list[int]:
        """After a restore of ``step`` (from any tier): remove the local files this rank holds
        (its own and the replicas it keeps) of later steps, a dead timeline's: NVRx's
        ``find_latest`` would otherwise offer them to a later restart once every rank's
        shard of such a step is found again. Local, no collective."""
        removed = set()
        for ckpt_id in self._manager._my_ckpt_ids():
            if ckpt_id[0] <= step:
                continue
            path = self._manager._local_ckpt_path_from_id(ckpt_id)
            path.with_name(path.name + SIDECAR).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            removed.add(ckpt_id[0])
        self._manager.latest_iteration = -1  # NVRx caches its answer
        return sorted(removed)

    def _verify_held_files(self, step: int) -> list[Path]:
        """Read this rank's files of ``step`` against their CRC32s; rename the damaged ones
        aside (NVRx then no longer finds them) and return them."""
        damaged = []
        for ckpt_id in self._manager._my_ckpt_ids():
            if ckpt_id[0] != step:
                continue
            path = self._manager._local_ckpt_path_from_id(ckpt_id)
            problem = verify_sidecar(path)
            if problem is not None:
                _warn_damaged(path, problem)
                path.rename(path.with_name(path.name + DAMAGED))
                damaged.append(path)
        return damaged

    def load_into(self, trainer) -> int:
        """Load the newest complete local checkpoint into ``trainer`` (collective)."""
        specs: dict[str, tuple] = {}
        _to_local_cuda(trainer.state_dict(), specs)  # the DTensor layout to rebuild
        tensor_aware, _ckpt_id = self._manager.load()
        tensor_aware.restore_tensor_device(non_blocking=False)
        trainer.load_state_dict(_from_local(tensor_aware.state_dict, specs))
        return int(trainer.step)


class LocalTier:
    """The ``local`` restore tier (``tiers.RestoreTier``): the newest step every rank holds on
    node-local NVMe (own files or a peer node's replicas), its files read against their CRC32s
    (``LocalCheckpoints.latest_step``)."""

    name = "local"

    def __init__(self, checkpoints: LocalCheckpoints, *, path: Path) -> None:
        self.checkpoints = checkpoints
        self.path = path

    def steps(self) -> list[int]:
        step = self.checkpoints.latest_step()
        return [] if step is None else [step]

    def load(self, trainer, *, step: int):
        loaded = self.checkpoints.load_into(trainer)  # NVRx loads its newest: the one listed
        assert loaded == step, f"NVRx loaded step {loaded}, listed {step}"
        return Restored(path=str(self.path), nbytes=state_bytes(trainer.state_dict()))


class LocalSnapshotTier(SnapshotTier):
    """The ``local`` snapshot tier: every ``checkpoint.local_interval`` steps (but not at a
    shared save's step) an NVRx local checkpoint of this rank's shard on node-local NVMe, written
    by its own non-persistent queue (``local_checkpoint.py``). Collective (its replication and
    finalization)."""

    name = "local"
    io = True

    def __init__(
        self,
        *,
        checkpoints: LocalCheckpoints,
        path: Path,
        interval: int,
        events: EventLog,
        keepalive: Callable[[], None] = lambda: None,
    ) -> None:
        self.checkpoints = checkpoints
        self.path = path
        self.interval = interval
        self.events = events
        self.keepalive = keepalive
        self._pending = False

    def restore_tiers(self) -> list[RestoreTier]:
        return [LocalTier(self.checkpoints, path=self.path)]

    def due(self, step: int, *, shared: bool) -> bool:
        return bool(self.interval) and step % self.interval == 0 and not shared

    def take(self, trainer: Any, *, step: int) -> None:
        started = time.perf_counter()
        self.checkpoints.save(trainer, step=step)
        self._pending = True
        self.events.emit(
            "checkpoint_staged",
            step=step,
            engine="nvrx_local",
            blocking_s=time.perf_counter() - started,
        )

    def poll(self) -> None:
        if self._pending:
            self.checkpoints.poll(blocking=False)
            self._pending = self.checkpoints.pending() > 0

    def wait(self) -> None:
        self.checkpoints.poll(blocking=True, keepalive=self.keepalive)
        self._pending = False

    def discard_newer(self, step: int) -> None:
        self.checkpoints.discard_newer(step)

    def close(self) -> None:
        self.checkpoints.close()

    def abandon(self) -> None:
        self.checkpoints.abandon()
        self._pending = False


def snapshot_tier(context: TierContext) -> LocalSnapshotTier | None:
    """The registry's row: on when ``checkpoint.local_dir`` is set (GPU only)."""
    if not context.config.local_dir:
        return None
    checkpoints = LocalCheckpoints(
        root=Path(context.config.local_dir),
        session_id=session_id_for(context.root),
        world_size=context.world_size,
        local_world_size=context.local_world_size,
    )
    return LocalSnapshotTier(
        checkpoints=checkpoints,
        path=Path(context.config.local_dir),
        interval=context.config.local_interval,
        events=context.events,
        keepalive=context.keepalive,
    )
