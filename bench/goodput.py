"""Goodput benchmark: ETTR in steady state, every restart strategy under the same fault rate.

Each mode trains the same job (``NPROC`` = 2 CPU ranks, gloo, the tiny model, a checkpoint every
``CKPT_EVERY`` steps) for a fixed window of ``WINDOW_S`` = 180 s of wall time counted from the end
of its first step, with faults of mixed kinds every ``FAULT_EVERY_S`` = 60 s of wall time, the
first ``FAULT_FIRST_S`` = 30 s in: timed faults (``KIND@RANK:SECONDSs``, the clock starting at the
run's first step), so every mode meets the same three faults in its window, one of each kind (a
longer window would only repeat kinds, at a minute a fault per mode), however fast it recovers,
and each lands wherever it falls between two checkpoints (on average half an interval is
recomputed). Faults placed by step would come more often for the modes that recover
faster, and more often still as steps get faster.
At the end of the window the run is killed (`kill_tree`).

``CKPT_EVERY`` = 100 steps is near the optimum of the planner's model (``planner.ettr``:
Young's sqrt(2 x stall x MTBF)) for this job. In the run of docs/results.md a
checkpoint cost the in-process mode 0.053 s (its blocking snapshot and finalizing collectives
0.021 s, the step after it slowed by the background write on the shared cores 0.032 s): with one
fault a minute that gives sqrt(2 x 0.053 x 60) = 2.5 s, ~82 steps of ~31 ms, whose expected
loss differs from 100 steps' by 0.1% of the window.
``MEMORY_EVERY`` = 20 steps is Young's optimum for the memory snapshots the same way (they
are what a restart that keeps the pod loses work back to): a snapshot of the tiny model costs
~2.5 ms between two steps (2 ranks; ``between_steps`` of goodput.json), sqrt(2 x 0.0025 x 60) =
0.55 s, ~22 steps of ~25 ms. The recipe's default, 10, is the debug model's (~6 ms a snapshot:
bench.overhead's in-process runs spend ~0.6 ms a step more between steps than none's, at
~110 ms steps).
2 ranks, not 4: on a 2-core machine 4 ranks plus their NVRx checkpoint workers, rank monitors
and launchers oversubscribe the cores (see bench/overhead.py ``--diagnose``).

Each mode restores from the restore tiers of its ``tiers`` column (``TIERS``):

- ``baseline``: plain torchrun (``--restart=none``), synchronous DCP checkpoints, and a whole-job
  cold restart by the local launcher (``--cold-restarts``) after any failure; its hang detector
  is the collective timeout (``parallel.pg_timeout_s`` = ``BASELINE_PG_TIMEOUT_S``). Storage only.
- ``inprocess``: NVRx in-process restart (Wrapper), NVRx async checkpoints, tiers on: its
  restarts restore the pod-memory snapshots.
- ``injob``: ft_launcher in-job restart (rank monitors, heartbeats, sections), NVRx async;
  storage only (``memory_interval`` 0): every restart reads the newest committed checkpoint.
- ``injob_tiers``: the same with the tiers on: the respawned workers restore the pod-memory
  snapshots.
- ``nested``: in-process restart inside ft_launcher, NVRx async, snapshots in the rank's process
  memory (``pod_memory_dir`` empty): its in-process restarts restore them, a SIGKILL's in-job
  restart starts new processes and loads from storage.
- ``nested_tiers``: the same with the tiers on: both halves restore the pod-memory snapshots.

"Tiers on" is ``memory_interval`` = ``MEMORY_EVERY``, ``pod_memory_dir`` in /dev/shm (a
directory per run, removed after it) and ``checkpoint.peer_copy`` set. On this one machine, one
node, the peer copy is off by design (no other node to hold it; the run logs why): what "on"
measures here is the pod-memory tier, which serves every fault in this schedule (none loses the
node). A lost node's restore from its peer is measured by ``bench/restore.py``.

Fault kinds, chosen per mode by what the mode can recover from (the schedule cycles through
them in this order): the baseline, in-job and nested get ``exception``, ``hang`` and ``sigkill``;
in-process alone gets ``exception`` and ``hang``, because a SIGKILLed rank cannot be brought
back by the survivors (the run ends with the lost rank named, by design: a pod replacement is
the next layer's job). The hang timeouts are ``HANG_TIMEOUTS``.

ETTR = productive step time in the window / window length, where productive = the step time
of each step number's last occurrence completed in the window (steps thrown away by a restart
do not count); the logs are read with ``training.runlog.accounting.load_run``. Start-up
(launch to the end of the first step, and run_start to it) is reported separately, and so is
the full-run ETTR of ``training.runlog.accounting.summarize`` (start-up and the killed tail
included). Per fault: its cost = downtime (fault -> start of the first step of the next
attempt) + the recomputed steps, from the step log (`fault_costs`).

Replica groups (``--replica``, issue 40): ``injob``, ``nested`` and ``replica`` one after the
other on ``REPLICA_NPROC`` = 4 ranks (replica: 2 groups x 2 ranks, ``REPLICA_SEMANTICS``), the
same 180 s window, the same faults one a minute from 30 s in (``REPLICA_FAULTS``: SIGKILL of a
rank of group 1, SIGSTOP of a rank of group 0, SIGKILL of the other rank of group 1; the flat
modes get each at the same global rank as a trainer fault; the replica run gets them from
outside, since a fault spec reaches every group), every mode with the pod-memory tier on and
30 s heartbeats. Written into goodput.json's ``replica`` section (the rest is kept).

- ETTR (all three alike) = the job's committed steps in the window x the fault-free step time
  / the window. The job's committed steps: the step numbers whose last occurrence completed in
  the window, averaged over the groups (each group trains its share of the global batch; with
  the waiting semantics all groups commit the same steps, so this is the steps committed; with
  the shrinking semantics a step without a group counts for the groups' share that trained
  it). The fault-free step time: the median step time in the window (a step that waited for a
  group is an outlier the median ignores). So ETTR measures the time faults cost, apart from
  each mode's steady-state step time; the replica step's own cost (the quorum every step) is
  reported beside it (``replica_step_vs_injob``).
- The survivors' stall per fault: every surviving group's ``replica_stall`` events
  (training/runlog/replica.py: seconds without a committed step in a group that did not fail,
  per failure, the slowest rank's), p50 and max over the run.
- Targets (issue 40): replica ETTR >= 0.95 and >= nested's (the floor, same run), survivors'
  stall <= 5 s at p50.

    python -m bench.goodput            # 6 modes x (start-up + 180 s), ~19 min
    python -m bench.goodput --replica  # injob, nested, replica on 4 ranks, ~13 min
    python -m bench.goodput --quick    # 40 s windows, one exception each (smoke)
    python -m bench.goodput --only baseline,injob_tiers,nested_tiers
    python -m bench.goodput --reanalyse  # recompute the JSON from runs/bench/goodput/*

Writes bench/results/goodput.json (``ettr_<mode>``, ``startup_<mode>_s``, targets).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    HANG_TIMEOUTS,
    REPO_ROOT,
    RESULTS_DIR,
    RUNS_DIR,
    TINY_MODEL,
    bench_env,
    kill_tree,
    local_command,
    machine,
    median,
    ratio,
    read_jsonl,
    table,
    target,
    targets_table,
    write_result,
)
from training.config import ResilienceConfig
from training.runlog.accounting import load_run, summarize
from training.runlog.files import METRICS_FILE

NPROC = 2
WINDOW_S = 180.0
QUICK_WINDOW_S = 40.0
FAULT_FIRST_S = 30.0
FAULT_EVERY_S = 60.0
CKPT_EVERY = 100
MEMORY_EVERY = 20
BASELINE_PG_TIMEOUT_S = 20
ALL_KINDS = ("exception", "hang", "sigkill")
# Where each mode's restarts restore from (training/checkpoint/tiers.py). ``storage``: the
# committed checkpoints only; ``memory``: snapshots in the rank's process memory for in-process
# restarts, storage for in-job ones; ``on``: snapshots in the pod's memory (/dev/shm) for every
# restart that keeps the pod, and the peer copy, which the local launcher's one node turns off
# (with the reason logged: training/checkpoint/peer.py), as a one-node job does on the cluster.
TIERS: dict[str, tuple[str, ...]] = {
    "storage": ("--checkpoint.memory_interval=0",),
    "memory": (f"--checkpoint.memory_interval={MEMORY_EVERY}", "--checkpoint.pod_memory_dir="),
    "on": (f"--checkpoint.memory_interval={MEMORY_EVERY}", "--checkpoint.peer_copy=true"),
}
MODES: dict[str, dict[str, Any]] = {
    "baseline": {
        "restart": "none",
        "engine": "sync",
        "cold": 20,
        "kinds": ALL_KINDS,
        "tiers": "storage",
        "extra": (f"--parallel.pg_timeout_s={BASELINE_PG_TIMEOUT_S}",),
    },
    "inprocess": {
        "restart": "inprocess",
        "engine": "nvrx",
        "cold": 0,
        "kinds": ("exception", "hang"),
        "tiers": "on",
        "extra": (),
    },
    "injob": {
        "restart": "injob",
        "engine": "nvrx",
        "cold": 0,
        "kinds": ALL_KINDS,
        "tiers": "storage",
        "extra": (),
    },
    "injob_tiers": {
        "restart": "injob",
        "engine": "nvrx",
        "cold": 0,
        "kinds": ALL_KINDS,
        "tiers": "on",
        "extra": (),
    },
    "nested": {
        "restart": "nested",
        "engine": "nvrx",
        "cold": 0,
        "kinds": ALL_KINDS,
        "tiers": "memory",
        "extra": (),
    },
    "nested_tiers": {
        "restart": "nested",
        "engine": "nvrx",
        "cold": 0,
        "kinds": ALL_KINDS,
        "tiers": "on",
        "extra": (),
    },
}
BEST_OF = ("inprocess", "injob", "injob_tiers", "nested", "nested_tiers")


def fault_spec(*, kinds: tuple[str, ...], faults: int, first_s: float, every_s: float) -> str:
    """Timed faults at ``first_s``, ``first_s + every_s``, ... seconds after the run's first
    step; kinds in turn; ranks 1..NPROC-1 in turn."""
    ranks = max(1, NPROC - 1)
    return ";".join(
        f"{kinds[i % len(kinds)]}@{(1 + i % ranks) % NPROC}:{first_s + every_s * i:g}s"
        for i in range(faults)
    )


def _first_step_time(metrics: Path) -> float | None:
    """End time of the first step logged in metrics.jsonl, once there is one."""
    times = [row["time"] for row in read_jsonl(metrics) if isinstance(row.get("time"), float)]
    return times[0] if times else None


def run_window(
    *,
    run_dir: Path,
    command: list[str],
    window_s: float,
    startup_limit_s: float = 240.0,
    metrics: Path | None = None,
    on_tick: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """Launch, wait for the first step, let it train for ``window_s`` more, then kill it.

    The whole session is killed (launchers, ranks, checkpoint workers); the run may also end
    by itself before (it failed, or ran out of steps). ``metrics``: whose first step starts the
    window (default the run's own); ``on_tick``: called with the seconds since that first step
    while the window runs (faults fired from outside).
    """
    metrics = metrics or run_dir / METRICS_FILE
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log_path = run_dir / "launcher.log"
    launched = time.time()
    first: float | None = None
    with open(log_path, "w") as log:
        log.write("+ " + " ".join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=bench_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        while proc.poll() is None:
            now = time.time()
            if first is None:
                first = _first_step_time(metrics)
                if first is None and now - launched > startup_limit_s:
                    break
            else:
                if on_tick is not None:
                    on_tick(now - first)
                if now >= first + window_s + 1.0:
                    break
            time.sleep(0.1 if on_tick is not None else 0.25)
        ended_by_itself = proc.poll() is not None
        kill_tree(proc.pid, marker=f"--run-dir={run_dir}")
        proc.wait()
    if first is None:
        first = _first_step_time(metrics)
    return {
        "launched": launched,
        "first_step_end": first,
        "returncode": proc.returncode if ended_by_itself else None,
        "ended_by_itself": ended_by_itself,
    }


def fault_costs(*, steps: list[Any], fault_times: list[tuple[float, str]]) -> list[dict]:
    """The cost of each fault, from the step log alone.

    The step that resumes training after a fault at ``tf`` is the first one completed after it
    by another attempt (a restart raises ``attempt``; nested, an in-job restart starts it from 0
    again) or that repeats a step number (a restart resumes from a checkpoint). downtime = its
    start - tf;
    recompute = the step time of the occurrences completed before ``tf`` whose step numbers
    are done again from there on (work since the last checkpoint, thrown away).
    """
    costs = []
    for tf, kind in fault_times:
        before = [s for s in steps if s.time <= tf]
        attempt = before[-1].attempt if before else 0
        last_step = before[-1].step if before else 0
        resumed = next(
            (s for s in steps if s.time > tf and (s.attempt != attempt or s.step <= last_step)),
            None,
        )
        if resumed is None:
            costs.append({"fault": kind, "time": tf, "resumed": False})
            continue
        latest: dict[int, Any] = {}
        for s in before:
            latest[s.step] = s
        redone = [s for n, s in latest.items() if n >= resumed.step]
        downtime = max(0.0, resumed.time - resumed.step_time_s - tf)
        recompute = sum(s.step_time_s for s in redone)
        costs.append(
            {
                "fault": kind,
                "time": tf,
                "resumed": True,
                "resumed_at_s": resumed.time - tf,
                "downtime_s": downtime,
                "recompute_s": recompute,
                "recomputed_steps": len(redone),
                "lost_s": downtime + recompute,
            }
        )
    return costs


def between_steps(
    *, steps: list[Any], events: list[dict[str, Any]], t_first: float, t_cut: float
) -> dict[str, dict[str, float]]:
    """The window's steady-state time outside the steps: for each two consecutive steps of one
    attempt, the end-to-end interval less the second one's step time, grouped by what the step
    before did (a ``checkpoint_staged`` or ``memory_snapshot`` event between the two, else
    ``other``: the hooks, logging and polls of every step); count, total and median seconds per
    group."""

    def times(kind: str) -> list[float]:
        return sorted(float(e["time"]) for e in events if e["kind"] == kind)

    saved, snapshot = times("checkpoint_staged"), times("memory_snapshot")

    def any_between(moments: list[float], start: float, end: float) -> bool:
        i = bisect.bisect_right(moments, start)
        return i < len(moments) and moments[i] < end

    groups: dict[str, list[float]] = {
        "after_checkpoint": [],
        "after_memory_snapshot": [],
        "other": [],
    }
    for a, b in itertools.pairwise(steps):
        if not (t_first < a.time and b.time <= t_cut):
            continue
        if b.step != a.step + 1 or b.attempt != a.attempt:
            continue
        started = b.time - b.step_time_s
        gap = started - a.time
        key = (
            "after_checkpoint"
            if any_between(saved, a.time, started)
            else "after_memory_snapshot"
            if any_between(snapshot, a.time, started)
            else "other"
        )
        groups[key].append(gap)
    return {
        key: {"n": len(v), "total_s": sum(v), "median_s": median(v) if v else None}
        for key, v in groups.items()
    }


def window_stats(*, run_dir: Path, t_first: float, window_s: float) -> dict[str, Any]:
    """ETTR over (t_first, t_first + window_s] and the cost of each fault that fired in it."""
    logs = load_run(run_dir=run_dir)
    t_cut = t_first + window_s
    last: dict[int, Any] = {}
    for step in logs.steps:  # sorted by time: the last occurrence wins
        if step.time <= t_cut:
            last[step.step] = step
    productive = sum(s.step_time_s for s in last.values() if s.time > t_first)
    in_window = [s for s in logs.steps if t_first < s.time <= t_cut]
    steps = [s for s in logs.steps if s.time <= t_cut]
    fault_times = sorted(
        (float(e["time"]), str(e.get("fault")))
        for e in logs.events
        if e["kind"] == "fault" and t_first < float(e["time"]) <= t_cut
    )
    costs = fault_costs(steps=steps, fault_times=fault_times)
    for cost in costs:
        cost["time"] -= t_first
    spacing = [b[0] - a[0] for a, b in itertools.pairwise(fault_times)]
    per_kind: dict[str, list[float]] = {}
    for cost in costs:
        if cost["resumed"]:
            per_kind.setdefault(cost["fault"], []).append(cost["lost_s"])
    restored_from: dict[str, int] = {}
    for e in logs.events:  # rank 0's: one per restart
        if e["kind"] != "checkpoint_load" or e.get("rank", 0) != 0:
            continue
        if t_first < float(e["time"]) <= t_cut:
            source = str(e.get("source"))
            restored_from[source] = restored_from.get(source, 0) + 1
    summary = summarize(run_dir=run_dir)
    return {
        "ettr": productive / window_s,
        "productive_s": productive,
        "steps_in_window": len({s.step for s in in_window}),
        "final_step": max(last) if last else None,
        "step_time_median_s": median(s.step_time_s for s in in_window),
        "faults_in_window": len(fault_times),
        "fault_spacing_mean_s": sum(spacing) / len(spacing) if spacing else None,
        "fault_costs": costs,
        "between_steps": between_steps(
            steps=logs.steps, events=logs.events, t_first=t_first, t_cut=t_cut
        ),
        "lost_s_by_kind": {
            kind: {"n": len(v), "median": median(v), "max": max(v)} for kind, v in per_kind.items()
        },
        "lost_s_in_window": sum(c.get("lost_s", 0.0) for c in costs),
        "restored_from": restored_from,
        "unrecovered": sum(not c["resumed"] for c in costs),
        "run_start_to_first_step_s": t_first - summary.start_time,
        "full_run_ettr": summary.ettr,
        "ckpt_blocking_median_s": summary.ckpt_blocking_median_s,
        "checkpoints_committed": summary.checkpoints_committed,
    }


def run(*, quick: bool = False, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the modes one after the other, print the tables and write the JSON."""
    window_s = QUICK_WINDOW_S if quick else WINDOW_S
    names = [n for n in MODES if not only or n in only]
    modes: dict[str, dict[str, Any]] = {}
    for name in names:
        mode = MODES[name]
        if quick:
            spec = fault_spec(kinds=("exception",), faults=1, first_s=10.0, every_s=1.0)
        else:
            spec = fault_spec(
                kinds=mode["kinds"], faults=8, first_s=FAULT_FIRST_S, every_s=FAULT_EVERY_S
            )
        run_dir = RUNS_DIR / "goodput" / name
        # The run is killed at the end of its window, before it removes its pod-memory files
        # (a pod's emptyDir goes with the pod; this machine's /dev/shm stays): a directory of
        # its own, removed after the run.
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else RUNS_DIR
        pod_memory = shm / f"bench-goodput-{name}-{uuid.uuid4().hex[:12]}"
        command = local_command(
            run_dir=run_dir,
            nproc=NPROC,
            restart=mode["restart"],
            faults=spec,
            cold_restarts=mode["cold"],
            overrides=(
                *TINY_MODEL,
                "--train.steps=100000",
                f"--checkpoint.interval={CKPT_EVERY}",
                *TIERS[mode["tiers"]],
                *([f"--checkpoint.pod_memory_dir={pod_memory}"] if mode["tiers"] == "on" else []),
                f"--checkpoint.engine={mode['engine']}",
                "--resilience.max_restarts=20",
                *HANG_TIMEOUTS,
                *mode["extra"],
            ),
        )
        print(f"goodput: {name} ({window_s:.0f} s window) faults {spec}", flush=True)
        try:
            done = run_window(run_dir=run_dir, command=command, window_s=window_s)
        finally:
            shutil.rmtree(pod_memory, ignore_errors=True)
        entry: dict[str, Any] = {
            "restart": mode["restart"],
            "engine": mode["engine"],
            "tiers": mode["tiers"],
            "kinds": list(mode["kinds"]),
            "faults_spec": spec,
            "returncode": done["returncode"],
            "ended_by_itself": done["ended_by_itself"],
            "run_dir": str(run_dir),
        }
        if done["first_step_end"] is None:
            entry.update(ettr=0.0, startup_s=None, error="no step completed")
        else:
            entry["startup_s"] = done["first_step_end"] - done["launched"]
            entry.update(
                window_stats(run_dir=run_dir, t_first=done["first_step_end"], window_s=window_s)
            )
        modes[name] = entry

    targets, best_name, best, base = goodput_targets(modes)
    result: dict[str, Any] = {
        "machine": machine(),
        "load_average_1m_at_end": os.getloadavg()[0],
        "quick": quick,
        "nproc": NPROC,
        "window_s": window_s,
        "fault_first_s": FAULT_FIRST_S,
        "fault_every_s": FAULT_EVERY_S,
        "checkpoint_every_steps": CKPT_EVERY,
        "memory_snapshot_every_steps": MEMORY_EVERY,
        "hang_timeouts": list(HANG_TIMEOUTS),
        "baseline_pg_timeout_s": BASELINE_PG_TIMEOUT_S,
        "modes": modes,
        "best_mode": best_name,
        "best_vs_baseline": ratio(best, base),
        "targets": targets,
    }
    for name, m in modes.items():
        result[f"ettr_{name}"] = m["ettr"]
        result[f"startup_{name}_s"] = m.get("startup_s")
    print(report(result), flush=True)
    write_result("goodput", result)
    return result


def goodput_targets(modes: dict[str, dict[str, Any]]) -> tuple[list, str | None, Any, Any]:
    """The targets, each named with the floor it is measured against: the restore tiers'
    (nested with the tiers on >= 0.95 and >= 1.3x the baseline, in-job with the tiers on >= 1.3x
    the baseline) first, then the restart modes'. goodput.json's ``targets`` records them."""
    base = modes.get("baseline", {}).get("ettr")
    best_name = max(
        (n for n in BEST_OF if n in modes), key=lambda n: modes[n]["ettr"], default=None
    )
    best = modes[best_name]["ettr"] if best_name else None
    floor = "-" if base is None else f"{base:.3f}"
    targets = []
    if "nested_tiers" in modes:
        targets.append(
            target(
                "nested_tiers ETTR (tiers on)",
                modes["nested_tiers"]["ettr"],
                goal=0.95,
                higher_is_better=True,
            )
        )
    targets += [
        target(f"best mode ETTR ({best_name})", best, goal=0.9, higher_is_better=True),
        target(
            f"best mode ETTR / baseline ETTR {floor} ({best_name})",
            ratio(best, base),
            goal=1.3,
            higher_is_better=True,
        ),
    ]
    for name in BEST_OF:
        if name in modes and base:
            targets.append(
                target(
                    f"{name} ETTR / baseline ETTR {floor}",
                    ratio(modes[name]["ettr"], base),
                    goal=1.3,
                    higher_is_better=True,
                )
            )
    return targets, best_name, best, base


def reanalyse(path: Path) -> dict[str, Any]:
    """Recompute every mode's window statistics and the targets of a goodput.json from its run
    directories (the window starts at the first line of metrics.jsonl, as during the run);
    ``supplementary`` entries are kept as they are."""
    result = json.loads(path.read_text())
    for m in result["modes"].values():
        run_dir = Path(m["run_dir"])
        t_first = _first_step_time(run_dir / METRICS_FILE)
        if t_first is not None:
            m.update(window_stats(run_dir=run_dir, t_first=t_first, window_s=result["window_s"]))
    targets, best_name, best, base = goodput_targets(result["modes"])
    targets += result.get("replica", {}).get("targets", [])  # the --replica section's, as run
    result.update(targets=targets, best_mode=best_name, best_vs_baseline=ratio(best, base))
    for name, m in result["modes"].items():
        result[f"ettr_{name}"] = m["ettr"]
    return result


def report(result: dict[str, Any]) -> str:
    rows = []
    for name, m in result["modes"].items():
        kinds = m.get("lost_s_by_kind", {})
        rows.append(
            (
                name,
                m.get("tiers", "-"),
                "/".join(m["kinds"]),
                m["ettr"],
                m.get("startup_s"),
                m.get("step_time_median_s"),
                m.get("faults_in_window"),
                m.get("fault_spacing_mean_s"),
                m.get("lost_s_in_window"),
                ", ".join(
                    f"{k} {v['median']:.1f}" for k, v in sorted(kinds.items()) if v["median"]
                ),
                m.get("unrecovered"),
                ", ".join(f"{k} {n}" for k, n in sorted(m.get("restored_from", {}).items())),
                m.get("full_run_ettr"),
            )
        )
    return "\n".join(
        [
            f"goodput: {result['nproc']} ranks, tiny model, {result['window_s']:.0f} s window "
            f"after the first step, a fault {result['fault_first_s']:g} s in and every "
            f"{result['fault_every_s']:g} s, checkpoint every "
            f"{result['checkpoint_every_steps']} steps"
            + (
                f" (tiers memory and on: a snapshot every {result['memory_snapshot_every_steps']})"
                if result.get("memory_snapshot_every_steps")
                else ""
            ),
            table(
                [
                    "mode",
                    "tiers",
                    "fault kinds",
                    "ETTR",
                    "start-up s",
                    "step s",
                    "faults",
                    "apart s",
                    "lost s",
                    "lost s per fault (median)",
                    "unrecovered",
                    "restored from",
                    "full-run ETTR",
                ],
                rows,
            ),
            "",
            "time between steps in the window, s total (median ms), by what the step before did",
            table(
                ["mode", "after a checkpoint", "after a memory snapshot", "other steps"],
                [(name, *map(_gap_cell, _gap_groups(m))) for name, m in result["modes"].items()],
            ),
            "",
            targets_table(result["targets"]),
        ]
    )


def _gap_groups(mode: dict[str, Any]) -> list[dict[str, Any] | None]:
    groups = mode.get("between_steps") or {}
    return [groups.get(k) for k in ("after_checkpoint", "after_memory_snapshot", "other")]


def _gap_cell(group: dict[str, Any] | None) -> str:
    if not group or not group["n"]:
        return "-"
    return f"{group['total_s']:.2f} ({1e3 * group['median_s']:.2f})"


# --- replica groups beside nested and in-job (issue 40) -------------------------------------

REPLICA_NPROC = 4
REPLICA_GROUPS = 2
REPLICA_SEMANTICS = ResilienceConfig().replica_semantics
"""The replica semantics this comparison runs by default: the shipped default
(docs/replica-groups.md); ``--semantics wait`` runs the other."""
COMPARED = ("injob", "nested", "replica")
REPLICA_FAULTS: tuple[tuple[str, int, int], ...] = (
    ("sigkill", 1, 1),
    ("sigstop", 0, 1),
    ("sigkill", 1, 0),
)
"""(kind, group, rank in the group), in turn, one a minute: a dead rank, then a frozen one (the
pod emulation's lost node does this to its processes: alive, silent, only a heartbeat timeout
ends it), in one group and then the other, so that each group is once a survivor. The flat
modes get the same fault at the same global rank (``group * ranks_per_group + rank``)."""
COMPARED_TIERS = "on"
"""Every compared mode restores from the pod-memory snapshots (the replica groups' fallback
when no group survives to heal from; the in-job restarts' tier), in a directory per run."""
COMPARED_TIMERS: tuple[str, ...] = ("--resilience.heartbeat_timeout_s=30",)
"""Four ranks and their launchers on a shared 2-core machine miss 10 s heartbeats under load
(a false hang restarts a healthy rank); the frozen rank of the schedule is found after 30 s in
every compared mode alike."""
REPLICA_EXTRA: tuple[str, ...] = (
    f"--resilience.replica_groups={REPLICA_GROUPS}",
    # A survivor that saw the failed all-reduce waits inside its step section for the failed
    # group's restart (docs/replica-groups.md): the section must cover it, so no calibration
    # down to a step's time; the frozen rank is found by its heartbeat (COMPARED_TIMERS).
    "--resilience.calibrate_timeouts_after=0",
    "--resilience.step_section_timeout_s=120",
    "--resilience.replica_wait_s=120",
    "--resilience.replica_timeout_s=30",
    # The quorum's wait outside any section is covered by the out-of-section timeout the
    # launcher derives (training/hooks.py out_of_section_timeout_s).
)


def replica_fault_schedule(
    *, faults: int, first_s: float, every_s: float, ranks_per_group: int
) -> list[dict[str, Any]]:
    """The comparison's faults: kind, group, rank in the group and global rank, seconds after
    the run's first step."""
    schedule = []
    for i in range(faults):
        kind, group, rank = REPLICA_FAULTS[i % len(REPLICA_FAULTS)]
        schedule.append(
            {
                "kind": kind,
                "group": group,
                "rank": rank,
                "global_rank": group * ranks_per_group + rank,
                "at_s": first_s + every_s * i,
            }
        )
    return schedule


def flat_fault_spec(schedule: list[dict[str, Any]]) -> str:
    """The same faults for a mode without groups: the trainer's own timed faults."""
    return ";".join(f"{f['kind']}@{f['global_rank']}:{f['at_s']:g}s" for f in schedule)


def latest_pid(*, group_run_dir: Path, rank: int) -> int | None:
    """The newest process of one rank of a replica group: the ``pid`` of its latest
    ``replica_*`` event (each process writes one at its first quorum)."""
    pid = None
    for e in read_jsonl(group_run_dir / "events.jsonl"):
        if str(e.get("kind", "")).startswith("replica_") and e.get("rank") == rank:
            pid = e.get("pid", pid)
    return pid if isinstance(pid, int) else None


def fire_external(*, run_dir: Path, fault: dict[str, Any]) -> dict[str, Any]:
    """Send one scheduled fault to a replica group's rank from outside (a real signal), and
    record it as the trainer records its own (``fault`` in that group's events.jsonl)."""
    group_run_dir = run_dir / f"group-{fault['group']}"
    pid = latest_pid(group_run_dir=group_run_dir, rank=fault["rank"])
    sig = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}[fault["kind"]]
    fired = {**fault, "pid": pid, "time": time.time(), "fired": False}
    if pid is not None:
        try:
            os.kill(pid, sig)
            fired["fired"] = True
        except ProcessLookupError:
            pass  # its group is still restarting from the previous fault: reported as missed
    return fired


