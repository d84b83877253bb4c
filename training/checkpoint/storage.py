"""The ``storage`` restore tier: the committed checkpoints on shared storage (FSx).

Rank 0 lists the committed steps and every rank takes its list (``broadcast_object_list``); a
step is loaded with verification (``integrity.VerifyingReader``: every byte checked against
the CRCs taken at write time, the verdict agreed before any state changes), and a damaged one
is rejected on every rank, with a warning, so that the next candidate is tried.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader

from training.checkpoint.integrity import CheckpointDamaged, VerifyingReader, gc_paused
from training.checkpoint.layout import committed_steps, step_dir
from training.checkpoint.tiers import Rejected, Restored, state_bytes


class StorageTier:
    """See the module docstring."""

    name = "storage"

    def __init__(self, *, root: Path, rank: int, world_size: int, verify_on_load: bool) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.verify_on_load = verify_on_load

    def steps(self) -> list[int]:
        candidates = committed_steps(self.root) if self.rank == 0 else []
        shared: list[Any] = [candidates]
        dist.broadcast_object_list(shared, src=0)
        return sorted(shared[0], reverse=True)

    def load(self, trainer: Any, *, step: int) -> Restored | Rejected:
        path = step_dir(self.root, step)
        with gc_paused():
            problem = self._load_verified(trainer, path)
        if problem is not None:
            message = f"checkpoint {path} is damaged ({problem}); falling back to the previous"
            if self.rank == 0:
                warnings.warn(message, stacklevel=2)
                print(f"WARNING: {message}", flush=True)
            return Rejected(path=str(path), problem=problem)
        return Restored(path=str(path), nbytes=state_bytes(trainer.state_dict()))

    def _load_verified(self, trainer: Any, path: Path) -> str | None:
        """Load ``path`` into ``trainer`` in one read pass; the problem if it is damaged.

        With ``verify_on_load`` the reader checks every byte it loads against the CRCs taken at
        write time, and all ranks agree before any state is modified
        (``integrity.VerifyingReader``). DCP raises on every rank when any rank fails (its
        collective ``reduce_scatter`` / ``all_gather`` steps); the ranks then pool what their
        readers found, so that all of them reject the checkpoint, or all re-raise an error that
        is not damage."""
        if not self.verify_on_load:
            dcp.load({"trainer": trainer}, storage_reader=FileSystemReader(path))
            return None
        reader = VerifyingReader(path)
        try:
            dcp.load({"trainer": trainer}, storage_reader=reader)
            return None
        except (CheckpointException, CheckpointDamaged) as err:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, reader.problem)
            problem = next((p for p in gathered if p), None)
            if problem is None:
                raise err
            return problem
