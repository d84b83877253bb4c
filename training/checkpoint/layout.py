"""Sharded checkpoints with an explicit commit protocol.

Layout under the checkpoint root (FSx in the cluster, a local directory here)::

    step_00000100/
        __0_0.distcp, __1_0.distcp, ...   one file per rank, written by that rank (DCP format)
        .metadata                         DCP's global metadata (rank 0)
        .shards/rank_00000.json           per rank: its files' sizes, CRC32s and per-item CRC32s
        commit.json                       the commit record; written last, atomically

A checkpoint is *committed* once ``commit.json`` exists: rank 0 writes it (temp file, fsync,
rename, fsync of the directory) only after every rank's shard files and manifest are durable.
Anything without it is torn and is never loaded. Checksums are taken while the files are
written and checked while the load reads them (``training.checkpoint.integrity``); a damaged
checkpoint is rejected by every rank before any state is modified, and the load falls back
to the previous committed checkpoint, with a warning. Retention keeps the newest
``keep_last`` (plus every ``keep_every``-th step) and never deletes the newest committed
checkpoint.

Engines: ``nvrx`` (NVRx async, persistent worker; default), ``torch_async`` (torch DCP
``async_save`` in a process), ``sync`` (blocking DCP save). All three produce the same layout.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

# ISA-L's CRC-32: the same values as zlib.crc32 (so a checkpoint written with either verifies
# with the other), about 20 GB/s here against zlib's 2.7 (bench/checkpoint.py measures both).
from isal.isal_zlib import crc32

from training.durable import fsync_dir, write_json_atomic

COMMIT = "commit.json"
SHARDS = ".shards"
STEP_DIR = re.compile(r"^step_(\d{8})$")
CHUNK = 8 * 1024 * 1024


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a save could not be committed."""


# ---------------------------------------------------------------------------------------------
# files: checksums, manifests, the commit record
# ---------------------------------------------------------------------------------------------


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = crc32(chunk, crc)
    return crc


def rank_files(checkpoint_dir: Path, rank: int) -> list[Path]:
    return sorted(checkpoint_dir.glob(f"__{rank}_*.distcp"))


def write_rank_manifest(checkpoint_dir: str, rank: int, files: dict[str, Any]) -> None:
    """Record this rank's shard files once they are written and fsynced: per file its size,
    CRC32 and per-item CRCs, all taken while the bytes were written
    (``training.checkpoint.integrity``); nothing is read back.

    Module-level so that NVRx's persistent worker can run it right after the write
    (``partial(write_rank_manifest, dir, rank)(files)``)."""
    directory = Path(checkpoint_dir)
    (directory / SHARDS).mkdir(exist_ok=True)
    write_json_atomic(directory / SHARDS / f"rank_{rank:05d}.json", {"rank": rank, "files": files})


def commit(checkpoint_dir: Path, *, step: int, world_size: int, engine: str) -> dict[str, Any]:
    """Rank 0: check that every rank's manifest is there, then write the commit record."""
    files: dict[str, dict[str, int]] = {}
    for rank in range(world_size):
        manifest_path = checkpoint_dir / SHARDS / f"rank_{rank:05d}.json"
        if not manifest_path.is_file():
            raise CheckpointError(f"cannot commit {checkpoint_dir}: rank {rank} has no manifest")
        shards = json.loads(manifest_path.read_text())["files"]
        # Per-file size and CRC only: the per-item CRCs stay in the rank manifests (the
        # commit record stays small at any scale; a reader loads the manifests it needs).
        files.update({name: {"size": s["size"], "crc32": s["crc32"]} for name, s in shards.items()})
    metadata = checkpoint_dir / ".metadata"
    if not metadata.is_file():
        raise CheckpointError(f"cannot commit {checkpoint_dir}: DCP .metadata is missing")
    # .metadata is written by DCP's finish on this rank (KBs to a few MB): read back once here.
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


def apply_retention(root: Path, *, keep_last: int, keep_every: int) -> None:
    """Delete the committed checkpoints :func:`retention_victims` names (rank 0, after a
    commit)."""
    for victim in retention_victims(
        committed_steps(root), keep_last=keep_last, keep_every=keep_every
    ):
        path = step_dir(root, victim)
        # Drop the commit record first: a half-deleted directory is then merely torn.
        (path / COMMIT).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)


def remove_torn(root: Path) -> None:
    """Delete every uncommitted step directory under ``root``. Only at the start, on rank 0,
    before any save of the attempt: an uncommitted directory then belongs to an attempt that
    died, never to a write in flight."""
    for entry in root.iterdir():
        if STEP_DIR.match(entry.name) and not (entry / COMMIT).is_file():
            shutil.rmtree(entry, ignore_errors=True)


def fresh_step_dir(root: Path, step: int) -> Path:
    """An empty directory for a save of ``step`` (rank 0). A checkpoint of this step from an
    earlier attempt (found damaged, or torn) is un-committed first, so its old record never
    vouches for new, partial files."""
    path = step_dir(root, step)
    if path.exists():
        (path / COMMIT).unlink(missing_ok=True)
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path
