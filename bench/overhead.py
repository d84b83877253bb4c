"""Overhead benchmark: steady-state step time with the resilience machinery on and off.

Three fault-free local runs of the same job (2 CPU ranks, gloo, the debug model, checkpoints only
at the end), one per restart layer: ``none`` (plain torchrun), ``inprocess`` (NVRx Wrapper with
its monitor threads and per-step pings) and ``injob`` (ft_launcher, rank monitors, a heartbeat
and a section per step). Per run: the median over steady-state steps (the first ``WARMUP`` steps
excluded) of

- ``step_time_s`` as the trainer logs it (the step's compute and all-reduce), and
- the interval between consecutive steps' end times, which also covers the per-step hooks
  (pings, heartbeats, sections) and logging: the overhead ratio is computed on this one.

The runs go one after the other, in rotating order when ``--rounds`` > 1 (medians over rounds).

    python -m bench.overhead            # 1 round of 3 runs x 40 steps, ~2 min
    python -m bench.overhead --quick    # 30 steps each

Writes bench/results/overhead.json (``overhead_inprocess``, ``overhead_injob``: ratio - 1).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

from bench.common import (
    RUNS_DIR,
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

MODES = ("none", "inprocess", "injob")
WARMUP = 10


def steady_state(run_dir, *, warmup: int) -> dict[str, Any]:
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("attempt", 0) == 0]
    metrics.sort(key=lambda m: m["step"])
    steady = [m for m in metrics if m["step"] > warmup]
    intervals = [b["time"] - a["time"] for a, b in itertools.pairwise(steady)]
    return {
        "steps": len(metrics),
        "step_time_s": median(m["step_time_s"] for m in steady),
        "interval_s": median(intervals),
    }


def run(*, quick: bool = False, rounds: int = 1) -> dict[str, Any]:
    """Run every mode ``rounds`` times, print the table and write the JSON."""
    steps = 30 if quick else 40
    per_mode: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for round_ in range(rounds):
        order = MODES[round_ % 3 :] + MODES[: round_ % 3]
        for mode in order:
            run_dir = RUNS_DIR / "overhead" / f"{mode}_{round_}"
            done = run_local(
                run_dir=run_dir,
                nproc=2,
                restart=mode,
                overrides=(
                    f"--train.steps={steps}",
                    "--checkpoint.interval=0",
                    "--resilience.heartbeat_timeout_s=60",
                ),
                timeout_s=300,
            )
            stats = steady_state(run_dir, warmup=min(WARMUP, steps // 3))
            stats.update(returncode=done.returncode, wall_s=done.wall_s)
            per_mode[mode].append(stats)
    modes: dict[str, dict[str, Any]] = {}
    for mode, runs in per_mode.items():
        modes[mode] = {
            "step_time_s": median(r["step_time_s"] for r in runs),
            "interval_s": median(r["interval_s"] for r in runs),
            "runs": runs,
        }
    base = modes["none"]["interval_s"]
    for mode in MODES:
        modes[mode]["ratio"] = ratio(modes[mode]["interval_s"], base)
        modes[mode]["step_time_ratio"] = ratio(
            modes[mode]["step_time_s"], modes["none"]["step_time_s"]
        )
    targets = [
        target(
            f"{mode} step interval / none - 1",
            None if modes[mode]["ratio"] is None else modes[mode]["ratio"] - 1.0,
            goal=0.03,
            higher_is_better=False,
        )
        for mode in ("inprocess", "injob")
    ]
    result = {
        "machine": machine(),
        "quick": quick,
        "steps": steps,
        "warmup_steps": WARMUP,
        "rounds": rounds,
        "modes": modes,
        "overhead_inprocess": targets[0]["value"],
        "overhead_injob": targets[1]["value"],
        "targets": targets,
    }
    print(report(result), flush=True)
    write_result("overhead", result)
    return result


def report(result: dict[str, Any]) -> str:
    rows = [
        (mode, m["step_time_s"], m["step_time_ratio"], m["interval_s"], m["ratio"])
        for mode, m in result["modes"].items()
    ]
    return "\n".join(
        [
            f"overhead: 2 ranks, debug model, {result['steps']} steps, no faults, "
            f"medians after {result['warmup_steps']} warm-up steps",
            table(["layer", "step_time s", "x none", "step interval s", "x none"], rows),
            "",
            targets_table(result["targets"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="30 steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="runs per mode (rotating order)")
    args = parser.parse_args(argv)
    run(quick=args.quick, rounds=max(1, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
