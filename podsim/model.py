"""The model every emulated pod run and every restart benchmark trains."""

from __future__ import annotations

# A model small enough that a 2-rank CPU step takes ~0.1 s: restart benchmarks then measure the
# restart machinery, not training.
TINY_MODEL: tuple[str, ...] = (
    "--model.dim=64",
    "--model.n_layers=2",
    "--data.seq_len=32",
    "--model.max_seq_len=64",
)
