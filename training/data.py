"""Tokenized shards on shared storage, and a deterministic, rank-aware, resumable sampler.

Shard format (one directory, written atomically by ``prepare``)::

    meta.json            {"format": "training-tokens/1", "tokenizer": "bytes", "vocab_size": 256,
                          "dtype": "uint16", "num_tokens": N,
                          "shards": [{"file": "shard_00000.bin", "num_tokens": n, "sha256": ...}]}
    shard_00000.bin      raw little-endian token ids, memory-mapped by every rank

A sample is a window of ``seq_len + 1`` tokens (input and shifted target) cut at a fixed stride
inside one shard. The sampler's only state is how many samples the whole job has consumed, so a
checkpoint resumes exactly, on any world size with the same global batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training.shards import FORMAT, META, DataError, open_shards

SHARD_TOKENS = 4 * 1024 * 1024  # tokens per shard file (8 MiB at uint16)
DOC_SEPARATOR = 0  # byte 0 never appears in source text; marks document boundaries


# ---------------------------------------------------------------------------------------------
# prepare: text files -> shards
# ---------------------------------------------------------------------------------------------


def stdlib_sources(*, max_bytes: int) -> list[Path]:
    """Python's own standard library source: present wherever Python is, no download needed.
    Sorted for determinism; tests and site-packages are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen: list[Path] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def _encode_bytes(paths: Iterable[Path]) -> np.ndarray:
    pieces: list[np.ndarray] = []
    for path in paths:
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        pieces.append(data[data != DOC_SEPARATOR])
        pieces.append(np.array([DOC_SEPARATOR], dtype=np.uint8))
    if not pieces:
        raise DataError("prepare: no input files (pass files/directories or --stdlib)")
    return np.concatenate(pieces).astype(np.uint16)


def prepare(*, sources: list[Path], out_dir: Path, shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenize ``sources`` with the byte tokenizer into shards under ``out_dir``.

    Written to a temporary sibling directory and renamed into place, so a failure never leaves a
    half-written shard directory that training could pick up.
    """
    files: list[Path] = []
    for src in sources:
        if src.is_dir():
            files.extend(sorted(p for p in src.rglob("*") if p.is_file()))
        elif src.is_file():
            files.append(src)
        else:
            raise DataError(f"prepare: input {src} does not exist")
    tokens = _encode_bytes(files)
    out_dir = out_dir.resolve()
    if (out_dir / META).exists():
        raise DataError(f"prepare: {out_dir} already holds shards; remove it or choose --out")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(f"prepare: {out_dir} exists and is not an empty directory; choose --out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        shards = []
        for index, start in enumerate(range(0, len(tokens), shard_tokens)):
            chunk = tokens[start : start + shard_tokens]
            name = f"shard_{index:05d}.bin"
            raw = chunk.astype("<u2").tobytes()
            (staging / name).write_bytes(raw)
            shards.append(
                {"file": name, "num_tokens": len(chunk), "sha256": hashlib.sha256(raw).hexdigest()}
            )
        meta = {
            "format": FORMAT,
            "tokenizer": "bytes",
            "vocab_size": 256,
            "dtype": "uint16",
            "num_tokens": len(tokens),
            "num_sources": len(files),
            "shards": shards,
        }
        (staging / META).write_text(json.dumps(meta, indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # only an empty directory may be replaced
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return meta


# ---------------------------------------------------------------------------------------------
# reading: shards -> samples
# ---------------------------------------------------------------------------------------------


class TokenShards:
    """Memory-mapped shards; ``sample(i)`` returns ``seq_len + 1`` token ids as int64."""

    def __init__(self, *, path: Path, seq_len: int, vocab_size: int) -> None:
        files = open_shards(path=path, seq_len=seq_len, vocab_size=vocab_size)
        self.seq_len = seq_len
        self._maps = files.maps
        self._first_sample = files.first_sample
        self.num_samples = files.num_samples

    def sample(self, index: int) -> torch.Tensor:
        shard = int(np.searchsorted(self._first_sample, index, side="right")) - 1
        start = (index - self._first_sample[shard]) * self.seq_len
        window = self._maps[shard][start : start + self.seq_len + 1]
        return torch.from_numpy(window.astype(np.int64))

    def batch(self, indices: list[int]) -> torch.Tensor:
        return torch.stack([self.sample(i) for i in indices])


@dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How one optimizer step's global batch is split across ranks and micro-batches."""

    world_size: int
    rank: int
    micro_batch_size: int
    grad_accum_steps: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.micro_batch_size * self.grad_accum_steps


class ResumableSampler:
    """Deterministic, rank-aware sample order whose position is checkpointed.

    Sample ``k`` of the job (counting across ranks and epochs) is ``perm_e[k % E]`` where ``E``
    is the epoch length rounded down to whole global batches and ``perm_e`` a permutation seeded
    by ``(seed, epoch)``. Within a step, micro-batch ``m`` of rank ``r`` takes positions
    ``m * world * micro + r * micro + [0, micro)``. Every rank computes the same order, so no
    communication is needed, and the only state is ``consumed_samples``.
    """

    def __init__(self, *, num_samples: int, layout: BatchLayout, seed: int, shuffle: bool) -> None:
        if num_samples < layout.global_batch:
            raise DataError(
                f"train.micro_batch_size: global batch {layout.global_batch} exceeds the "
                f"{num_samples} samples in the data; lower the batch or add data"
            )
        self.layout = layout
        self.seed = seed
        self.shuffle = shuffle
        self.epoch_len = (num_samples // layout.global_batch) * layout.global_batch
        self.num_samples = num_samples
        self.consumed_samples = 0
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 100003 + epoch)
                self._perm = torch.randperm(self.num_samples, generator=gen)
            else:
                self._perm = torch.arange(self.num_samples)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def next_step(self) -> list[list[int]]:
        """Sample indices for this rank for the next optimizer step: one list per micro-batch."""
        lay = self.layout
        epoch, offset = divmod(self.consumed_samples, self.epoch_len)
        perm = self._permutation(epoch)
        micro_batches = []
        for m in range(lay.grad_accum_steps):
            start = offset + (m * lay.world_size + lay.rank) * lay.micro_batch_size
            micro_batches.append(perm[start : start + lay.micro_batch_size].tolist())
        self.consumed_samples += lay.global_batch
        return micro_batches

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise DataError(
                f"train.seed: the checkpoint was taken with seed {state['seed']}, this run has "
                f"{self.seed}; resume with --train.seed={state['seed']} or a new checkpoint dir"
            )
        consumed = int(state["consumed_samples"])
        if consumed % self.layout.global_batch:
            raise DataError(
                f"train.micro_batch_size: resumed position {consumed} is not a whole number of "
                f"global batches of {self.layout.global_batch}; keep the global batch when resuming"
            )
        self.consumed_samples = consumed
