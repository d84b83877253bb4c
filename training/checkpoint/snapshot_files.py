"""The on-file format of a rank's state snapshot in the pod's memory (``/dev/shm``).

One snapshot is a directory ``<root>/<kind>/rank-<RRRRR>/slot-<k>/`` (``kind``: ``own`` for
a rank's own snapshots, ``peer`` for copies held for another node's rank) with two files:

``data``
    Every tensor leaf's local bytes (a DTensor's local shard), flat, each at a multiple of
    :data:`ALIGN` bytes. The file is mapped shared (``torch.from_file(shared=True)``), so the
    copy of a leaf into its view of the mapping is the write to ``/dev/shm``: no second copy,
    no ``write(2)``. Bytes in a tmpfs page belong to the mount, not to a process: a SIGKILLed
    rank leaves them for its successor.
``meta``
    A pickled, frozen :class:`SnapshotMeta`: owner (run identity), rank, world size, step,
    structure key, the layout of every tensor leaf, the pickled non-tensor leaves, the data's
    size and CRC32 (ISA-L's, the checkpoint layout's; same values as ``zlib.crc32``; taken only
    for a snapshot that crosses the network, :data:`NO_CHECKSUM` otherwise).

Protocol: ``meta`` is unlinked before ``data`` is rewritten and is written last (temporary
file, then ``rename(2)``: atomic), once every byte of ``data`` is in place; on a GPU, once
the device-to-host copies' CUDA event is complete. A snapshot is complete exactly when its
``meta`` exists, so a writer killed in the middle of a copy leaves a slot without ``meta``,
which is never offered. Each rank keeps :data:`SLOTS` slots and writes them in turn
(:func:`next_slot`), so the previous snapshot stays whole while the next is written; a slot
holding the same step or a later one (a dead timeline's, :func:`discard_newer`) is rewritten
first. Every page of a slot is allocated before it is mapped (:func:`reserve`): a full tmpfs
is an ``OSError`` (ENOSPC), never a SIGBUS at a write through the mapping.

A snapshot is offered only to the same owner, rank and world size, and restored only into a
state of the same structure (:meth:`SnapshotMeta.refusal`). The CRC32 catches a copy damaged
on its way across the network (``peer``): checked on arrival (:func:`write_snapshot`, the peer
exchange) and before a ``peer`` copy is restored (:func:`verify`); a rank's ``own`` snapshot
is restored without a CRC pass (``pod_memory.PodMemorySnapshots.check`` says why).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import pickle
import shutil
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from training.checkpoint import device_threads
from training.checkpoint.layout import crc32

FORMAT = 1
"""The version of this format; a snapshot of another version is refused."""
ALIGN = 64
"""Byte alignment of every tensor leaf in ``data`` (a cache line; enough for any dtype)."""
SLOTS = 2
"""Snapshots kept per rank and kind, written in turn."""
NO_CHECKSUM = -1
"""A meta's ``crc32`` when no checksum was taken: matches no data (a CRC32 is >= 0)."""
DATA = "data"
META = "meta"
Kind = Literal["own", "peer"]
KINDS: tuple[Kind, ...] = ("own", "peer")


# ---------------------------------------------------------------------------------------------
# the state's structure and layout
# ---------------------------------------------------------------------------------------------