def run_replica_window(
    *, run_dir: Path, command: list[str], window_s: float, schedule: list[dict[str, Any]]
) -> dict[str, Any]:
    """`run_window` for a replica run: the first step is group 0's, and the scheduled faults
    are fired from outside at their times."""
    pending = list(schedule)
    fired: list[dict[str, Any]] = []

    def fire_due(since_first_s: float) -> None:
        while pending and since_first_s >= pending[0]["at_s"]:
            fired.append(fire_external(run_dir=run_dir, fault=pending.pop(0)))

    result = run_window(
        run_dir=run_dir,
        command=command,
        window_s=window_s,
        metrics=run_dir / "group-0" / METRICS_FILE,
        on_tick=fire_due,
    )
    return {**result, "fired": fired}


def committed_work(*, group_dirs: list[Path], t_first: float, window_s: float) -> dict[str, Any]:
    """The job's committed steps in the window and the fault-free step time.

    A group's committed steps are the step numbers whose last occurrence completed in
    (t_first, t_first + window_s] (a discarded or rolled-back step counts once, when it is
    finally kept); the job's are the mean over its groups (each group trains its share of the
    global batch: with the waiting semantics every group commits the same steps; with fewer
    groups in a step, that step counts for its share). The fault-free step time is the median
    step time in the window (most steps meet no fault; a step that waited for a group is an
    outlier the median ignores)."""
    t_cut = t_first + window_s
    per_group, step_times = [], []
    for group_dir in group_dirs:
        logs = load_run(run_dir=group_dir)
        last: dict[int, Any] = {}
        for step in logs.steps:
            if step.time <= t_cut:
                last[step.step] = step
        per_group.append(sum(1 for s in last.values() if s.time > t_first))
        step_times += [s.step_time_s for s in logs.steps if t_first < s.time <= t_cut]
    return {
        "committed_steps_per_group": per_group,
        "committed_steps": sum(per_group) / len(per_group),
        "fault_free_step_s": median(step_times),
    }


