"""Sharded checkpoints with an explicit commit protocol.

Layout under the checkpoint root (FSx in the cluster, a local directory here)::

    step_00000100/
        __0_0.distcp, __1_0.distcp, ...   one file per rank, written by that rank (DCP format)
        .metadata                         DCP's global metadata (rank 0)
        .shards/rank_00000.json           per rank: its files' sizes and CRC32s, fsynced
        commit.json                       the commit record; written last, atomically

A checkpoint is *committed* once ``commit.json`` exists: rank 0 writes it (temp file, fsync,
rename, fsync of the directory) only after every rank's shard files and manifest are durable.
Anything without it is torn and is never loaded. Loading verifies sizes and checksums (spread
across ranks) and falls back to the previous committed checkpoint, with a warning, when the
newest is damaged. Retention keeps the newest ``keep_last`` (plus every ``keep_every``-th step)
and never deletes the newest committed checkpoint.

Engines: ``nvrx`` (NVRx async, persistent worker; default), ``torch_async`` (torch DCP
``async_save`` in a process), ``sync`` (blocking DCP save). All three produce the same layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from training.config import CheckpointConfig
from training.metrics import EventLog

COMMIT = "commit.json"
SHARDS = ".shards"
STEP_DIR = re.compile(r"^step_(\d{8})$")
CHUNK = 8 * 1024 * 1024


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a save could not be committed."""


class StatefulTrainer(Protocol):
    step: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ---------------------------------------------------------------------------------------------
# files: checksums, manifests, the commit record
# ---------------------------------------------------------------------------------------------


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Temp file + fsync + rename + fsync(dir): the file is either absent or complete."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def rank_files(checkpoint_dir: Path, rank: int) -> list[Path]:
    return sorted(checkpoint_dir.glob(f"__{rank}_*.distcp"))


def write_rank_manifest(checkpoint_dir: str, rank: int) -> None:
    """Record this rank's shard files (size + CRC32) once they are written and fsynced.

    Module-level so that NVRx's persistent worker can run it right after the write."""
    directory = Path(checkpoint_dir)
    files = {}
    for path in rank_files(directory, rank):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # cheap if the writer already synced; makes torch's engines durable too
        finally:
            os.close(fd)
        files[path.name] = {"size": path.stat().st_size, "crc32": file_crc32(path)}
    (directory / SHARDS).mkdir(exist_ok=True)
    write_json_atomic(directory / SHARDS / f"rank_{rank:05d}.json", {"rank": rank, "files": files})


def commit(checkpoint_dir: Path, *, step: int, world_size: int, engine: str) -> dict[str, Any]:
    """Rank 0: check that every rank's manifest is there, then write the commit record."""
    files: dict[str, dict[str, int]] = {}
    for rank in range(world_size):
        manifest_path = checkpoint_dir / SHARDS / f"rank_{rank:05d}.json"
        if not manifest_path.is_file():
            raise CheckpointError(f"cannot commit {checkpoint_dir}: rank {rank} has no manifest")
        files.update(json.loads(manifest_path.read_text())["files"])
    metadata = checkpoint_dir / ".metadata"
    if not metadata.is_file():
        raise CheckpointError(f"cannot commit {checkpoint_dir}: DCP .metadata is missing")
    files[".metadata"] = {"size": metadata.stat().st_size, "crc32": file_crc32(metadata)}
    fsync_dir(checkpoint_dir)
    record = {
        "format": "fsdp-ckpt/1",
        "step": step,
        "world_size": world_size,
        "engine": engine,
        "committed_at": time.time(),
        "files": files,
    }
    write_json_atomic(checkpoint_dir / COMMIT, record)
    return record


def verify(checkpoint_dir: Path, *, names: list[str] | None = None) -> str | None:
    """Check sizes and CRCs against the commit record; returns a problem, or None if sound."""
    try:
        record = json.loads((checkpoint_dir / COMMIT).read_text())
    except (OSError, ValueError) as err:
        return f"unreadable commit record ({err})"
    for name, expected in sorted(record["files"].items()):
        if names is not None and name not in names:
            continue
        path = checkpoint_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, the commit record says {expected['size']}"
        if file_crc32(path) != expected["crc32"]:
            return f"{name} fails its checksum"
    return None