def _leaves(state: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any, Any, Any]]:
    """Every leaf of a nested dict/list state as (path, container, key, value), keys sorted, so
    two states of one structure walk in the same order."""
    if isinstance(state, dict):
        items = [(k, state[k]) for k in sorted(state, key=str)]
    else:
        items = list(enumerate(state))
    for key, value in items:
        if isinstance(value, dict | list):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), state, key, value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a tensor (a DTensor's local shard)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def walk(state: dict[str, Any]) -> tuple[list[tuple[Any, Any, Any]], tuple]:
    """The leaves of ``state`` as (container, key, local tensor or value) and its structure
    key: every path, and each tensor's dtype and local shape. Under ``no_grad``, where
    ``DTensor.to_local`` is an attribute read instead of an autograd function."""
    leaves, key = [], []
    for path, container, name, value in _leaves(state):
        if isinstance(value, torch.Tensor):
            value = _local(value).detach()
            key.append((path, value.dtype, tuple(value.shape)))
        else:
            key.append((path,))
        leaves.append((container, name, value))
    return leaves, tuple(key)


@dataclass(frozen=True, kw_only=True)
class TensorLayout:
    """Where one tensor leaf lies in ``data``."""

    path: tuple
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    def view(self, data: torch.Tensor) -> torch.Tensor:
        """This leaf's bytes in ``data`` (a flat uint8 tensor) as a tensor of its dtype and
        shape: a view, no copy."""
        return data[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def plan(key: tuple) -> tuple[tuple[TensorLayout, ...], int]:
    """The layout of every tensor leaf of a state with structure ``key`` (:func:`walk`) and
    the size of ``data``: leaves in walk order, each aligned."""
    layouts, offset = [], 0
    for entry in key:
        if len(entry) == 1:
            continue
        path, dtype, shape = entry
        layout = TensorLayout(path=path, offset=offset, dtype=dtype, shape=shape)
        layouts.append(layout)
        offset += _aligned(layout.nbytes)
    return tuple(layouts), offset


@dataclass(frozen=True, kw_only=True)
class SnapshotMeta:
    """Everything about one snapshot but its tensor bytes (see the module docstring)."""

    owner: str
    """The run it belongs to (``pod_memory.run_identity``): no other run restores it."""
    rank: int
    world_size: int
    step: int
    key: tuple
    """The structure key (:func:`walk`): paths, dtypes and local shapes."""
    tensors: tuple[TensorLayout, ...]
    values: bytes
    """The non-tensor leaves, pickled, in walk order."""
    nbytes: int
    """The size of ``data`` (:func:`plan`)."""
    crc32: int
    """CRC32 of the ``nbytes`` bytes of ``data``; :data:`NO_CHECKSUM` when none was taken (an
    own snapshot that never crosses the network: ``pod_memory.PodMemorySnapshots``)."""
    format: int = FORMAT

    def to_bytes(self) -> bytes:
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def from_bytes(cls, blob: bytes) -> SnapshotMeta:
        meta = pickle.loads(blob)
        if not isinstance(meta, cls):
            raise ValueError(f"not a {cls.__name__}: {type(meta).__name__}")
        return meta

    def refusal(
        self, *, owner: str, rank: int, world_size: int, key: tuple | None = None
    ) -> str | None:
        """Why this snapshot may not be restored by ``rank`` of the run ``owner`` in a world of
        ``world_size`` into a state of structure ``key`` (None: not checked); None when it may."""
        if self.format != FORMAT:
            return f"format {self.format}, expected {FORMAT}"
        if self.owner != owner:
            return f"another run's ({self.owner!r}, not {owner!r})"
        if self.rank != rank:
            return f"rank {self.rank}'s, not rank {rank}'s"
        if self.world_size != world_size:
            return f"world size {self.world_size}, not {world_size}"
        if key is not None and self.key != key:
            return "another structure (paths, dtypes or local shapes differ)"
        return None


def meta_for(
    state: dict[str, Any], *, owner: str, rank: int, world_size: int, step: int
) -> SnapshotMeta:
    """The meta of a snapshot of ``state``, without a checksum (:data:`NO_CHECKSUM`; see
    :func:`with_checksum`)."""
    leaves, key = walk(state)
    tensors, nbytes = plan(key)
    values = [v for _, _, v in leaves if not isinstance(v, torch.Tensor)]
    return SnapshotMeta(
        owner=owner,
        rank=rank,
        world_size=world_size,
        step=step,
        key=key,
        tensors=tensors,
        values=pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL),
        nbytes=nbytes,
        crc32=NO_CHECKSUM,
    )


def with_checksum(meta: SnapshotMeta, data: torch.Tensor) -> SnapshotMeta:
    """``meta`` with the CRC32 of ``data`` (the flat uint8 tensor it describes)."""
    return replace(meta, crc32=checksum(data[: meta.nbytes]))


def checksum(data: torch.Tensor) -> int:
    """CRC32 of a flat CPU uint8 tensor (ISA-L's, which releases the GIL: a background thread
    can take it beside the training loop)."""
    if data.numel() == 0:
        return 0
    return crc32(memoryview(data.numpy()).cast("B"))


@torch.no_grad()
def pack(state: dict[str, Any], data: torch.Tensor, meta: SnapshotMeta) -> None:
    """Copy every tensor leaf's local part of ``state`` into its place in ``data``. From a GPU
    the copies are asynchronous (``data`` pinned) on the current stream: complete once an
    event recorded after them is."""
    leaves, _ = walk(state)
    tensors = iter(meta.tensors)
    for _, _, value in leaves:
        if isinstance(value, torch.Tensor):
            next(tensors).view(data).copy_(value, non_blocking=value.is_cuda)


@torch.no_grad()
def unpack(state: dict[str, Any], data: torch.Tensor, meta: SnapshotMeta) -> None:
    """Copy the snapshot (``data`` and ``meta``) into ``state`` in place (tensors' local parts)
    and put its non-tensor leaves back; the caller then hands ``state`` to
    ``load_state_dict``. Raises ValueError when ``state`` has another structure."""
    leaves, key = walk(state)
    if key != meta.key:
        raise ValueError("the snapshot has another structure than the state")
    values = iter(pickle.loads(meta.values))
    tensors = iter(meta.tensors)
    for container, name, value in leaves:
        if isinstance(value, torch.Tensor):
            value.copy_(next(tensors).view(data))
        else:
            container[name] = copy.deepcopy(next(values))


@torch.no_grad()
def load(state: dict[str, Any], directory: Path, meta: SnapshotMeta) -> None:
    """:func:`unpack` from the snapshot's file in ``directory``: a contiguous CPU leaf is read
    straight into its bytes (``preadv``: one copy from the tmpfs's pages, no mapping to fault
    in and tear down; ~10% faster than through a fresh mapping for a 202 MiB shard on this
    2-core machine); other leaves (a GPU's, a strided one) are copied from the file mapped.
    Raises ValueError when ``state`` has another structure, OSError when the file is shorter
    than its meta says."""
    leaves, key = walk(state)
    if key != meta.key:
        raise ValueError("the snapshot has another structure than the state")
    values = iter(pickle.loads(meta.values))
    tensors = iter(meta.tensors)
    mapped: torch.Tensor | None = None
    fd = os.open(Path(directory) / DATA, os.O_RDONLY)
    try:
        for container, name, value in leaves:
            if not isinstance(value, torch.Tensor):
                container[name] = copy.deepcopy(next(values))
                continue
            layout = next(tensors)
            if value.device.type == "cpu" and value.is_contiguous():
                _read_exactly(fd, value.reshape(-1).view(torch.uint8), offset=layout.offset)
            else:
                if mapped is None:
                    mapped = map_data(directory, meta)
                value.copy_(layout.view(mapped))
    finally:
        os.close(fd)


def _read_exactly(fd: int, into: torch.Tensor, *, offset: int) -> None:
    """Fill the flat uint8 CPU tensor ``into`` with the file's bytes from ``offset``."""
    view = memoryview(into.numpy()).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"snapshot data ends at byte {offset + done}, {len(view) - done} short")
        done += got