def ettr_committed(work: dict[str, Any], *, window_s: float) -> float | None:
    """ETTR = the job's committed steps x the fault-free step time / the window."""
    if work["fault_free_step_s"] is None:
        return None
    return work["committed_steps"] * work["fault_free_step_s"] / window_s


def survivors_stalls(*, run_dir: Path, groups: int) -> dict[str, Any]:
    """Every surviving group's ``replica_stall`` (training/runlog/replica.py: one occurrence per
    failure, its slowest rank's seconds), with the group that stalled."""
    stalls, heals, discarded = [], [], 0
    for g in range(groups):
        replica = summarize(run_dir=run_dir / f"group-{g}").replica
        if replica is None:
            continue
        stalls += [{"group": g, "step": s.step, "stall_s": s.stall_s} for s in replica.stalls]
        heals += [
            {"group": g, "step": h.step, "heal_s": h.heal_s, "bytes": h.bytes}
            for h in replica.heals
        ]
        discarded += replica.steps_discarded
    values = [s["stall_s"] for s in stalls]
    return {
        "stalls": stalls,
        "stall_p50_s": median(values),
        "stall_max_s": max(values, default=None),
        "heals": heals,
        "heal_s_p50": median(h["heal_s"] for h in heals),
        "heal_bytes_p50": median(h["bytes"] for h in heals),
        "steps_discarded": discarded,
    }