def committed_steps(root: Path) -> list[int]:
    """Steps of committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and (entry / COMMIT).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def retention_victims(steps: list[int], *, keep_last: int, keep_every: int) -> list[int]:
    """Committed steps to delete: all but the newest ``keep_last`` and the ``keep_every``
    multiples. The newest committed checkpoint is never a victim."""
    keep = set(steps[-max(1, keep_last) :])
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


# ---------------------------------------------------------------------------------------------
# the manager
# ---------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    step: int
    path: Path
    started: float
    future: Any = None  # torch_async only


class CheckpointManager:
    """Save, commit, retain and load checkpoints. Collective: call on every rank in step."""

    def __init__(
        self,
        *,
        config: CheckpointConfig,
        root: Path,
        rank: int,
        world_size: int,
        events: EventLog,
        fault_hook=None,
    ) -> None:
        self.config = config
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.events = events
        self.fault_hook = fault_hook or (lambda point, step: None)
        self._pending: list[_Pending] = []
        self._latest_committed: int | None = None
        self._nvrx = None
        self._local = None
        if config.local_dir:
            from training.local_checkpoint import LocalCheckpoints

            self._local = LocalCheckpoints(
                root=Path(config.local_dir),
                session_id=root.name,
                world_size=world_size,
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
            )
        if config.engine == "nvrx":
            from training.nvrx import AsyncCheckpointQueue

            self._nvrx = AsyncCheckpointQueue()
        self._local_pending = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Create the root, clear torn checkpoints of earlier attempts, start the NVRx worker."""
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_torn()
        dist.barrier()
        if self._nvrx is not None:
            self._nvrx.start_worker()

    def _remove_torn(self) -> None:
        # Only called at start, on rank 0, before any save of this attempt: an uncommitted
        # directory then belongs to an attempt that died, never to a write in flight.
        for entry in self.root.iterdir():
            if STEP_DIR.match(entry.name) and not (entry / COMMIT).is_file():
                shutil.rmtree(entry, ignore_errors=True)

    def close(self) -> None:
        """Commit what is pending and stop the background worker (collective)."""
        self.wait()
        if self._nvrx is not None:
            self._nvrx.close()
            self._nvrx = None
        if self._local is not None:
            self._local.close()

    def abandon(self) -> None:
        """After a fault: drop pending saves (they stay uncommitted) without collectives."""
        self._pending.clear()
        if self._nvrx is not None:
            self._nvrx.abandon()
            self._nvrx = None
        if self._local is not None:
            self._local.abandon()
            self._local_pending = False

    # -- saving --------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self._latest_committed

    def save(self, trainer: StatefulTrainer, *, step: int, blocking: bool) -> float:
        """Save ``trainer``'s state for ``step``. Returns the time training was blocked."""
        started = time.perf_counter()
        path = step_dir(self.root, step)
        if self.rank == 0:
            if path.exists():
                # A checkpoint of this step from an earlier attempt (found damaged, or torn):
                # un-commit it first, so its old record never vouches for new, partial files.
                (path / COMMIT).unlink(missing_ok=True)
                shutil.rmtree(path)
            path.mkdir(parents=True)
        dist.barrier()  # the directory exists before any rank writes into it
        state = {"trainer": trainer.state_dict()}
        engine = self.config.engine
        pending = _Pending(step=step, path=path, started=time.time())
        if engine == "sync":
            dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=True))
            write_rank_manifest(str(path), self.rank)
            self._finalize(pending)
        elif engine == "torch_async":
            # torch's async_save stages on the caller and writes in a background process.
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            # On CPU nothing copies the live tensors before the background write: clone them.
            staged = state if torch.cuda.is_available() else _snapshot(state)
            pending.future = dcp.async_save(
                staged,
                storage_writer=FileSystemWriter(path, sync_files=True),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            self._pending.append(pending)
        else:
            assert self._nvrx is not None
            self._wait_for_own_writes()
            self._nvrx.schedule_save(
                state_dict=state,
                checkpoint_dir=str(path),
                after_write=partial(write_rank_manifest, str(path), self.rank),
                finalize=partial(self._finalize, pending),
            )
            self._pending.append(pending)
        blocking_s = time.perf_counter() - started
        self.events.emit("checkpoint_staged", step=step, blocking_s=blocking_s, engine=engine)
        self.fault_hook("staged", step)
        if blocking:
            self.wait()
        return blocking_s

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

    def poll(self) -> None:
        """Commit every save that all ranks have finished writing (cheap when none pending)."""
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
            self._local.poll(blocking=True)
            self._local_pending = False
        if self.config.engine == "torch_async" and self._pending:
            self._poll_torch_async(blocking=True)

    def _poll_torch_async(self, *, blocking: bool) -> None:
        while self._pending:
            head = self._pending[0]
            if blocking:
                head.future.result()
            done = torch.tensor(
                [1 if head.future.done() else 0], dtype=torch.int32, device=collective_device()
            )
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if not done.item():
                return
            head.future.result()  # re-raises a failed write
            write_rank_manifest(str(head.path), self.rank)
            self._finalize(head)

    def _finalize(self, pending: _Pending) -> None:
        """Every rank's files are durable: rank 0 commits, then applies retention."""
        if pending in self._pending:
            self._pending.remove(pending)
        self.fault_hook("written", pending.step)
        dist.barrier()  # every rank's manifest is on disk before rank 0 reads them
        if self.rank == 0:
            self.fault_hook("commit", pending.step)
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
        self._latest_committed = pending.step

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
    def load_latest(self, trainer: StatefulTrainer) -> int | None:
        """Load the newest sound committed checkpoint into ``trainer``; None if there is none.

        All ranks walk the same candidates in the same order and agree on each verdict, so they
        always load the same checkpoint."""
        if not self.config.resume:
            return None
        candidates = committed_steps(self.root) if self.rank == 0 else []
        shared: list[Any] = [candidates]
        dist.broadcast_object_list(shared, src=0)
        candidates = shared[0]
        if self._local is not None:
            local_step = self._local.latest_step()  # collective: needs every rank's shard
            if local_step is not None and local_step > max(candidates, default=-1):
                started = time.perf_counter()
                step = self._local.load_into(trainer)
                self.events.emit(
                    "checkpoint_load",
                    step=step,
                    path=str(self.config.local_dir),
                    seconds=time.perf_counter() - started,
                    source="local",
                )
                return step
        for step in reversed(candidates):
            path = step_dir(self.root, step)
            problem = self._verify_collectively(path) if self.config.verify_on_load else None
            if problem is not None:
                message = f"checkpoint {path} is damaged ({problem}); falling back to the previous"
                if self.rank == 0:
                    warnings.warn(message, stacklevel=2)
                    print(f"WARNING: {message}", flush=True)
                self.events.emit("checkpoint_rejected", step=step, path=str(path), problem=problem)
                continue
            started = time.perf_counter()
            dcp.load({"trainer": trainer}, storage_reader=FileSystemReader(path))
            seconds = time.perf_counter() - started
            self.events.emit("checkpoint_load", step=step, path=str(path), seconds=seconds)
            self._latest_committed = step
            return step
        if candidates:
            raise CheckpointError(
                f"every committed checkpoint under {self.root} is damaged; "
                "move them aside to start fresh (checkpoint.resume=false ignores them)"
            )
        return None

    def _verify_collectively(self, path: Path) -> str | None:
        try:
            record = json.loads((path / COMMIT).read_text())
            names = sorted(record["files"])
            mine = names[self.rank :: self.world_size]
            problem = verify(path, names=mine)
        except (OSError, ValueError, KeyError) as err:
            problem = f"unreadable commit record ({err})"
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, problem)
        problems = [p for p in gathered if p]
        return problems[0] if problems else None


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


def _snapshot(state: Any) -> Any:
    """Deep copy of the tensors in a state dict (DTensors keep their sharding)."""
    if isinstance(state, dict):
        return {key: _snapshot(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_snapshot(value) for value in state]
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state