# ---------------------------------------------------------------------------------------------
# the files
# ---------------------------------------------------------------------------------------------


def rank_dir(root: Path, *, kind: Kind, rank: int) -> Path:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return Path(root) / kind / f"rank-{rank:05d}"


def slot_dir(root: Path, *, kind: Kind, rank: int, slot: int) -> Path:
    if not 0 <= slot < SLOTS:
        raise ValueError(f"slot must be in [0, {SLOTS}), got {slot}")
    return rank_dir(root, kind=kind, rank=rank) / f"slot-{slot}"


def read_meta(directory: Path) -> SnapshotMeta | None:
    """The meta of the snapshot in ``directory``; None when it is not complete (no ``meta``,
    an unreadable one, or ``data`` shorter than it says)."""
    try:
        meta = SnapshotMeta.from_bytes((Path(directory) / META).read_bytes())
        size = (Path(directory) / DATA).stat().st_size
    except (OSError, ValueError, pickle.UnpicklingError, EOFError, AttributeError):
        return None
    return meta if size >= meta.nbytes else None


def list_snapshots(
    root: Path, *, kind: Kind, rank: int | None = None
) -> list[tuple[Path, SnapshotMeta]]:
    """The complete snapshots of ``kind`` (of one ``rank``, or every rank's), newest step
    first, as (directory, meta). The caller checks :meth:`SnapshotMeta.refusal`."""
    if rank is None:
        base = Path(root) / kind
        ranks = sorted(base.glob("rank-*")) if base.is_dir() else []
    else:
        ranks = [rank_dir(root, kind=kind, rank=rank)]
    found = []
    for directory in ranks:
        for slot in range(SLOTS):
            path = directory / f"slot-{slot}"
            meta = read_meta(path)
            if meta is not None:
                found.append((path, meta))
    return sorted(found, key=lambda item: item[1].step, reverse=True)


