"""Node-loss benchmark: a lost node's phases, from the fault to the first step after it.

The pod emulation's lost-node scenario (podsim.jobs.node_loss_run, the one tests/pods runs: the
EKS Job's exact command in emulated pods; pod 1's node lost at step 6, its network cut and its
processes frozen; the control plane's node lifecycle, taint eviction, repair and PodGC rules
emulated with the production durations of docs/node-loss.md scaled by 1/``TIMER_SCALE``), in
``injob`` and ``nested`` mode, with one spare node and with none. Each run must end
bit-identical to a fault-free run of the same Job (one fault-free run first).

Phases, cumulative seconds from the fault, emulation wall time (p50 over the runs of a case):
``node_not_ready`` (the node-monitor grace ends: Ready=Unknown), ``pod_failed`` (PodGC fails the
pod), ``replacement_running`` (the replacement's container starts on a node) and ``first_step``
(the start of the first step trained after the fault); ``restart_p50_s`` is
first_step - replacement_running, the product's own part.

    sudo .venv/bin/python -m bench.node_loss            # 1 run per case, ~11 min on 2 busy cores
    sudo .venv/bin/python -m bench.node_loss --runs 2

Needs root (network and mount namespaces). Writes bench/results/node_loss.json (the planner
reads it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import write_result
from podsim import control_plane, jobs

CASES = {
    "injob/spare": ("injob", 1),
    "injob/no-spare": ("injob", 0),
    "nested/spare": ("nested", 1),
    "nested/no-spare": ("nested", 0),
}


def one_run(root: Path, *, restart: str, spares: int, reference: dict) -> dict[str, Any]:
    result, job, state = jobs.node_loss_run(root, restart=restart, spares=spares)
    if result.status != "Complete":
        raise RuntimeError(f"{restart} spares={spares}: {result}\n{jobs.logs(root)}")
    fault = state["time"]
    plane = state["plane"]
    first_step = jobs.recovery_s(root, job, fault_time=fault)
    times = control_plane.EKS.scaled(control_plane.SCALE)
    failed = [at for at, what in plane.events if "Failed by PodGC" in what]
    replacement = plane.bound_at[f"{job['metadata']['name']}-1"]
    try:
        jobs.assert_identical(jobs.final_state(root, job), reference)
        identical = True
    except AssertionError:
        identical = False
    return {
        "node_not_ready": times.monitor_grace_s,
        "pod_failed": failed[0] - fault,
        "replacement_running": replacement - fault,
        "first_step": first_step,
        "bit_identical": identical,
    }


def run(*, quick: bool = False, runs: int = 1) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
        root = Path(tmp)
        ref_root = root / "reference"
        result, job = jobs.run(ref_root, jobs.TWO_NODES, restart="injob", env=jobs.TWO_PODS)
        if result.status != "Complete":
            raise RuntimeError(f"fault-free run: {result}")
        reference = jobs.final_state(ref_root, job)
        for name, (restart, spares) in CASES.items():
            rows = [
                one_run(root / f"{restart}-{spares}-{i}", restart=restart, spares=spares,
                        reference=reference)
                for i in range(1 if quick else runs)
            ]  # fmt: skip
            p50 = {
                k: round(statistics.median(r[k] for r in rows), 2)
                for k in ("node_not_ready", "pod_failed", "replacement_running", "first_step")
            }
            cases[name] = {
                "runs": len(rows),
                "fault_to_first_step_s": [round(r["first_step"], 2) for r in rows],
                "fault_to_first_step_p50_s": p50["first_step"],
                "phases_p50_s": p50,
                "restart_p50_s": round(
                    statistics.median(r["first_step"] - r["replacement_running"] for r in rows), 2
                ),
                "bit_identical": all(r["bit_identical"] for r in rows),
            }
            print(name, cases[name], flush=True)
    scale = round(1 / control_plane.SCALE)
    doc = {
        "source": (
            "bench/node_loss.py: pod emulation on this machine (CPU ranks, gloo); "
            f"Kubernetes timers emulated at 1/{scale}"
        ),
        "timer_scale": scale,
        "cases": cases,
    }
    write_result("node_loss", doc)
    return doc


def table(doc: dict[str, Any]) -> str:
    """The measured table of docs/node-loss.md, from the results JSON."""
    lines = [
        "| Mode, spares | Runs | Fault -> first step (p50) | Pod Failed | Replacement running "
        "| Its restart (p50) | Bit-identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in doc["cases"].items():
        p = c["phases_p50_s"]
        each = ", ".join(f"{v:.1f}" for v in c["fault_to_first_step_s"])
        lines.append(
            f"| {name} | {c['runs']} | {c['fault_to_first_step_p50_s']:.1f} s ({each}) "
            f"| {p['pod_failed']:.1f} s | {p['replacement_running']:.1f} s "
            f"| {c['restart_p50_s']:.1f} s | {'yes' if c['bit_identical'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.node_loss", description=__doc__)
    parser.add_argument("--runs", type=int, default=1, help="runs per case")
    parser.add_argument("--table", action="store_true", help="print the table from the JSON")
    args = parser.parse_args(argv)
    if args.table:
        import json

        from bench.common import RESULTS_DIR

        print(table(json.loads((RESULTS_DIR / "node_loss.json").read_text())))
        return 0
    print(table(run(runs=args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
