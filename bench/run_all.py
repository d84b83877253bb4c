"""Run every benchmark one after the other and print one combined table (``make bench``).

    python -m bench.run_all                          # everything, < 20 min on 2 cores
    python -m bench.run_all --quick                  # smoke sizes, ~3 min
    python -m bench.run_all --only checkpoint,restart

Each benchmark prints its own table and writes bench/results/<name>.json; this writes
bench/results/summary.json (headline numbers and every target's verdict) and then re-runs the
planner (``python -m training.planner``, docs/planner.png) so that its defaults come from these
results. Targets are reported, never asserted: the exit status is 0 unless a benchmark crashed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench import checkpoint, goodput, overhead, restart
from bench.common import REPO_ROOT, ensure_corpus, fmt, machine, table, write_result

BENCHMARKS: dict[str, Callable[..., dict[str, Any]]] = {
    "checkpoint": checkpoint.run,
    "overhead": overhead.run,
    "restart": restart.run,
    "goodput": goodput.run,
}
HEADLINES: dict[str, tuple[str, ...]] = {
    "checkpoint": (
        "nvrx_async_blocking_s",
        "torch_async_blocking_s",
        "sync_blocking_s",
        "floor_copy_s",
        "nvrx_first_blocking_s",
        "nvrx_background_vs_raw",
    ),
    "overhead": ("overhead_inprocess", "overhead_injob"),
    "restart": ("inprocess_p50_s", "injob_p50_s", "cold_p50_s"),
    "goodput": ("ettr_inprocess", "ettr_injob", "ettr_baseline"),
}


def run_planner() -> int:
    """Re-run the planner; it reads bench/results/*.json for its defaults."""
    command = [sys.executable, "-m", "training.planner", "--out", "docs/planner.png"]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    print(f"\n+ {' '.join(command[1:])} (exit {proc.returncode})")
    print("\n".join(proc.stdout.splitlines()[:12]))
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke sizes (fast, not for numbers)")
    parser.add_argument(
        "--only", default="", help=f"comma-separated subset of {', '.join(BENCHMARKS)}"
    )
    parser.add_argument("--no-planner", action="store_true", help="skip the planner re-run")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {list(BENCHMARKS)}")

    ensure_corpus()
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    failed: list[str] = []
    for name in names:
        print(f"\n=== {name} {'(quick)' if args.quick else ''}", flush=True)
        t0 = time.monotonic()
        try:
            results[name] = BENCHMARKS[name](quick=args.quick)
        except Exception:
            traceback.print_exc()
            failed.append(name)
        seconds[name] = time.monotonic() - t0

    rows = []
    targets = []
    for name, result in results.items():
        for key in HEADLINES[name]:
            rows.append((name, key, result.get(key)))
        for t in result.get("targets", []):
            targets.append((name, t["target"], t["value"], t["goal"], t["verdict"]))
    total_s = time.monotonic() - started
    summary = {
        "machine": machine(),
        "quick": args.quick,
        "benchmarks": names,
        "failed": failed,
        "seconds": seconds,
        "total_s": total_s,
        "headlines": {f"{n}.{k}": v for n, k, v in rows},
        "targets": [
            {"benchmark": n, "target": t, "value": v, "goal": g, "verdict": d}
            for n, t, v, g, d in targets
        ],
    }
    write_result("summary", summary)
    print(f"\n=== summary ({machine()})")
    print(table(["benchmark", "metric", "value"], rows))
    print()
    print(table(["benchmark", "target", "measured", "goal", "verdict"], targets))
    print(
        "\nwall: "
        + ", ".join(f"{n} {fmt(s, 0)} s" for n, s in seconds.items())
        + f"; total {total_s / 60:.1f} min"
    )
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    if not args.no_planner and not args.quick:
        run_planner()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
