"""The shard directory's format and its check, torch-free: the local launcher checks
``data.path`` before it starts any process (training/launch/local.py) without importing torch
(seconds of CPU on every run), and the ranks open the same shards through
``training.data.TokenShards``. The format itself: training/data.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "training-tokens/1"
META = "meta.json"


class DataError(ValueError):
    """The shard directory is missing, incomplete or does not match the config."""


@dataclass(frozen=True, kw_only=True)
class ShardFiles:
    maps: list[np.memmap]
    """Each shard's tokens, memory-mapped."""
    first_sample: list[int]
    """Index of each shard's first sample."""
    num_samples: int


def open_shards(*, path: Path, seq_len: int, vocab_size: int) -> ShardFiles:
    """Check the shard directory against the config and map its shards; a DataError naming the
    field and the fix when it does not fit."""
    meta_path = path / META
    if not meta_path.is_file():
        raise DataError(
            f"data.path: no {META} in {path}; build shards with "
            f"`python -m training prepare --stdlib --out {path}` (or `make data`)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as err:
        raise DataError(
            f"data.path: {meta_path} is not valid JSON ({err}); re-run prepare"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(f"data.path: {meta_path} has format {found!r}, expected {FORMAT!r}")
    if meta["vocab_size"] > vocab_size:
        raise DataError(
            f"model.vocab_size: {vocab_size} is smaller than the data's vocabulary "
            f"({meta['vocab_size']}); set --model.vocab_size={meta['vocab_size']} or more"
        )
    maps: list[np.memmap] = []
    first_sample: list[int] = []
    total = 0
    for shard in meta["shards"]:
        file = path / shard["file"]
        if not file.is_file() or file.stat().st_size != 2 * shard["num_tokens"]:
            raise DataError(f"data.path: shard {file} is missing or truncated; re-run prepare")
        maps.append(np.memmap(file, dtype="<u2", mode="r"))
        first_sample.append(total)
        total += max(0, (shard["num_tokens"] - 1) // seq_len)
    if total == 0:
        raise DataError(f"data.seq_len: {seq_len} is longer than every shard in {path}")
    return ShardFiles(maps=maps, first_sample=first_sample, num_samples=total)
