"""Goodput benchmark: ETTR of one fixed faulty run under each restart strategy, side by side.

The same job (4 CPU ranks, gloo, a tiny model, a checkpoint every 25 steps) with the same
fault schedule of mixed kinds that every strategy can recover from: an ``exception``, then a
``hang``, one every ``FAULT_EVERY`` = 100 steps (with the restarts, about one fault per 45-60 s
of wall on a 2-core machine), run three times:

- ``inprocess``: NVRx in-process restart, NVRx async checkpoints;
- ``injob``: ft_launcher in-job restart, NVRx async checkpoints;
- ``baseline``: plain torchrun, synchronous checkpoints, whole-job cold restart (relaunch and
  resume from the last checkpoint); its hang detector is the collective timeout
  (``parallel.pg_timeout_s`` = 20 s; the other two use the short timeouts of bench/restart.py).

ETTR = productive step time / wall time (``training.report.summarize``: run start to run end, so
start-up, checkpoint stalls, restarts and recomputed steps all count against it).

    python -m bench.goodput            # 3 runs x ~2-2.5 min
    python -m bench.goodput --quick    # 1 fault, 60 steps per run

Writes bench/results/goodput.json (``ettr_inprocess``, ``ettr_injob``, ``ettr_baseline``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.common import (
    RUNS_DIR,
    TINY_MODEL,
    machine,
    ratio,
    run_local,
    table,
    target,
    targets_table,
    write_result,
)
from bench.restart import TIMEOUTS

NPROC = 4
FAULT_EVERY = 100
KINDS = ("exception", "hang")
MODES: dict[str, dict[str, Any]] = {
    "inprocess": {"restart": "inprocess", "engine": "nvrx", "cold": 0, "extra": ()},
    "injob": {"restart": "injob", "engine": "nvrx", "cold": 0, "extra": ()},
    "baseline": {
        "restart": "none",
        "engine": "sync",
        "cold": 6,
        "extra": ("--parallel.pg_timeout_s=20",),
    },
}


def fault_spec(*, faults: int) -> str:
    return ";".join(
        f"{KINDS[i % len(KINDS)]}@{1 + i % (NPROC - 1)}:{FAULT_EVERY * (i + 1)}"
        for i in range(faults)
    )


def run(*, quick: bool = False) -> dict[str, Any]:
    """Run the three strategies one after the other, print the table and write the JSON."""
    from training.report import summarize

    faults = 1 if quick else len(KINDS)
    steps = 60 if quick else FAULT_EVERY * faults + 20
    spec = fault_spec(faults=faults) if not quick else "exception@1:45"
    modes: dict[str, dict[str, Any]] = {}
    for name, mode in MODES.items():
        run_dir = RUNS_DIR / "goodput" / name
        done = run_local(
            run_dir=run_dir,
            nproc=NPROC,
            restart=mode["restart"],
            faults=spec,
            cold_restarts=mode["cold"],
            overrides=(
                *TINY_MODEL,
                f"--train.steps={steps}",
                "--checkpoint.interval=25",
                f"--checkpoint.engine={mode['engine']}",
                "--resilience.max_restarts=8",
                *TIMEOUTS,
                *mode["extra"],
            ),
            timeout_s=600,
        )
        summary = summarize(run_dir=run_dir)
        modes[name] = {
            "ettr": summary.ettr,
            "wall_s": summary.wall_s,
            "productive_s": summary.productive_s,
            "lost_s": summary.lost_s,
            "faults": summary.faults,
            "restarts": len(summary.restarts),
            "steps_completed": summary.steps_completed,
            "status": summary.status,
            "ckpt_blocking_median_s": summary.ckpt_blocking_median_s,
            "returncode": done.returncode,
            "run_dir": str(run_dir),
        }
    base = modes["baseline"]["ettr"]
    best = max(modes["inprocess"]["ettr"], modes["injob"]["ettr"])
    targets = [
        target("ETTR in-process", modes["inprocess"]["ettr"], goal=0.9, higher_is_better=True),
        target("ETTR in-job", modes["injob"]["ettr"], goal=0.9, higher_is_better=True),
        target(
            "ETTR in-process / baseline",
            ratio(modes["inprocess"]["ettr"], base),
            goal=1.3,
            higher_is_better=True,
        ),
        target(
            "ETTR in-job / baseline",
            ratio(modes["injob"]["ettr"], base),
            goal=1.3,
            higher_is_better=True,
        ),
    ]
    result = {
        "machine": machine(),
        "quick": quick,
        "nproc": NPROC,
        "steps": steps,
        "faults": spec,
        "modes": modes,
        "ettr_inprocess": modes["inprocess"]["ettr"],
        "ettr_injob": modes["injob"]["ettr"],
        "ettr_baseline": base,
        "best_vs_baseline": ratio(best, base),
        "targets": targets,
    }
    print(report(result), flush=True)
    write_result("goodput", result)
    return result


def report(result: dict[str, Any]) -> str:
    rows = [
        (
            name,
            m["ettr"],
            m["wall_s"],
            m["productive_s"],
            m["lost_s"],
            f"{m['restarts']}/{m['faults']}",
            m["ckpt_blocking_median_s"],
            m["status"],
        )
        for name, m in result["modes"].items()
    ]
    return "\n".join(
        [
            f"goodput: {result['nproc']} ranks, tiny model, {result['steps']} steps, "
            f"faults {result['faults']}",
            table(
                [
                    "strategy",
                    "ETTR",
                    "wall s",
                    "productive s",
                    "lost s",
                    "restarts/faults",
                    "ckpt block s",
                    "status",
                ],
                rows,
            ),
            "",
            targets_table(result["targets"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 fault, 60 steps per run")
    args = parser.parse_args(argv)
    run(quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
