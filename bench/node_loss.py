"""Node-loss benchmark: a lost node's phases, from the fault to the first step after it.

The pod emulation's lost-node scenario (podsim.jobs.node_loss_run, the one tests/pods runs: the
EKS Job's exact command in emulated pods; pod 1's node lost at step 6, its network cut and its
processes frozen; the control plane's node lifecycle, taint eviction, repair and PodGC rules
emulated with the production durations of docs/node-loss.md scaled by 1/``TIMER_SCALE``), in
``injob`` and ``nested`` mode, with one spare node and with none, and with the node fencer
(podsim.jobs.fenced_node_loss_run). Each run must end bit-identical to a fault-free run of the
same Job (one fault-free run first).

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
import json
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, write_result
from infra.fencer.settings import FENCER, KUBE
from planner.costs import DEFAULTS
from podsim import control_plane, jobs
from podsim.control_plane import EKS_DEFAULT_REPAIR_WAIT_S

CASES = {
    "injob/spare": ("injob", 1),
    "injob/no-spare": ("injob", 0),
    "nested/spare": ("nested", 1),
    "nested/no-spare": ("nested", 0),
    # The node fencer (infra/fencer) acts; EKS repair keeps its 30-minute default.
    "injob/spare/fenced": ("injob", 1),
}
FENCED = "/fenced"
EKS_TARGET_S = 180.0
"""Issue #41's target: a lost node costs at most 3 minutes, fault -> first step with a spare."""


def eks_estimate_s(*, fenced: bool, restart_s: float, worst: bool = True) -> float:
    """Fault -> first step with a spare on EKS: the control plane's documented timers, unscaled
    (docs/node-loss.md; one owner each: ``KUBE`` for Kubernetes', ``FENCER`` for the fencer's,
    the planner's ``pod_start_s``), plus the product's own restart as measured here.
    Fenced: node-monitor grace, the fencer's wait and one poll, EC2's termination with
    ``SkipOsShutdown`` (an estimate), PodGC's next loop, a pod start. Else EKS repair's 30-minute
    `Ready` wait, the termination, PodGC's orphan quarantine and loop, a pod start. `worst`: the
    poll and PodGC's loop at their full period; else at half (their median: the fault and the
    taint fall anywhere in the period)."""
    part = 1.0 if worst else 0.5
    pod_start = DEFAULTS["pod_start_s"].value
    if fenced:
        control = (
            KUBE.node_monitor_grace_s
            + FENCER.wait_s
            + part * FENCER.poll_s
            + FENCER.terminate_s
            + part * KUBE.podgc_loop_s
        )
    else:
        control = (
            KUBE.node_monitor_grace_s
            + EKS_DEFAULT_REPAIR_WAIT_S
            + FENCER.terminate_s
            + KUBE.podgc_quarantine_s
            + part * KUBE.podgc_loop_s
        )
    return control + pod_start + restart_s


def one_run(
    root: Path, *, restart: str, spares: int, reference: dict, fenced: bool = False
) -> dict[str, Any]:
    if fenced:
        result, job, state, _ = jobs.fenced_node_loss_run(root, restart=restart)
    else:
        result, job, state = jobs.node_loss_run(root, restart=restart, spares=spares)
    if result.status != "Complete":
        raise RuntimeError(f"{restart} spares={spares}: {result}\n{jobs.logs(root)}")
    fault = state["time"]
    plane = state["plane"]
    first_step = jobs.recovery_s(root, job, fault_time=fault)
    times = control_plane.EKS.scaled(control_plane.SCALE)
    failed = sorted(at for at, what in plane.events if "Failed by PodGC" in what)
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


def run(*, quick: bool = False, runs: int = 1, only: list[str] | None = None) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    doc = _merged(cases)
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
        root = Path(tmp)
        ref_root = root / "reference"
        result, job = jobs.run(ref_root, jobs.TWO_NODES, restart="injob", env=jobs.TWO_PODS)
        if result.status != "Complete":
            raise RuntimeError(f"fault-free run: {result}")
        reference = jobs.final_state(ref_root, job)
        for name in only or CASES:
            restart, spares = CASES[name]
            fenced = name.endswith(FENCED)
            rows = [
                one_run(root / f"{name.replace('/', '-')}-{i}", restart=restart, spares=spares,
                        reference=reference, fenced=fenced)
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
            if spares:
                restart_s = cases[name]["restart_p50_s"]
                cases[name]["eks_estimate_s"] = round(
                    eks_estimate_s(fenced=fenced, restart_s=restart_s), 1
                )
                cases[name]["eks_estimate_p50_s"] = round(
                    eks_estimate_s(fenced=fenced, restart_s=restart_s, worst=False), 1
                )
            cases[name]["date"] = datetime.now(tz=UTC).date().isoformat()
            print(name, cases[name], flush=True)
            # Written after every case, into the cases on file: a case that fails on a loaded
            # machine (an emulator timeout) loses only itself, and `--case` reruns one case.
            doc = _merged(cases)
            write_result("node_loss", doc)
    return doc


def _merged(cases: dict[str, Any]) -> dict[str, Any]:
    """The results on file with `cases` replacing theirs (each case carries its own date)."""
    scale = round(1 / control_plane.SCALE)
    path = RESULTS_DIR / "node_loss.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    kept = old.get("cases", {}) if old.get("timer_scale") == scale else {}
    return {
        "source": (
            "bench/node_loss.py: pod emulation on this machine (CPU ranks, gloo); "
            f"Kubernetes timers emulated at 1/{scale}"
        ),
        "timer_scale": scale,
        "eks_target_s": EKS_TARGET_S,
        "cases": {n: c for n, c in {**kept, **cases}.items() if n in CASES},
    }


def _estimate(case: dict[str, Any]) -> str:
    if "eks_estimate_s" not in case:
        return "-"
    p50 = case.get("eks_estimate_p50_s")
    worst = case["eks_estimate_s"]
    return f"{p50:.0f} s, {worst:.0f} s" if p50 is not None else f"{worst:.0f} s"


def table(doc: dict[str, Any]) -> str:
    """The measured table of docs/node-loss.md, from the results JSON."""
    lines = [
        "| Mode, spares | Runs | Fault -> first step (p50) | Pod Failed | Replacement running "
        "| Its restart (p50) | Bit-identical | EKS estimate, fault -> first step (median, worst) "
        "| Run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in doc["cases"].items():
        p = c["phases_p50_s"]
        each = ", ".join(f"{v:.1f}" for v in c["fault_to_first_step_s"])
        lines.append(
            f"| {name} | {c['runs']} | {c['fault_to_first_step_p50_s']:.1f} s ({each}) "
            f"| {p['pod_failed']:.1f} s | {p['replacement_running']:.1f} s "
            f"| {c['restart_p50_s']:.1f} s | {'yes' if c['bit_identical'] else 'NO'} "
            f"| {_estimate(c)} | {c.get('date', '2026-12-06')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.node_loss", description=__doc__)
    parser.add_argument("--runs", type=int, default=1, help="runs per case")
    parser.add_argument("--table", action="store_true", help="print the table from the JSON")
    parser.add_argument("--case", action="append", choices=list(CASES), help="only these cases")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads((RESULTS_DIR / "node_loss.json").read_text())))
        return 0
    print(table(run(runs=args.runs, only=args.case)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
