"""Run the benchmarks one after the other and print one combined table (``make bench``).

    python -m bench.run_all                # checkpoint, overhead, restore, peer, goodput: ~25 min
    python -m bench.run_all --with-restart           # + the restart benchmark (+~4 min)
    python -m bench.run_all --quick                  # smoke sizes, ~7 min
    python -m bench.run_all --only checkpoint,restart
    python -m bench.run_all --collect      # the summary from bench/results/*.json: runs none

On a 2-core machine the goodput benchmark alone trains each of its 6 modes (the restart modes, and
in-job and nested with the restore tiers off and on) for 3 minutes, one fault of each kind (~19
min with start-ups); the checkpoint benchmark takes ~1 min, the overhead one ~3; the restore
benchmark takes ~30 s, the peer exchange's ~2 min. The restart benchmark (~4 min) is left out by
default: the goodput runs report the cost of every fault of each kind too, and
``bench/results/restart.json`` (which the planner reads) keeps its last full run. The total is
printed at the end (``wall: ...; total N min``).

Each benchmark prints its own table and writes bench/results/<name>.json; this writes
bench/results/summary.json (headline numbers and every target's verdict) and then prints the
planner's table from these results (``python -m planner --costs measured-cpu --no-plot``; no
figure is written). ``--collect`` rebuilds the summary from the results on file, e.g. after
one benchmark was rerun alone. Targets are reported, never asserted: the exit status is 0
unless a benchmark crashed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench import checkpoint, goodput, node_loss, overhead, peer, restart, restore
from bench.common import REPO_ROOT, RESULTS_DIR, fmt, machine, table, write_result

BENCHMARKS: dict[str, Callable[..., dict[str, Any]]] = {
    "checkpoint": checkpoint.run,
    "overhead": overhead.run,
    "restart": restart.run,
    "restore": restore.run,
    "peer": peer.run,
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
    "restore": (
        "storage_verified_s",
        "pod_memory_s",
        "peer_s",
        "pod_memory_vs_storage",
        "peer_vs_storage",
    ),
    "peer": (
        "floor_s",
        "serial_blocked_s",
        "background_blocked_s",
        "background_wall_s",
        "background_wall_vs_floor",
        "step_slowdown_during_exchange",
    ),
    "goodput": (
        "ettr_baseline",
        "ettr_inprocess",
        "ettr_injob",
        "ettr_injob_tiers",
        "ettr_nested",
        "ettr_nested_tiers",
        "startup_baseline_s",
        "startup_nested_s",
        "ettr_replica",
        "ettr_replica_vs_nested",
        "replica_stall_p50_s",
    ),
    # Its results are per case (bench/results/node_loss.json; `python -m bench.node_loss --table`).
    "node_loss": (),
}
DEFAULT = ("checkpoint", "overhead", "restore", "peer", "goodput")


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
    parser.add_argument(
        "--collect",
        action="store_true",
        help="run nothing: the summary from the results on file (bench/results/<name>.json)",
    )
    args = parser.parse_args(argv)
    default = list(BENCHMARKS) if args.with_restart or args.collect else list(DEFAULT)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or default
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {list(BENCHMARKS)}")

    if args.collect:
        results = collected(names)
        return summarize(names=list(results), results=results, seconds={}, failed=[], args=args)
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
    return summarize(
        names=names,
        results=results,
        seconds=seconds,
        failed=failed,
        args=args,
        total_s=time.monotonic() - started,
    )


def collected(names: list[str]) -> dict[str, dict[str, Any]]:
    """The results on file of ``names`` (those that have one)."""
    found = {}
    for name in names:
        path = RESULTS_DIR / f"{name}.json"
        if path.is_file():
            found[name] = json.loads(path.read_text())
    return found


def summarize(
    *,
    names: list[str],
    results: dict[str, dict[str, Any]],
    seconds: dict[str, float],
    failed: list[str],
    args: argparse.Namespace,
    total_s: float | None = None,
) -> int:
    """Write bench/results/summary.json, print the combined tables (and the planner's)."""
    rows = []
    targets = []
    for name, result in results.items():
        for key in HEADLINES[name]:
            rows.append((name, key, result.get(key)))
        for t in result.get("targets", []):
            targets.append((name, t["target"], t["value"], t["goal"], t["verdict"]))
    summary = {
        "machine": machine(),
        "quick": args.quick or any(r.get("quick") for r in results.values()),
        "collected_from_results": args.collect,
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
    if total_s is not None:
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
