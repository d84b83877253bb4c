"""Run the benchmarks one after the other and print one combined table (``make bench``).

    python -m bench.run_all                          # checkpoint, overhead, goodput: ~24 min
    python -m bench.run_all --with-restart           # + the restart benchmark (+~4 min)
    python -m bench.run_all --quick                  # smoke sizes, ~5 min
    python -m bench.run_all --only checkpoint,restart

The default set fits ``make bench`` in 25 minutes on a 2-core machine: the goodput benchmark
alone trains each of its 4 modes for 5 minutes (~22 min with start-ups). The restart benchmark
(~4 min) is left out by default: the goodput runs report the cost of every fault of each kind
too, and ``bench/results/restart.json`` (which the planner reads) keeps its last full run.

Each benchmark prints its own table and writes bench/results/<name>.json; this writes
bench/results/summary.json (headline numbers and every target's verdict) and then prints the
planner's table from these results (``python -m planner --costs measured-cpu --no-plot``; no
figure is written). Targets are reported, never asserted: the exit status is 0 unless a
benchmark crashed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench import checkpoint, goodput, node_loss, overhead, restart
from bench.common import REPO_ROOT, ensure_corpus, fmt, machine, table, write_result

BENCHMARKS: dict[str, Callable[..., dict[str, Any]]] = {
    "checkpoint": checkpoint.run,
    "overhead": overhead.run,
    "restart": restart.run,
    "goodput": goodput.run,
    "node_loss": node_loss.run,  # needs root: emulated pods (`--only node_loss`)
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
    "goodput": (
        "ettr_baseline",
        "ettr_inprocess",
        "ettr_injob",
        "ettr_nested",
        "startup_baseline_s",
        "startup_nested_s",
    ),
    # Its results are per case (bench/results/node_loss.json; `python -m bench.node_loss --table`).
    "node_loss": (),
}
DEFAULT = ("checkpoint", "overhead", "goodput")


def run_planner() -> int:
    """Print the planner's table from the measured CPU costs (bench/results/*.json); no plot."""
    command = [sys.executable, "-m", "planner", "--costs", "measured-cpu", "--no-plot"]
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
    parser.add_argument(
        "--with-restart", action="store_true", help="also run the restart benchmark (~4 min)"
    )
    parser.add_argument("--no-planner", action="store_true", help="skip the planner table")
    args = parser.parse_args(argv)
    default = list(BENCHMARKS) if args.with_restart else list(DEFAULT)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or default
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
