"""Restart benchmark: seconds from a fault to the next completed training step.

One local run (2 CPU ranks, gloo, a tiny model so steps take ~0.1 s) per scenario, several faults
per run (steps 25, 45, 65, 85, 105, alternating ranks; a checkpoint every 10 steps):

- in-process restart (NVRx ``inprocess.Wrapper``): ``exception`` and ``hang``;
- in-job restart (``ft_launcher``): ``sigkill`` and ``hang``;
- cold restart (plain torchrun, ``--restart none --cold-restarts K``: the whole job is launched
  again and resumes from the newest committed checkpoint): ``sigkill``.

Latency of one fault = (end of the first step completed after the fault event) - (fault event
time), from events.jsonl and metrics.jsonl; p50 and max per scenario. Hangs are detected by
short timeouts (see ``TIMEOUTS``): in-process soft 8 s / hard 20 s, in-job heartbeat and step
section 10 s, checkpoint section 30 s. Shorter ones fire spuriously on this 2-core machine while a
restarted attempt starts its checkpoint worker.

    python -m bench.restart            # 5 scenarios x 5 faults, ~8-10 min
    python -m bench.restart --quick    # 2 faults per scenario, in-process only

Writes bench/results/restart.json: ``inprocess_p50_s``, ``injob_p50_s``, ``cold_p50_s`` (p50
over every fault of that layer, all kinds pooled; the planner reads them) and per-scenario detail.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    RUNS_DIR,
    TINY_MODEL,
    machine,
    median,
    ratio,
    read_jsonl,
    run_local,
    table,
    target,
    targets_table,
    write_result,
)

FAULT_STEPS = (25, 45, 65, 85, 105)
QUICK_FAULT_STEPS = (25, 45)
TIMEOUTS: tuple[str, ...] = (
    "--resilience.soft_timeout_s=8",
    "--resilience.hard_timeout_s=20",
    "--resilience.heartbeat_timeout_s=10",
    "--resilience.step_section_timeout_s=10",
    "--resilience.checkpoint_section_timeout_s=30",
    "--parallel.pg_timeout_s=60",
)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    layer: str
    """inprocess, injob or cold."""
    kind: str
    """The fault kind injected."""

    @property
    def restart(self) -> str:
        return "none" if self.layer == "cold" else self.layer


SCENARIOS = (
    Scenario(name="inprocess_exception", layer="inprocess", kind="exception"),
    Scenario(name="inprocess_hang", layer="inprocess", kind="hang"),
    Scenario(name="injob_sigkill", layer="injob", kind="sigkill"),
    Scenario(name="injob_hang", layer="injob", kind="hang"),
    Scenario(name="cold_sigkill", layer="cold", kind="sigkill"),
)


def fault_latencies(run_dir: Path) -> list[float | None]:
    """Per fault event: seconds to the end of the first step completed after it (None: never)."""
    faults = sorted(
        float(e["time"]) for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "fault"
    )
    steps = sorted(float(m["time"]) for m in read_jsonl(run_dir / "metrics.jsonl"))
    out: list[float | None] = []
    for t in faults:
        after = next((s for s in steps if s > t), None)
        out.append(after - t if after is not None else None)
    return out


def run_scenario(scenario: Scenario, *, fault_steps: tuple[int, ...]) -> dict[str, Any]:
    spec = ";".join(f"{scenario.kind}@{(i + 1) % 2}:{s}" for i, s in enumerate(fault_steps))
    run_dir = RUNS_DIR / "restart" / scenario.name
    run = run_local(
        run_dir=run_dir,
        nproc=2,
        restart=scenario.restart,
        faults=spec,
        cold_restarts=len(fault_steps) + 2 if scenario.layer == "cold" else 0,
        overrides=(
            *TINY_MODEL,
            f"--train.steps={fault_steps[-1] + 10}",
            "--checkpoint.interval=10",
            f"--resilience.max_restarts={len(fault_steps) + 3}",
            *TIMEOUTS,
        ),
        timeout_s=600,
    )
    latencies = fault_latencies(run_dir)
    done = [v for v in latencies if v is not None]
    return {
        "layer": scenario.layer,
        "kind": scenario.kind,
        "faults_injected": len(fault_steps),
        "faults_seen": len(latencies),
        "recovered": len(done),
        "latencies_s": latencies,
        "p50_s": median(done),
        "max_s": max(done) if done else None,
        "returncode": run.returncode,
        "wall_s": run.wall_s,
        "run_dir": str(run_dir),
    }


def run(*, quick: bool = False) -> dict[str, Any]:
    """Run the scenarios one after the other, print the table and write the JSON."""
    fault_steps = QUICK_FAULT_STEPS if quick else FAULT_STEPS
    scenarios = [s for s in SCENARIOS if s.layer == "inprocess"] if quick else list(SCENARIOS)
    results = {s.name: run_scenario(s, fault_steps=fault_steps) for s in scenarios}
    pooled: dict[str, float | None] = {}
    for layer in ("inprocess", "injob", "cold"):
        values = [
            v
            for r in results.values()
            if r["layer"] == layer
            for v in r["latencies_s"]
            if v is not None
        ]
        pooled[layer] = median(values)
    targets = [
        target(
            "in-process restart / cold restart (p50)",
            ratio(pooled["inprocess"], pooled["cold"]),
            goal=0.3,
            higher_is_better=False,
        ),
        target(
            "in-job restart / cold restart (p50)",
            ratio(pooled["injob"], pooled["cold"]),
            goal=0.6,
            higher_is_better=False,
        ),
    ]
    result = {
        "machine": machine(),
        "quick": quick,
        "fault_steps": list(fault_steps),
        "timeouts": list(TIMEOUTS),
        "inprocess_p50_s": pooled["inprocess"],
        "injob_p50_s": pooled["injob"],
        "cold_p50_s": pooled["cold"],
        "scenarios": results,
        "targets": targets,
    }
    print(report(result), flush=True)
    write_result("restart", result)
    return result


def report(result: dict[str, Any]) -> str:
    rows = [
        (
            name,
            f"{r['recovered']}/{r['faults_injected']}",
            r["p50_s"],
            r["max_s"],
            r["returncode"],
            r["wall_s"],
        )
        for name, r in result["scenarios"].items()
    ]
    pooled = table(
        ["layer", "p50 s (all kinds)"],
        [
            ("inprocess", result["inprocess_p50_s"]),
            ("injob", result["injob_p50_s"]),
            ("cold", result["cold_p50_s"]),
        ],
    )
    return "\n".join(
        [
            "restart: fault -> next completed step (2 ranks, tiny model, short timeouts)",
            table(["scenario", "recovered", "p50 s", "max s", "exit", "run wall s"], rows),
            "",
            pooled,
            "",
            targets_table(result["targets"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="in-process only, 2 faults each")
    args = parser.parse_args(argv)
    run(quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
