"""Checksums taken while a checkpoint is written, checked while it is read: one pass each way.

Writing: every byte DCP writes to a shard file goes through torch's per-item stream transform
(``torch/distributed/checkpoint/filesystem.py``: ``_write_item`` asks
``_StorageWriterTransforms.transform_save_stream`` for the stream it writes one item into).
:class:`ChecksummingTransforms` returns a stream that CRC32s the bytes on their way to the
file: one CRC per item (its offset and length) and one running CRC per file. It declares no
transform, so the files and DCP's ``.metadata`` are byte-for-byte what plain DCP writes.
:class:`ChecksummingWriter` (torch's engines) and :func:`write_buckets` (NVRx's worker) record
them in the rank's manifest (:func:`training.checkpoint.layout.write_rank_manifest`); nothing
re-reads a file.

Reading: :class:`VerifyingReader` maps each shard file it needs, checks the CRC of every item
DCP will read (the per-item CRCs let a rank verify exactly the bytes it loads: the replicated
items a rank reads from rank 0's file, a resharded load's slices), agrees with every rank on the
verdict, and only then copies each tensor from the same mapped bytes into the state: one copy
(the item's tensor is a view of the mapped page cache), where DCP's own reader makes two. A
damaged shard thus modifies no rank's state: all ranks raise, and the manager falls back to the
previous checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import mmap
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import serialization
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    SerializationFormat,
    _StorageWriterTransforms,
    _write_item,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.futures import Future

from training.checkpoint.layout import (
    COMMIT,
    SHARDS,
    CheckpointError,
    crc32,
    write_rank_manifest,
)

# file name -> {"size", "crc32", "items": {offset: [length, crc32]}} (offsets as strings: JSON)
FileSums = dict[str, dict[str, Any]]


class CheckpointDamaged(CheckpointError):
    """A checksum, size or file check failed while loading; every rank raises it together."""


@contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside a checkpoint write or load (``write_buckets``,
    ``CheckpointManager.load_latest``): a full collection of a trainer's process takes ~150 ms
    here (seen in ``bench.checkpoint``'s loads), as long as a whole load, and nothing a write or
    load allocates needs collecting before its end. Nested use keeps the outer state."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# writing: CRCs of the bytes as they go to the file
# ---------------------------------------------------------------------------------------------


class _FileSum:
    """Running CRC and per-item CRCs of one file, in write order."""

    def __init__(self) -> None:
        self.crc = 0
        self.size = 0
        self.items: dict[str, list[int]] = {}

    def as_json(self) -> dict[str, Any]:
        return {"size": self.size, "crc32": self.crc, "items": self.items}


class _ChecksummingStream(io.IOBase):
    """The stream one item is written into: CRCs every byte, then hands it on. ``close`` ends
    the item and leaves the file open (torch's own item stream, ``NoCloseWriter``, does too)."""

    def __init__(self, *, inner: IO[bytes], file_sum: _FileSum, offset: int) -> None:
        self._inner = inner
        self._file = file_sum
        self._offset = offset
        self._crc = 0
        self._length = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._crc = crc32(view, self._crc)
        self._file.crc = crc32(view, self._file.crc)
        self._length += len(view)
        self._file.size += len(view)
        return self._inner.write(view)

    def close(self) -> None:
        if not self.closed:
            self._file.items[str(self._offset)] = [self._length, self._crc]
            self._inner.close()  # torch's NoCloseWriter: flushes, keeps the file open
        super().close()


class ChecksummingTransforms(_StorageWriterTransforms):
    """torch's default (no extension) item streams, wrapped to CRC what passes through.

    Declares no transform descriptor: the checkpoint is what plain DCP writes."""

    def __init__(self) -> None:
        super().__init__(extensions=())
        self.files: dict[str, _FileSum] = {}

    def transform_save_stream(
        self, write_item: WriteItem, raw_stream: io.IOBase
    ) -> tuple[IO[bytes], list[str]]:
        inner, descriptors = super().transform_save_stream(write_item, raw_stream)
        name = os.path.basename(str(getattr(raw_stream, "name", "")))
        file_sum = self.files.setdefault(name, _FileSum())
        if file_sum.size != raw_stream.tell():
            # Only sequential, whole-file writes through items are checksummed correctly.
            raise CheckpointError(f"{name}: bytes were written outside DCP's item streams")
        stream = _ChecksummingStream(inner=inner, file_sum=file_sum, offset=raw_stream.tell())
        return stream, descriptors

    def file_sums(self) -> FileSums:
        return {name: s.as_json() for name, s in self.files.items()}


class ChecksummingWriter(FileSystemWriter):
    """torch's ``FileSystemWriter`` (one file per rank, fsynced) that records its files' CRCs
    as it writes them and then writes the rank's manifest, in the process that wrote them
    (the trainer for ``sync``, torch's background process for ``torch_async``)."""

    def __init__(self, path: str | os.PathLike, *, rank: int) -> None:
        super().__init__(path, sync_files=True)
        self.rank = rank
        self.transforms = ChecksummingTransforms()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        # torch's FileSystemWriter._write_data writes (and fsyncs) every file before it returns
        # a completed future; the manifest therefore follows durable files.
        future = super().write_data(plan, planner)
        future.wait()
        write_rank_manifest(str(self.path), self.rank, self.transforms.file_sums())
        return future


def write_buckets(rank: int, buckets: list, results_queue: Any) -> FileSums:
    """NVRx's write, in its persistent worker, without re-reading anything: each bucket to its
    file through :class:`ChecksummingTransforms`, fsynced; the results go to NVRx's results
    queue in the shape its finalize expects (``{bucket index: [WriteResult]}``,
    ``FileSystemWriterAsync.retrieve_write_results``). Returns the files' checksums.

    Replaces ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (NVRx 0.4.1), which forks
    one writer per bucket and writes through plain ``open``, where no checksum can be taken;
    with one bucket per rank (``thread_count=1``) the fork bought nothing but its own start."""
    transforms = ChecksummingTransforms()
    results: dict[int, list] | Exception = {}
    try:
        with gc_paused():  # as NVRx's writer (``_disable_gc``)
            for index, (path, storage_key, (bytes_data, tensor_data)) in enumerate(buckets):
                with open(path, "wb") as stream:
                    written = [
                        _write_item(
                            transforms,
                            stream,
                            data,
                            item,
                            storage_key,
                            serialization_format=SerializationFormat.TORCH_SAVE,
                        )
                        for item, data in [*bytes_data, *tensor_data]
                    ]
                    stream.flush()
                    os.fsync(stream.fileno())
                results[index] = written
    except Exception as err:  # reported through finalize, on every rank, as NVRx does
        results = err
    results_queue.put(results)
    if isinstance(results, Exception):
        raise results
    return transforms.file_sums()


# ---------------------------------------------------------------------------------------------
# reading: verify the bytes DCP is about to load, agree, then load those same bytes
# ---------------------------------------------------------------------------------------------


class _MappedStream(io.RawIOBase):
    """A read-only, seekable stream over a mapped file (torch's ``_ReaderView`` needs
    ``readinto``, which ``mmap`` lacks)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        chunk = self._view[self._pos : self._pos + len(target)]
        target[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


class VerifyingReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that reads each shard file once: mapped, every item DCP will
    load CRC-checked against the CRCs recorded at write time, the verdict agreed by all ranks
    (``all_gather_object``), and only then copied into the state from the same mapped bytes.
    ``.metadata`` is checked against the commit record the same way. ``problem`` names the
    first damage found on any rank (the same on every rank once ``read_data`` agreed)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.directory = Path(path)
        self.problem: str | None = None
        self._record: dict[str, Any] | None = None
        self._manifests: dict[int, dict[str, Any]] = {}
        self._maps: dict[str, memoryview] = {}
        self.fs = _MappedFileSystem(self._maps)

    # -- expected checksums ---------------------------------------------------------------------
    def _commit_record(self) -> dict[str, Any]:
        if self._record is None:
            try:
                self._record = json.loads((self.directory / COMMIT).read_text())
            except (OSError, ValueError) as err:
                raise CheckpointDamaged(f"unreadable commit record ({err})") from err
        return self._record

    def _expected(self, name: str) -> dict[str, Any]:
        """The write-time checksums of shard file ``name`` (from its writer's manifest)."""
        match = _SHARD_FILE.match(name)
        if match is None or name not in self._commit_record()["files"]:
            raise CheckpointDamaged(f"{name} is not in the commit record")
        rank = int(match.group(1))
        if rank not in self._manifests:
            manifest = self.directory / SHARDS / f"rank_{rank:05d}.json"
            try:
                self._manifests[rank] = json.loads(manifest.read_text())["files"]
            except (OSError, ValueError, KeyError) as err:
                raise CheckpointDamaged(f"unreadable manifest of rank {rank} ({err})") from err
        expected = self._manifests[rank].get(name)
        if expected is None or "items" not in expected:
            raise CheckpointDamaged(f"{name} has no write-time checksums")
        return expected

    # -- DCP hooks ------------------------------------------------------------------------------
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """DCP's ``.metadata``, CRC-checked against the commit record before it is unpickled."""
        try:
            self._check_metadata(kwargs.get("rank"))
        except CheckpointDamaged as err:
            self.problem = str(err)
            raise
        return super().read_metadata(*args, **kwargs)  # served from the bytes just checked

    def _check_metadata(self, rank: int | None) -> None:
        if rank is not None:  # DCP's rank-local fallback: this layout has none
            raise CheckpointDamaged(".metadata is unreadable (no rank-local metadata either)")
        path = self.directory / ".metadata"
        expected = self._commit_record()["files"].get(".metadata", {})
        try:
            data = path.read_bytes()
        except OSError as err:
            raise CheckpointDamaged(f".metadata is unreadable ({err})") from err
        if len(data) != expected.get("size") or crc32(data) != expected.get("crc32"):
            raise CheckpointDamaged(".metadata fails its checksum")
        self._maps[str(path)] = memoryview(data)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        try:
            problem = self._map_and_verify(plan)
        except CheckpointDamaged as err:
            problem = str(err)
        except Exception as err:  # never raise before the agreement: peers would wait in it
            problem = f"verification failed ({err!r})"
        self.problem = _agree(problem)
        if self.problem is not None:
            self._release()
            raise CheckpointDamaged(self.problem)
        try:
            return self._load_verified(plan, planner)
        finally:
            self._release()

    def _load_verified(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """torch's ``FileSystemReader.read_data`` (torch 2.13) over the verified mapped bytes,
        with one copy per tensor instead of two: torch's reads each item into a fresh storage
        (``torch.load`` of a stream) and then copies that into the target; here the item's
        tensor is a view of the mapped page cache (:func:`_tensor_over`) and the copy into the
        target is the only one."""
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            view = self._maps[str(self.directory / info.relative_path)]
            chunk = view[info.offset : info.offset + info.length]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(chunk))
                continue
            source = narrow_tensor_by_index(_tensor_over(chunk), item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise CheckpointError(
                    f"{info.relative_path}: item at offset {info.offset} has shape "
                    f"{tuple(source.size())}, the state expects {tuple(target.size())}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)
            del source, chunk  # no view of the mapping outlives the load (_release)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # -- the one pass ---------------------------------------------------------------------------
    def _map_and_verify(self, plan: LoadPlan) -> str | None:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append(info)
        for name in sorted(per_file):
            expected = self._expected(name)
            view = self._map(name)
            if view is None:
                return f"{name} is missing"
            if len(view) != expected["size"]:
                return f"{name} has {len(view)} bytes, its manifest says {expected['size']}"
            for info in per_file[name]:
                if info.transform_descriptors:
                    return f"{name}: the item at offset {info.offset} is transformed (not ours)"
                recorded = expected["items"].get(str(info.offset))
                if recorded is None or recorded[0] != info.length:
                    return f"{name}: no checksum for the item at offset {info.offset}"
                _populate(view, info.offset, info.length)
                if self._fails_checksum(view[info.offset : info.offset + info.length], recorded[1]):
                    return f"{name} fails its checksum (item at offset {info.offset})"
        return None

    def _fails_checksum(self, chunk: memoryview, recorded: int) -> bool:
        return crc32(chunk) != recorded

    def _map(self, name: str) -> memoryview | None:
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                view = memoryview(b"")
            else:
                # No MAP_POPULATE: a rank may need a few KB of a peer's file (the replicated
                # items DCP saved there); only the ranges it loads are faulted in (_populate).
                # Copy-on-write (as torch.load(mmap=True)): a writable buffer for
                # torch.frombuffer, pages shared with the page cache, the file never written.
                mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
                view = memoryview(mapped)
        finally:
            os.close(fd)
        self._maps[str(path)] = view
        return view

    def _release(self) -> None:
        maps = list(self._maps.values())
        self._maps.clear()
        for view in maps:
            base = view.obj
            with contextlib.suppress(BufferError):  # a slice still held: unmapped when freed
                view.release()
                if isinstance(base, mmap.mmap):
                    base.close()


# Linux >= 5.14 (``madvise(2)``); Python 3.11's mmap module does not name it yet.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _populate(view: memoryview, offset: int, length: int) -> None:
    """Fault one item's pages in with one call instead of one fault per page (best effort)."""
    base = view.obj
    if not isinstance(base, mmap.mmap) or length == 0:
        return
    start = offset - offset % mmap.PAGESIZE
    # An older kernel refuses it: the CRC's reads then fault the pages in instead.
    with contextlib.suppress(OSError):
        base.madvise(_MADV_POPULATE_READ, start, offset + length - start)


def _tensor_over(chunk: memoryview) -> torch.Tensor:
    """The tensor of one DCP item (a ``torch.save`` archive inside a shard file), its storage a
    view of ``chunk`` instead of a copy: what ``torch.load(mmap=True)`` does for an archive
    that is a whole file (``torch/serialization.py``: ``_load``'s ``overall_storage``, each
    record a slice of it at ``get_record_offset``), for an archive at an offset in one. torch
    is pinned exactly (pyproject.toml), and these private names with it."""
    storage = torch.frombuffer(chunk, dtype=torch.uint8).untyped_storage()
    with serialization._open_zipfile_reader(_MappedStream(chunk)) as archive:
        return serialization._load(
            archive, "cpu", serialization._weights_only_unpickler, overall_storage=storage
        )


def _agree(problem: str | None) -> str | None:
    """Every rank's verdict, gathered: the first problem found anywhere, on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return problem
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return next((p for p in gathered if p), None)


class _MappedFileSystem(FileSystem):
    """torch's ``FileSystem``, serving reads of the files :class:`VerifyingReader` has mapped
    (and verified) from memory instead of opening them again."""

    def __init__(self, maps: dict[str, memoryview]) -> None:
        super().__init__()
        self._maps = maps

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        view = self._maps.get(str(path)) if mode == "rb" else None
        if view is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _MappedStream(view) as stream:
            yield stream


__all__ = [
    "CheckpointDamaged",
    "ChecksummingTransforms",
    "ChecksummingWriter",
    "FileSums",
    "VerifyingReader",
    "write_buckets",
]
