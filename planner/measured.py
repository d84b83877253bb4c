"""The CPU measurements from ``make bench`` as a cost model (``--costs measured-cpu``).

They were taken on a 2-core CPU machine with gloo, a tiny model and local disk: no NCCL at N
ranks, no FSx, no pods or nodes. They show what this code's restart layers cost on that
machine, not what a cluster pays, so they are never the default; the output labels them.
"""

from __future__ import annotations

import json
from pathlib import Path

from planner.costs import DEFAULTS, CostModel

KEYS: dict[str, tuple[str, str]] = {
    "ckpt_stall_s": ("checkpoint.json", "nvrx_async_blocking_s"),
    "inprocess_s": ("restart.json", "inprocess_p50_s"),
    "injob_s": ("restart.json", "injob_p50_s"),
    "cold_s": ("restart.json", "cold_p50_s"),
}


def _value(path: Path, key: str) -> float:
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"cannot read {path}: {e} (run `make bench` first)") from None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{path} has no positive {key!r} (run `make bench` first)")
    return float(value)


def measured_cpu_model(*, bench_dir: Path) -> CostModel:
    """The measured model; raises ValueError naming the missing file or key."""
    measured = {name: _value(bench_dir / f, key) for name, (f, key) in KEYS.items()}
    return CostModel(
        name="measured-cpu",
        params={k: p.value for k, p in DEFAULTS.items()},
        sources={k: "bench" for k in DEFAULTS},
        measured=measured,
    )


def describe(*, bench_dir: Path) -> list[str]:
    """Where each measured number came from, for the report."""
    return [f"{name}: {bench_dir / f} {key}" for name, (f, key) in KEYS.items()]