def run_replica_comparison(
    *, quick: bool = False, semantics: str = REPLICA_SEMANTICS, only: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``replica`` beside ``injob`` and ``nested``, all on ``REPLICA_NPROC`` ranks and the same
    faults, one after the other; the section is written into bench/results/goodput.json under
    ``replica`` (the other modes' results are kept)."""
    window_s = QUICK_WINDOW_S if quick else WINDOW_S
    faults = 1 if quick else int((window_s - FAULT_FIRST_S) // FAULT_EVERY_S) + 1
    per_group = REPLICA_NPROC // REPLICA_GROUPS
    schedule = replica_fault_schedule(
        faults=faults,
        first_s=10.0 if quick else FAULT_FIRST_S,
        every_s=FAULT_EVERY_S,
        ranks_per_group=per_group,
    )
    path = RESULTS_DIR / "goodput.json"
    result = json.loads(path.read_text()) if path.is_file() else {"modes": {}, "targets": []}
    # --only reruns some rows: the others stay as their earlier run left them.
    rows: dict[str, dict[str, Any]] = (
        dict(result.get("replica", {}).get("modes", {})) if only else {}
    )
    for name in [n for n in COMPARED if not only or n in only]:
        restart = MODES[name]["restart"] if name in MODES else "replica"
        run_dir = RUNS_DIR / "goodput" / f"{name}-{REPLICA_NPROC}ranks"
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else RUNS_DIR
        pod_memory = shm / f"bench-goodput-{name}-{uuid.uuid4().hex[:12]}"
        overrides = (
            *TINY_MODEL,
            "--train.steps=100000",
            f"--checkpoint.interval={CKPT_EVERY}",
            *TIERS[COMPARED_TIERS],
            f"--checkpoint.pod_memory_dir={pod_memory}",
            "--checkpoint.engine=nvrx",
            "--resilience.max_restarts=20",
            *HANG_TIMEOUTS,
            *COMPARED_TIMERS,
            *(REPLICA_EXTRA if name == "replica" else ()),
        )
        if name == "replica":
            overrides = (*overrides, f"--resilience.replica_semantics={semantics}")
        spec = "" if name == "replica" else flat_fault_spec(schedule)
        command = local_command(
            run_dir=run_dir,
            nproc=REPLICA_NPROC,
            restart=restart,
            faults=spec,
            overrides=overrides,
        )
        print(f"goodput: {name} on {REPLICA_NPROC} ranks ({window_s:.0f} s window)", flush=True)
        try:
            if name == "replica":
                done = run_replica_window(
                    run_dir=run_dir, command=command, window_s=window_s, schedule=schedule
                )
                group_dirs = [run_dir / f"group-{g}" for g in range(REPLICA_GROUPS)]
            else:
                done = run_window(run_dir=run_dir, command=command, window_s=window_s)
                group_dirs = [run_dir]
        finally:
            shutil.rmtree(pod_memory, ignore_errors=True)
        row: dict[str, Any] = {
            "ran_at": time.time(),
            "restart": restart,
            "tiers": COMPARED_TIERS,
            "run_dir": str(run_dir),
            "returncode": done["returncode"],
            "ended_by_itself": done["ended_by_itself"],
        }
        if done["first_step_end"] is None:
            row.update(ettr=0.0, error="no step completed")
            rows[name] = row
            continue
        t_first = done["first_step_end"]
        row["startup_s"] = t_first - done["launched"]
        work = committed_work(group_dirs=group_dirs, t_first=t_first, window_s=window_s)
        row.update(work, ettr=ettr_committed(work, window_s=window_s))
        if name == "replica":
            row.update(
                semantics=semantics,
                groups=REPLICA_GROUPS,
                faults_fired=[{**f, "time": f["time"] - t_first} for f in done["fired"]],
                **survivors_stalls(run_dir=run_dir, groups=REPLICA_GROUPS),
            )
        else:
            row["faults_spec"] = spec
            stats = window_stats(run_dir=run_dir, t_first=t_first, window_s=window_s)
            row["ettr_productive_time"] = stats["ettr"]
            row["faults_in_window"] = stats["faults_in_window"]
            row["lost_s_by_kind"] = stats["lost_s_by_kind"]
            row["unrecovered"] = stats["unrecovered"]
        rows[name] = row

    section: dict[str, Any] = {
        "machine": machine(),
        "load_average_1m_at_end": os.getloadavg()[0],
        "quick": quick,
        "nproc": REPLICA_NPROC,
        "groups": REPLICA_GROUPS,
        "semantics": semantics,
        "window_s": window_s,
        "faults": schedule,
        "modes": rows,
        "targets": replica_targets(rows),
        "replica_step_vs_injob": ratio(
            rows.get("replica", {}).get("fault_free_step_s"),
            rows.get("injob", {}).get("fault_free_step_s"),
        ),
    }
    if only:
        section["rerun"] = list(only)
    result["replica"] = section
    replica = rows.get("replica", {})
    result["ettr_replica"] = replica.get("ettr")
    result["ettr_replica_vs_nested"] = ratio(
        replica.get("ettr"), rows.get("nested", {}).get("ettr")
    )
    result["replica_stall_p50_s"] = replica.get("stall_p50_s")
    result["targets"] = [
        t for t in result.get("targets", []) if not str(t.get("target", "")).startswith("replica")
    ] + section["targets"]
    print(replica_report(section), flush=True)
    write_result("goodput", result)
    return result


def replica_targets(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 40's targets: replica ETTR >= nested's (a ratio against that floor, same run) and
    >= 0.95; the survivors' stall <= 5 s at p50."""
    replica, nested = rows.get("replica", {}), rows.get("nested", {})
    floor = nested.get("ettr")
    return [
        target(
            "replica ETTR (committed steps x fault-free step time / window)",
            replica.get("ettr"),
            goal=0.95,
            higher_is_better=True,
        ),
        target(
            f"replica ETTR / nested ETTR {'-' if floor is None else f'{floor:.3f}'}",
            ratio(replica.get("ettr"), floor),
            goal=1.0,
            higher_is_better=True,
        ),
        target(
            "replica survivors' stall per fault, p50 s",
            replica.get("stall_p50_s"),
            goal=5.0,
            higher_is_better=False,
        ),
    ]


def replica_report(section: dict[str, Any]) -> str:
    rows = []
    for name, m in section["modes"].items():
        rows.append(
            (
                name,
                m.get("ettr"),
                m.get("committed_steps"),
                m.get("fault_free_step_s"),
                m.get("startup_s"),
                m.get("stall_p50_s"),
                m.get("stall_max_s"),
                m.get("heal_s_p50"),
            )
        )
    faults = ", ".join(
        f"{f['kind']} g{f['group']}r{f['rank']} @{f['at_s']:g}s" for f in section["faults"]
    )
    return "\n".join(
        [
            f"goodput, replica groups: {section['nproc']} ranks ({section['groups']} groups for "
            f"replica, {section['semantics']} semantics), {section['window_s']:.0f} s window; "
            f"faults {faults}",
            table(
                [
                    "mode",
                    "ETTR",
                    "committed steps",
                    "step s",
                    "start-up s",
                    "stall p50 s",
                    "stall max s",
                    "heal s",
                ],
                rows,
            ),
            "",
            targets_table(section["targets"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="40 s windows, one exception each")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument(
        "--reanalyse",
        action="store_true",
        help="recompute bench/results/goodput.json from its run directories, run nothing",
    )
    parser.add_argument(
        "--replica",
        action="store_true",
        help=f"run {list(COMPARED)} on {REPLICA_NPROC} ranks under the same faults instead "
        "(written into goodput.json's replica section; --only picks among them)",
    )
    parser.add_argument(
        "--semantics",
        default=REPLICA_SEMANTICS,
        help="the replica semantics to run (resilience.replica_semantics)",
    )
    args = parser.parse_args(argv)
    only = tuple(n.strip() for n in args.only.split(",") if n.strip())
    if args.replica:
        unknown = [n for n in only if n not in COMPARED]
        if unknown:
            parser.error(f"unknown mode(s) {unknown}; choose from {list(COMPARED)}")
        run_replica_comparison(quick=args.quick, semantics=args.semantics, only=only)
        return 0
    if args.reanalyse:
        result = reanalyse(RESULTS_DIR / "goodput.json")
        print(report(result), flush=True)
        write_result("goodput", result)
        return 0
    unknown = [n for n in only if n not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    run(quick=args.quick, only=only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