def next_slot(root: Path, *, kind: Kind, rank: int, step: int) -> int:
    """The slot a snapshot of ``step`` goes to: one without a complete snapshot, else one that
    holds ``step`` or a later one (a rank never holds two snapshots of one step, and a
    replayed step replaces what an abandoned timeline left), else the one with the older step
    (the newest stays whole while the next is written)."""
    steps = []
    for slot in range(SLOTS):
        meta = read_meta(slot_dir(root, kind=kind, rank=rank, slot=slot))
        if meta is None:
            return slot
        steps.append(meta.step)
    later = [slot for slot in range(SLOTS) if steps[slot] >= step]
    if later:  # the one of this very step first: never two snapshots of one step
        return min(later, key=lambda slot: (steps[slot] != step, -steps[slot]))
    return min(range(SLOTS), key=lambda slot: steps[slot])


def discard_newer(root: Path, *, kind: Kind, rank: int, step: int) -> list[int]:
    """Remove ``rank``'s snapshots of ``kind`` newer than ``step`` (a restore of ``step`` made
    them a dead timeline's); the steps removed."""
    removed = []
    for directory, meta in list_snapshots(root, kind=kind, rank=rank):
        if meta.step > step:
            remove(directory)
            removed.append(meta.step)
    return removed


def held_ranks(root: Path, *, kind: Kind) -> list[int]:
    """The ranks with a directory of ``kind`` under ``root`` (complete snapshots or not)."""
    base = Path(root) / kind
    ranks = []
    for directory in sorted(base.glob("rank-*")) if base.is_dir() else []:
        with contextlib.suppress(ValueError):
            ranks.append(int(directory.name.split("-", 1)[1]))
    return ranks


def map_data(directory: Path, meta: SnapshotMeta) -> torch.Tensor:
    """A snapshot's ``data`` as a flat uint8 CPU tensor, mapped privately (``MAP_PRIVATE``:
    the file is never written through it; the pages are the tmpfs's own until written)."""
    return torch.from_file(
        str(Path(directory) / DATA), shared=False, size=max(meta.nbytes, 1), dtype=torch.uint8
    )[: meta.nbytes]


def verify(directory: Path, meta: SnapshotMeta) -> str | None:
    """None when ``directory``'s data matches ``meta``'s CRC32; else what is wrong."""
    if meta.crc32 == NO_CHECKSUM:
        return "no checksum was taken of its data"
    try:
        data = map_data(directory, meta)
    except (OSError, RuntimeError) as err:
        return f"data unreadable ({err})"
    found = checksum(data)
    if found != meta.crc32:
        return f"data fails its checksum (CRC32 {found:08x}, meta says {meta.crc32:08x})"
    return None


