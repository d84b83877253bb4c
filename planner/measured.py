"""The CPU measurements from ``make bench`` as a cost model (``--costs measured-cpu``).

They were taken on a 2-core CPU machine with gloo, a tiny model and local disk: no NCCL at N
ranks, no FSx, no pods or nodes. They show what this code's restart layers cost on that
machine, not what a cluster pays, so they are never the default; the output labels them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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


# --- node loss, measured in the pod emulation (bench/node_loss.py) ------------------------------

NODE_LOSS_FILE = "node_loss.json"
NODE_LOSS_COMMAND = "sudo .venv/bin/python -m bench.node_loss"
"""What writes bench/results/node_loss.json (pods need network namespaces, hence root)."""
NODE_LOSS_CASES: tuple[str, ...] = (
    "injob/spare",
    "injob/no-spare",
    "nested/spare",
    "nested/no-spare",
)
NODE_LOSS_PHASES: tuple[str, ...] = (
    "node_not_ready",
    "pod_failed",
    "replacement_running",
    "first_step",
)
"""Seconds from the fault, in order: what the emulated control plane does, then the trainer."""


@dataclass(frozen=True, kw_only=True)
class NodeLossCase:
    """One mode x spare case of the node-loss emulation (p50 over its runs)."""

    runs: int
    fault_to_first_step_p50_s: float
    phases_p50_s: dict[str, float]
    """Seconds from the fault to each phase, Kubernetes timers scaled by 1/timer_scale."""
    restart_p50_s: float
    """first_step - replacement_running: the product's own restart, not scaled."""
    bit_identical: bool


@dataclass(frozen=True, kw_only=True)
class NodeLoss:
    """bench/results/node_loss.json."""

    source: str
    timer_scale: int
    cases: dict[str, NodeLossCase]


def _number(data: dict, key: str, where: str) -> float:
    value = data.get(key) if isinstance(data, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise ValueError(
            f"{where}: {key!r} must be a number >= 0, got {value!r} (rerun `{NODE_LOSS_COMMAND}`)"
        )
    return float(value)


def node_loss(*, bench_dir: Path) -> NodeLoss | None:
    """The node-loss measurements, None when the file does not exist; raises ValueError naming
    the field when it exists but does not follow the schema (bench/node_loss.py writes it)."""
    path = bench_dir / NODE_LOSS_FILE
    if not path.exists():
        return None
    fix = f"(rerun `{NODE_LOSS_COMMAND}`)"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e} {fix}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cases"), dict):
        raise ValueError(f"{path}: no 'cases' object {fix}")
    scale = data.get("timer_scale")
    if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1:
        raise ValueError(f"{path}: 'timer_scale' must be an integer >= 1, got {scale!r} {fix}")
    cases = {}
    for name in NODE_LOSS_CASES:
        raw = data["cases"].get(name)
        where = f"{path} cases[{name!r}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: missing {fix}")
        phases = raw.get("phases_p50_s")
        if not isinstance(phases, dict):
            raise ValueError(f"{where}: 'phases_p50_s' must be an object {fix}")
        if not isinstance(raw.get("bit_identical"), bool):
            raise ValueError(f"{where}: 'bit_identical' must be true or false {fix}")
        cases[name] = NodeLossCase(
            runs=int(_number(raw, "runs", where)),
            fault_to_first_step_p50_s=_number(raw, "fault_to_first_step_p50_s", where),
            phases_p50_s={p: _number(phases, p, f"{where} phases_p50_s") for p in NODE_LOSS_PHASES},
            restart_p50_s=_number(raw, "restart_p50_s", where),
            bit_identical=raw["bit_identical"],
        )
    return NodeLoss(source=str(data.get("source", "")), timer_scale=scale, cases=cases)


# --- replica groups, measured in the fault test's recorded run ----------------------------------


def replica_rejoin_s(*, recorded: Path) -> float:
    """Seconds from the failed group's restored workers to the survivors' next committed step:
    the latest ``checkpoint_loaded`` of the restarted group's ranks (attempt > 0) to the first
    step in a survivor's metrics.jsonl after it, in a recorded run of 2 groups
    (``<run>/group-<g>/``) where one group failed once. The quorum with the group back, the
    heal (handshake and transfer of the emulation's tiny state) and the redone step of a tiny
    model: an upper bound of the fixed part, which the cluster model adds to a heal priced at
    EFA speed and a step at the job's step time. Not the group's own restart (priced at its
    size)."""

    def lines(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    events = {g: lines(recorded / f"group-{g}" / "events.jsonl") for g in (0, 1)}
    failed = next(
        g for g, found in events.items() if any(e.get("kind") == "replica_heal" for e in found)
    )
    loaded = max(
        e["time"]
        for e in events[failed]
        if e.get("phase") == "checkpoint_loaded" and (e.get("attempt") or 0) > 0
    )
    steps = lines(recorded / f"group-{1 - failed}" / "metrics.jsonl")
    return min(m["time"] for m in steps if m["time"] > loaded) - loaded