def unpublish(directory: Path) -> None:
    """Mark the snapshot in ``directory`` incomplete (unlink ``meta``): call before its data
    changes."""
    (Path(directory) / META).unlink(missing_ok=True)


def publish(directory: Path, meta: SnapshotMeta) -> None:
    """Write ``meta`` (temporary file, then rename: atomic); the snapshot is complete from
    here on. Call only once every byte of ``data`` is in place. No fsync: the files live in a
    tmpfs, and the bytes in the page cache outlive the writer either way."""
    directory = Path(directory)
    tmp = directory / f".{META}.{os.getpid()}.tmp"
    tmp.write_bytes(meta.to_bytes())
    os.replace(tmp, directory / META)


class SlotFile:
    """A slot's ``data`` mapped shared and writable, for a writer that fills it in place.

    ``open`` unlinks the slot's ``meta`` first (:func:`unpublish`), so nothing offers the slot
    until :func:`publish`; with ``keep_meta`` (a mapping made ahead of its first write,
    ``PodMemorySnapshots.prepare``) a complete snapshot in the slot stays offered, unless the
    file must change size. Every page of the file is allocated before it is mapped
    (:func:`reserve`): a tmpfs without room then raises ``OSError`` (ENOSPC) here, where a
    sparse file's first write through the mapping would kill the process with SIGBUS. With
    ``pin`` (a GPU run), the mapping is registered with CUDA (``cudaHostRegister``) so
    device-to-host copies into it are asynchronous: on a background thread bound to ``device``
    (:mod:`device_threads`), because registration populates and pins every page (seconds for a
    shard of GBs) and must not stall the training thread; :meth:`wait_pinned` waits for it
    before the first copy, :meth:`close` unregisters it."""

    def __init__(
        self,
        directory: Path,
        *,
        nbytes: int,
        pin: bool = False,
        device: int | None = None,
        keep_meta: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.nbytes = nbytes
        self.directory.mkdir(parents=True, exist_ok=True)
        if not keep_meta:
            unpublish(self.directory)
        path = self.directory / DATA
        size = max(_aligned(nbytes), ALIGN)
        with open(path, "a+b") as handle:  # created if missing, never truncated to 0 first
            current = os.fstat(handle.fileno()).st_size
            if current != size:
                unpublish(self.directory)  # its data changes: it describes other bytes now
                if current > size:
                    os.ftruncate(handle.fileno(), size)
            try:
                reserve(handle.fileno(), size)
            except OSError as err:
                # Nothing half-reserved stays: the pages a partial allocation took go back.
                unpublish(self.directory)
                path.unlink(missing_ok=True)
                raise OSError(
                    err.errno,
                    f"no room for a {size / 2**20:.1f} MiB snapshot in {self.directory} "
                    f"({os.strerror(err.errno or 0)})",
                ) from err
            self._inode = os.fstat(handle.fileno()).st_ino
        self._mapped = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self.data = self._mapped[:nbytes]
        self.pinned = False
        self.pin_problem: str | None = None
        self._registration: threading.Thread | None = None
        if pin:
            self._registration = device_threads.start(
                self._register, name=f"cuda-host-register-{self.directory.name}", device=device
            )

    def _register(self) -> None:
        try:
            _cuda_register(self._mapped)
        except Exception as err:  # reported by wait_pinned; the copies then go unpinned
            self.pin_problem = f"{type(err).__name__}: {err}"
        else:
            self.pinned = True

    def wait_pinned(self) -> bool:
        """Wait until the registration (if any) has finished; whether the mapping is pinned. A
        failed registration is warned about once: the copies into it are then synchronous
        (``cudaMemcpyAsync`` to pageable memory returns once the bytes are there), slower but
        correct."""
        if self._registration is not None:
            self._registration.join()
            self._registration = None
            if self.pin_problem is not None:
                message = (
                    f"{self.directory}: cudaHostRegister failed ({self.pin_problem}); snapshot "
                    "copies into it are synchronous (a pod_memory_dir off tmpfs cannot be pinned "
                    "on kernels >= 6.5: FOLL_LONGTERM pins of file mappings are shmem-only)"
                )
                warnings.warn(message, stacklevel=2)
                print(f"WARNING: {message}", flush=True)
        return self.pinned

    def current(self) -> bool:
        """Whether the mapping is still the slot's file (not removed or replaced since): a
        writer reusing a mapping checks this first."""
        try:
            return os.stat(self.directory / DATA).st_ino == self._inode
        except OSError:
            return False

    def reopen(self) -> None:
        """Mark the slot incomplete again before it is rewritten with the same layout."""
        unpublish(self.directory)

    def close(self) -> None:
        if self._registration is not None:
            self._registration.join()  # never unmapped under a registration in flight
            self._registration = None
        if self.pinned:
            _cuda_unregister(self._mapped)
            self.pinned = False
        self.data = self._mapped = None  # type: ignore[assignment]


def reserve(fd: int, size: int) -> None:
    """Allocate every page of the file's first ``size`` bytes now (``posix_fallocate(3)``;
    tmpfs supports it, shmem_fallocate in the kernel): a full file system raises ENOSPC here
    instead of a SIGBUS at a later write through a shared mapping (mmap(2): "SIGBUS ...
    access to a portion of the buffer that does not correspond to the file"; a tmpfs page
    that cannot be allocated on a fault). Allocating pages already allocated is a no-op, so
    a reused slot pays only for its missing pages. A file system without fallocate (EOPNOTSUPP,
    EINVAL; not tmpfs) gets the size only, as before."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)


def _cuda_register(tensor: torch.Tensor) -> None:
    """Page-lock a mapping for CUDA (``cudaHostRegister``, flags 0 = default): device-to-host
    copies into it then run asynchronously, as into ``pin_memory`` buffers. Registers for the
    calling thread's current device's context: call it on a thread bound to the rank's GPU."""
    result = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({result}) for {tensor.numel()} bytes")


def _cuda_unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def write_snapshot(
    root: Path, *, kind: Kind, slot: int, meta: SnapshotMeta, data: torch.Tensor
) -> Path:
    """Write a snapshot given its meta and flat uint8 data (e.g. a peer's copy received over
    the network) into ``slot`` of ``meta.rank``: meta unlinked, data copied, its CRC32 checked
    against ``meta`` (ValueError, nothing published, when it differs), meta published. Returns
    the slot's directory."""
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < meta.nbytes:
        raise ValueError(
            f"data must be a flat uint8 tensor of at least {meta.nbytes} bytes, "
            f"got {data.dtype} of shape {tuple(data.shape)}"
        )
    directory = slot_dir(root, kind=kind, rank=meta.rank, slot=slot)
    target = SlotFile(directory, nbytes=meta.nbytes)
    try:
        target.data.copy_(data[: meta.nbytes])
        found = checksum(target.data)
        if found != meta.crc32:
            raise ValueError(
                f"snapshot of rank {meta.rank} step {meta.step} fails its checksum "
                f"(CRC32 {found:08x}, meta says {meta.crc32:08x}); not published"
            )
        publish(directory, meta)
    finally:
        target.close()
    return directory


def remove(directory: Path) -> None:
    """Remove one snapshot: ``meta`` first (never a complete-looking half), then the rest."""
    unpublish(directory)
    shutil.rmtree(directory, ignore_errors=True)


def remove_rank(root: Path, *, kind: Kind, rank: int) -> None:
    """Remove every slot of ``rank`` of ``kind`` (and the kind's directory once empty)."""
    directory = rank_dir(root, kind=kind, rank=rank)
    for slot in range(SLOTS):
        remove(directory / f"slot-{slot}")
    with contextlib.suppress(OSError):
        shutil.rmtree(directory)
    with contextlib.suppress(OSError):
        directory.parent.rmdir()  # only when empty: other ranks' files stay


def snapshot_bytes(state: dict[str, Any]) -> int:
    """The size of ``data`` for a snapshot of ``state`` (one slot)."""
    return plan(walk(state)[1])[1]
