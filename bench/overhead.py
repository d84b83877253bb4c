"""Overhead benchmark: the per-step cost of the restart layers with every default feature on.

Fault-free local runs of the same job (CPU ranks, gloo, the debug model, no checkpoint save), at
2 and at 4 ranks, in three modes: the floor ``none`` (plain torchrun with every per-step feature
that is on by default turned off: :data:`FEATURES_OFF`: straggler detection, the recipe's
pod-memory snapshots, the launcher's exporter), and ``inprocess`` and ``injob`` with all of them
at their defaults. Per run, over the steady-state steps (the first ``WARMUP`` excluded): the
median step interval (end to end), the median ``step_time_s`` (the step's own work), the mean
time between steps, and the step's own sections (forward, backward, communication, optimizer:
rank 0's medians from the straggler reports).

Two estimators, reported side by side:

- **Round ratios.** Interleaved rounds: each round runs the floor and both layers back to back
  (order rotating); a layer's round ratio is its interval over the same round's floor's, so slow
  drifts of the machine cancel. Reported: the median over rounds, its IQR and a bootstrap CI
  (:data:`CONFIDENCE`); the verdict is PASS only when the whole CI is under :data:`GOAL`, MISS
  when it is all above, UNRESOLVED between, none under :data:`MIN_ROUNDS` rounds. Whole runs of
  one configuration differ by ~14% on a quiet shared 2-core VM and by ~30% under load, which
  earlier single-round figures (+7.4% then -10.8% for the same code) could not see.
- **Within-run attribution.** The gap between two steps, split by what ran there (nothing but
  the per-step hooks; a pod-memory snapshot; a straggler report), each feature's extra divided
  by its interval and by the floor's step interval. The same run's plain gaps are the
  reference, so run-level noise cancels; what it cannot see is a cost inside the step or another
  process's CPU (the exporter: ``bench.exporter``).

``make bench`` runs :data:`ROUNDS` rounds of :data:`STEPS` steps (~10 min on a quiet VM).

    python -m bench.overhead              # 2 and 4 ranks x 5 rounds x 3 modes
    python -m bench.overhead --quick      # 20 steps, 2 rounds (no verdict)
    python -m bench.overhead --nprocs 4 --rounds 8 --steps 40
    python -m bench.overhead --reanalyze  # rebuild the result from the last runs' directories
    python -m bench.overhead --diagnose   # 5 runs x 100 steps, ~4 min
    python -m bench.overhead --straggler  # the straggler detector on vs off, ~3 min
    python -m bench.overhead --split      # the layers bare and the features alone, ~6 min

``--diagnose`` (not part of ``make bench``) answers why the 4-rank in-job goodput steps looked
slower than the baseline's: 4 ranks, the tiny model, a checkpoint every 25 steps, restart
layer x checkpoint engine (the old goodput baseline used synchronous checkpoints, the other
modes NVRx async ones), reporting the median and the mean step interval.

``--straggler`` (not part of ``make bench``) measures the straggler detector's cost as it runs
by default (``straggler.enabled``, a report every ``straggler.report_every`` = 20 steps; the
policy off): 2 ranks, plain torchrun, detector on and off in alternating order over rounds,
60 steps each (reports at steps 20, 40 and 60). The figure is the mean step interval (a mean,
so that the reports count), the fastest round of each, on / off - 1; beside it the mean time
between steps that is not the step, whose difference is the detector's own time per step.

Writes bench/results/overhead.json (``overhead_inprocess``, ``overhead_injob`` at 2 ranks;
``overhead_<layer>_<n>ranks``: the median round ratio - 1), with ``--diagnose``
overhead_diagnosis.json, with ``--straggler`` straggler_overhead.json (``overhead_straggler``:
on / off - 1).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import subprocess
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
    wait_until_quiet,
    write_result,
)
from training.config import StragglerConfig
from training.modes import MODES as RESTART_MODES
from training.recipes import recipe_config
from training.runlog.files import EVENTS_FILE, METRICS_FILE, STRAGGLER_REPORT_EVENT

MODES = tuple(
    mode
    for mode, row in RESTART_MODES.items()
    if mode != "nested" and not row.replica_groups  # replica: its own launch (not measured here)
)
"""``none``: plain torchrun with every default feature off (the floor, :data:`FEATURES_OFF`);
``inprocess``, ``injob``: the restart layers with every feature at its default."""
LAYERS = tuple(mode for mode in MODES if mode != "none")
"""The restart layers, each measured against the floor (nested is both layers at once)."""
NPROCS = (2, 4)
# Rounds and steps per rank count (make bench): a 4-rank run is ~2.5x a 2-rank one (4 ranks
# importing torch and stepping on 2 cores).
ROUNDS = {2: 5, 4: 5}
STEPS = {2: 32, 4: 32}
WARMUP = 8
GOAL = 0.02
"""The per-step overhead target of the restart layers with every default feature on."""
FEATURES_OFF: tuple[str, ...] = (
    "--straggler.enabled=false",  # on by default: section timings, a report every 20 steps
    "--checkpoint.memory_interval=0",  # the recipe's pod-memory snapshots (restart layers only)
    "--metrics-port=0",  # the launcher's Prometheus exporter process
)
"""The floor's settings: every per-step feature that is on by default, off. (Keepalive runs
only inside a blocking checkpoint wait, which no run here has: no save.)"""
SNAPSHOT_EVERY = recipe_config("debug_cpu").checkpoint.memory_interval
"""The benchmark's recipe's pod-memory snapshot interval."""
BOOTSTRAP = 2000
MIN_ROUNDS = 5
"""Fewer rounds give no interval worth judging by (a bootstrap of 3 values is their range):
no verdict."""
CONFIDENCE = 0.90
# The 4-rank diagnosis (``--diagnose``): the tiny model of the goodput runs, a checkpoint every
# 25 steps, restart layer x checkpoint engine.
DIAGNOSIS: tuple[tuple[str, str], ...] = (
    ("none", "sync"),
    ("none", "nvrx"),
    ("injob", "sync"),
    ("injob", "nvrx"),
    ("inprocess", "nvrx"),
)


def steady_state(run_dir, *, warmup: int) -> dict[str, Any]:
    metrics = [m for m in read_jsonl(run_dir / METRICS_FILE) if m.get("attempt", 0) == 0]
    metrics.sort(key=lambda m: m["step"])
    steady = [m for m in metrics if m["step"] > warmup]
    pairs = [(a, b) for a, b in itertools.pairwise(steady) if b["step"] == a["step"] + 1]
    intervals = [b["time"] - a["time"] for a, b in pairs]
    return {
        "steps": len(metrics),
        "step_time_s": median(m["step_time_s"] for m in steady),
        "interval_s": median(intervals),
        "interval_mean_s": sum(intervals) / len(intervals) if intervals else None,
        # Within the run, the time between steps that is not the step: the per-step hooks
        # (pings, heartbeats, sections), the logging, and what comes every N steps (memory
        # snapshots): a mean, so that those count. Free of the run-level noise.
        "outside_step_s": (
            sum(b["time"] - a["time"] - b["step_time_s"] for a, b in pairs) / len(pairs)
            if pairs
            else None
        ),
        "sections_ms": step_sections(run_dir),
        "between_ms": between_steps(run_dir, pairs),
    }


def between_steps(run_dir, pairs: list[tuple[dict, dict]]) -> dict[str, float | None]:
    """The time between two steps (not the step), split by what ran there, within one run
    (free of the run-level noise): ``plain`` (the median gap after a step with nothing else:
    hooks, pings, heartbeats, logging), and the extra of the gap after a pod-memory snapshot
    (``snapshot``) and after a straggler report (``report``, less the snapshot taken at the
    same step), in ms. A feature every N steps costs its extra / N per step."""
    events = read_jsonl(run_dir / EVENTS_FILE)
    snapshots = {e["step"] for e in events if e.get("kind") == "memory_snapshot"}
    reports = {e["step"] for e in events if e.get("kind") == STRAGGLER_REPORT_EVENT}
    gaps = {b["step"]: b["time"] - a["time"] - b["step_time_s"] for a, b in pairs}
    plain = median(g for step, g in gaps.items() if step - 1 not in snapshots | reports)
    if plain is None:
        return {"plain": None, "snapshot": None, "report": None}
    snapshot = median(
        g - plain for step, g in gaps.items() if step - 1 in snapshots and step - 1 not in reports
    )
    report = median(
        g - plain - (snapshot if step - 1 in snapshots and snapshot is not None else 0.0)
        for step, g in gaps.items()
        if step - 1 in reports
    )
    return {
        "plain": plain * 1e3,
        "snapshot": None if snapshot is None else snapshot * 1e3,
        "report": None if report is None else report * 1e3,
    }


def attribution(runs: list[dict], floor: list[dict]) -> dict[str, float | None]:
    """Each feature's per-step cost as a share of the floor's step interval (medians over
    rounds): the layer's per-step hooks (its plain gap less the floor's), the pod-memory
    snapshot (its extra / ``memory_interval``), the straggler report (its extra /
    ``report_every``). Within-run figures: they resolve what the round ratios cannot."""
    interval = median(f["interval_s"] for f in floor)
    if not interval:
        return {}

    def part(key: str, runs_: list[dict]) -> float | None:
        return median((r.get("between_ms") or {}).get(key) for r in runs_)

    plain, floor_plain = part("plain", runs), part("plain", floor)
    snapshot, report = part("snapshot", runs), part("report", runs)
    every = {"snapshot": SNAPSHOT_EVERY, "report": StragglerConfig().report_every}
    out = {
        "per_step_hooks": (
            None if plain is None or floor_plain is None else (plain - floor_plain) / 1e3 / interval
        ),
        "pod_memory_snapshot": (
            None if snapshot is None else snapshot / every["snapshot"] / 1e3 / interval
        ),
        "straggler_report": None if report is None else report / every["report"] / 1e3 / interval,
    }
    out["sum"] = sum(v for v in out.values() if v is not None)
    return out


def step_sections(run_dir) -> dict[str, float] | None:
    """The step's own sections on rank 0 (forward, backward, communication, optimizer): the
    median over the straggler reports of each report's median, in ms (runs with the detector
    on; None without)."""
    reports = [
        e.get("sections_ms") or {}
        for e in read_jsonl(run_dir / EVENTS_FILE)
        if e.get("kind") == STRAGGLER_REPORT_EVENT
    ]
    names = sorted({name for r in reports for name in r})
    if not names:
        return None
    return {name: median(r.get(name) for r in reports) for name in names}


def _one(*, nproc: int, mode: str, steps: int, run_dir, overrides=(), quiet_s=60.0) -> dict:
    quiet_wait_s = wait_until_quiet(timeout_s=quiet_s)
    done = run_local(
        run_dir=run_dir,
        nproc=nproc,
        restart=mode,
        overrides=(
            f"--train.steps={steps}",
            # No save, so no checkpoint worker: a fresh NVRx worker imports torch beside the
            # first steps (``CheckpointManager.poll`` lets them overlap), which here would
            # measure the import on 2 shared cores, not the restart layer.
            "--checkpoint.engine=sync",
            "--checkpoint.interval=0",
            # No final save: its write-back would still be flushing when the next run starts.
            "--checkpoint.save_final=false",
            "--resilience.heartbeat_timeout_s=60",
            *overrides,
        ),
        timeout_s=300,
    )
    stats = steady_state(run_dir, warmup=min(WARMUP, steps // 3))
    stats.update(returncode=done.returncode, wall_s=done.wall_s, quiet_wait_s=quiet_wait_s)
    return stats


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: list[float], *, seed: int = 0) -> dict[str, Any]:
    """Median of ``values`` (one per round), its interquartile range, and a percentile
    bootstrap confidence interval of the median (:data:`CONFIDENCE`, rounds resampled)."""
    if not values:
        return {"median": None, "iqr": None, "ci": None, "n": 0}
    rng = random.Random(seed)
    medians = [statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP)]
    tail = (1.0 - CONFIDENCE) / 2.0
    return {
        "median": statistics.median(values),
        "iqr": [_quantile(values, 0.25), _quantile(values, 0.75)],
        "ci": [_quantile(medians, tail), _quantile(medians, 1.0 - tail)],
        "confidence": CONFIDENCE,
        "n": len(values),
    }


def verdict(overhead: dict[str, Any], *, goal: float = GOAL) -> str:
    """PASS when the whole interval is under the goal, MISS when it is all above, else
    UNRESOLVED: the rounds' spread cannot tell."""
    if overhead["ci"] is None or overhead["n"] < MIN_ROUNDS:
        return "n/a"
    low, high = overhead["ci"]
    if high <= goal:
        return "PASS"
    if low > goal:
        return "MISS"
    return "UNRESOLVED"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(
    *,
    quick: bool = False,
    rounds: int | None = None,
    steps: int | None = None,
    nprocs: tuple[int, ...] = NPROCS,
) -> dict:
    """Interleaved rounds: each round runs the floor and both layers back to back (order
    rotating), and each layer's round ratio is taken against the same round's floor, so slow
    drifts of the machine cancel. Reported per layer: the median of the round ratios with its
    IQR and bootstrap CI, and the within-run split of the step interval (the step's own time,
    its sections, the time between steps) which run-level noise does not touch."""
    by_nproc: dict[str, dict[str, Any]] = {}
    targets = []
    load_before = load_average()
    for nproc in nprocs:
        steps_here = steps or (20 if quick else STEPS.get(nproc, 40))
        rounds_here = rounds or (2 if quick else ROUNDS.get(nproc, 4))
        port = 9400 + nproc  # the exporter's port in this benchmark (the default may be taken)
        per_mode: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for round_ in range(rounds_here):
            order = MODES[round_ % 3 :] + MODES[: round_ % 3]
            for mode in order:
                run_dir = RUNS_DIR / "overhead" / f"{nproc}ranks_{mode}_{round_}"
                overrides = FEATURES_OFF if mode == "none" else (f"--metrics-port={port}",)
                per_mode[mode].append(
                    _one(
                        nproc=nproc,
                        mode=mode,
                        steps=steps_here,
                        run_dir=run_dir,
                        overrides=overrides,
                        # Interleaving is the defence against the shared machine's load; a
                        # long wait for idle CPUs would not end here.
                        quiet_s=3.0,
                    )
                )
        by_nproc[str(nproc)] = summarize(per_mode, steps=steps_here, rounds=rounds_here)
        targets += nproc_targets(nproc, by_nproc[str(nproc)])
        # Written after each rank count too: a long run interrupted keeps what it measured.
        write_result("overhead", _result(by_nproc, targets, load_before=load_before, quick=quick))
    result = _result(by_nproc, targets, load_before=load_before, quick=quick)
    print(report(result), flush=True)
    write_result("overhead", result)
    return result


def reanalyze(*, nprocs: tuple[int, ...] = NPROCS) -> dict[str, Any]:
    """Rebuild the result from the run directories a measurement left (``RUNS_DIR/overhead``):
    the figures' code changed, the runs did not."""
    by_nproc: dict[str, dict[str, Any]] = {}
    targets: list[dict] = []
    for nproc in nprocs:
        per_mode: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        round_ = 0
        while all(
            (RUNS_DIR / "overhead" / f"{nproc}ranks_{mode}_{round_}" / METRICS_FILE).is_file()
            for mode in MODES
        ):
            for mode in MODES:
                run_dir = RUNS_DIR / "overhead" / f"{nproc}ranks_{mode}_{round_}"
                stats = steady_state(run_dir, warmup=WARMUP)
                stats.update(returncode=None, wall_s=None, quiet_wait_s=None)
                per_mode[mode].append(stats)
            round_ += 1
        if not round_:
            continue
        steps = per_mode["none"][0]["steps"]
        by_nproc[str(nproc)] = summarize(per_mode, steps=steps, rounds=round_)
        targets += nproc_targets(nproc, by_nproc[str(nproc)])
    result = _result(by_nproc, targets, load_before=[], quick=False)
    result["reanalyzed"] = True
    print(report(result), flush=True)
    write_result("overhead", result)
    return result


def nproc_targets(nproc: int, modes: dict[str, Any]) -> list[dict]:
    rows = []
    for mode in LAYERS:
        overhead = modes[mode]["overhead"]
        row = target(
            f"{nproc} ranks: {mode} step interval / none - 1 (median of rounds)",
            overhead["median"],
            goal=GOAL,
            higher_is_better=False,
        )
        row["ci"] = overhead["ci"]
        row["verdict"] = verdict(overhead)
        rows.append(row)
        share = modes[mode]["attribution"].get("sum")
        rows.append(
            target(
                f"{nproc} ranks: {mode} features' within-run cost / none's step interval",
                share,
                goal=GOAL,
                higher_is_better=False,
            )
        )
    return rows


def summarize(
    per_mode: dict[str, list[dict[str, Any]]], *, steps: int, rounds: int
) -> dict[str, Any]:
    """Per mode: the round ratios' spread, the within-run split and its attribution."""
    modes: dict[str, dict[str, Any]] = {}
    floor = per_mode["none"]
    for mode, runs in per_mode.items():
        round_ratios = [
            r["interval_s"] / f["interval_s"] - 1.0
            for r, f in zip(runs, floor, strict=True)
            if r["interval_s"] and f["interval_s"]
        ]
        step_ratios = [
            r["step_time_s"] / f["step_time_s"] - 1.0
            for r, f in zip(runs, floor, strict=True)
            if r["step_time_s"] and f["step_time_s"]
        ]
        outside = [r["outside_step_s"] for r in runs if r["outside_step_s"] is not None]
        floor_outside = median(f["outside_step_s"] for f in floor)
        floor_interval = median(f["interval_s"] for f in floor)
        modes[mode] = {
            "interval_s": median(r["interval_s"] for r in runs),
            "step_time_s": median(r["step_time_s"] for r in runs),
            "outside_step_s": median(outside),
            "overhead": spread(round_ratios),
            "step_time_overhead": spread(step_ratios),
            # Within-run: what the layer adds between steps, as a share of the floor's
            # step interval (free of the run-level noise that the round ratios carry).
            "between_steps_share": (
                None
                if not outside or floor_outside is None or not floor_interval
                else (median(outside) - floor_outside) / floor_interval
            ),
            "sections_ms": _median_sections(runs),
            "attribution": attribution(runs, floor),
            "steps": steps,
            "rounds": rounds,
            "runs": runs,
        }
    return modes


def _result(
    by_nproc: dict[str, Any], targets: list[dict], *, load_before: list[float], quick: bool
) -> dict[str, Any]:
    nprocs = [int(n) for n in by_nproc]
    result: dict[str, Any] = {
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "uptime": _uptime(),
        "quick": quick,
        "method": (
            "interleaved rounds (floor, inprocess, injob; order rotating); per round, layer "
            "median step interval / the same round's floor - 1; median over rounds, IQR, "
            f"{CONFIDENCE:.0%} bootstrap CI of the median; PASS when the CI is under the goal"
        ),
        "features_off_in_floor": list(FEATURES_OFF),
        "steps": {str(n): by_nproc[str(n)]["none"]["steps"] for n in nprocs},
        "warmup_steps": WARMUP,
        "rounds": {str(n): by_nproc[str(n)]["none"]["rounds"] for n in nprocs},
        "nprocs": list(nprocs),
        "by_nproc": by_nproc,
        "targets": list(targets),
    }
    if "2" in by_nproc:  # the 2-rank figures under the keys the planner and run_all read
        result["modes"] = by_nproc["2"]
    for nproc, modes in by_nproc.items():
        for mode in LAYERS:
            value = modes[mode]["overhead"]["median"]
            result[f"overhead_{mode}_{nproc}ranks"] = value
            if nproc == "2":
                result[f"overhead_{mode}"] = value
    return result


def _median_sections(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    sections = [r["sections_ms"] for r in runs if r.get("sections_ms")]
    if not sections:
        return None
    names = sorted({n for s in sections for n in s})
    return {n: median(s.get(n) for s in sections) for n in names}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _role(proc, procs: dict) -> str:
    """rank / rank helper (NVRx checkpoint worker, ...) / rank monitor / launcher."""
    cmd = " ".join(proc.info["cmdline"] or ())
    parent = procs.get(proc.info["ppid"])
    parent_cmd = " ".join(parent.info["cmdline"] or ()) if parent is not None else ""
    if "training train" in parent_cmd:
        return "rank helpers"
    if "training train" in cmd:
        return "ranks"
    if "ft_launcher" in cmd and "ft_launcher" in parent_cmd:
        return "rank monitors"
    return "launchers"


class CpuSampler:
    """Samples the CPU time of every process of one run (its run dir in the command line, or
    a descendant of one) every ``period_s``, by role."""

    def __init__(self, marker: str, period_s: float = 0.5) -> None:
        import threading

        self.marker, self.period_s = marker, period_s
        self.samples: dict[int, list[tuple[float, float, str]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        import time

        import psutil

        while not self._stop.wait(self.period_s):
            now = time.time()
            procs = {p.pid: p for p in psutil.process_iter(["cmdline", "ppid"])}
            ours: set[int] = set()
            for pid, proc in procs.items():
                if self.marker in " ".join(proc.info["cmdline"] or ()):
                    ours.add(pid)
            changed = True
            while changed:
                changed = False
                for pid, proc in procs.items():
                    if pid not in ours and proc.info["ppid"] in ours:
                        ours.add(pid)
                        changed = True
            for pid in ours:
                proc = procs[pid]
                try:
                    times = proc.cpu_times()
                except Exception:
                    continue
                self.samples.setdefault(pid, []).append(
                    (now, times.user + times.system, _role(proc, procs))
                )

    def cores(self, t_a: float, t_b: float) -> dict[str, float]:
        """Average cores used per role between t_a and t_b."""
        used: dict[str, float] = {}
        for series in self.samples.values():
            inside = [s for s in series if t_a <= s[0] <= t_b]
            if not inside:
                continue
            before = [s for s in series if s[0] < t_a]
            start = before[-1][1] if before else 0.0
            used[inside[-1][2]] = used.get(inside[-1][2], 0.0) + inside[-1][1] - start
        return {role: cpu / (t_b - t_a) for role, cpu in sorted(used.items())}


def diagnose(*, steps: int = 150) -> dict[str, Any]:
    """Why 4-rank in-job goodput steps looked slower: restart layer x checkpoint engine, with
    the cores each kind of process used in the steady state (step 10 to the end)."""
    from bench.common import TINY_MODEL

    rows = {}
    for mode, engine in DIAGNOSIS:
        run_dir = RUNS_DIR / "overhead" / f"diagnose_4ranks_{mode}_{engine}"
        with CpuSampler(f"--run-dir={run_dir}") as sampler:
            stats = _one(
                nproc=4,
                mode=mode,
                steps=steps,
                run_dir=run_dir,
                overrides=(
                    *TINY_MODEL,
                    "--checkpoint.interval=25",
                    f"--checkpoint.engine={engine}",
                ),
            )
        metrics = sorted(read_jsonl(run_dir / METRICS_FILE), key=lambda m: m["step"])
        steady = [m["time"] for m in metrics if m["step"] > WARMUP]
        stats["cores"] = sampler.cores(steady[0], steady[-1]) if len(steady) > 1 else {}
        rows[f"{mode}+{engine}"] = stats
    result = {"machine": machine(), "steps": steps, "nproc": 4, "runs": rows}
    roles = ("ranks", "rank helpers", "rank monitors", "launchers")
    print(
        table(
            [
                "layer+engine",
                "step_time s (median)",
                "interval s (median)",
                "interval s (mean)",
                *(f"cores: {r}" for r in roles),
            ],
            [
                (
                    k,
                    r["step_time_s"],
                    r["interval_s"],
                    r["interval_mean_s"],
                    *(r["cores"].get(role) for role in roles),
                )
                for k, r in rows.items()
            ],
        )
    )
    write_result("overhead_diagnosis", result)
    return result


STRAGGLER_STEPS = 60
STRAGGLER_ROUNDS = 2


def straggler(*, rounds: int = STRAGGLER_ROUNDS, steps: int = STRAGGLER_STEPS) -> dict[str, Any]:
    """The straggler detector at its defaults vs off, same job, alternating order."""
    variants = {"on": (), "off": ("--straggler.enabled=false",)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for round_ in range(rounds):
        order = ("on", "off") if round_ % 2 == 0 else ("off", "on")
        for name in order:
            run_dir = RUNS_DIR / "overhead" / f"straggler_{name}_{round_}"
            runs[name].append(
                _one(nproc=2, mode="none", steps=steps, run_dir=run_dir, overrides=variants[name])
            )
    rows = {}
    for name, rs in runs.items():
        fastest = min(rs, key=lambda r: r["interval_mean_s"])
        rows[name] = {
            "interval_mean_s": fastest["interval_mean_s"],
            "interval_s": fastest["interval_s"],
            "step_time_s": fastest["step_time_s"],
            "outside_step_s": median(r["outside_step_s"] for r in rs),
            "runs": rs,
        }
    on, off = rows["on"], rows["off"]
    result: dict[str, Any] = {
        "machine": machine(),
        "steps": steps,
        "warmup_steps": WARMUP,
        "rounds": rounds,
        "nproc": 2,
        "restart": "none",
        "report_every": StragglerConfig().report_every,
        "variants": rows,
        "overhead_straggler": ratio(on["interval_mean_s"], off["interval_mean_s"]) - 1.0,
        "detector_s_per_step": on["outside_step_s"] - off["outside_step_s"],
    }
    print(
        table(
            ["detector", "step interval s (mean)", "step interval s (median)", "between steps ms"],
            [
                (name, r["interval_mean_s"], r["interval_s"], r["outside_step_s"] * 1e3)
                for name, r in rows.items()
            ],
        )
    )
    print(
        f"straggler detector: on / off - 1 = {result['overhead_straggler']:+.2%} of the step "
        f"interval; {result['detector_s_per_step'] * 1e3:+.2f} ms per step between steps"
    )
    write_result("straggler_overhead", result)
    return result


SPLIT_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "floor": ("none", FEATURES_OFF),
    "features": ("none", ("--metrics-port=9402",)),
    "inprocess_bare": ("inprocess", FEATURES_OFF),
    "injob_bare": ("injob", FEATURES_OFF),
}
"""``--split``'s runs: the floor; the default features on plain torchrun (straggler detection
and the exporter: pod-memory snapshots run in the restart layers only); each restart layer with
every feature off. Which of the two, the layer or the features, costs the step's own time."""
SPLIT_ROUNDS = 4


def split(*, rounds: int = SPLIT_ROUNDS, steps: int = STEPS[2]) -> dict[str, Any]:
    """Where the round ratios' cost sits at 2 ranks: each variant of :data:`SPLIT_VARIANTS`
    against the same round's floor (interleaved, order rotating), for the step interval and for
    the step's own time (``step_time_s``: the forward, backward and optimizer, which the
    within-run attribution between steps cannot see)."""
    names = tuple(SPLIT_VARIANTS)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            mode, overrides = SPLIT_VARIANTS[name]
            run_dir = RUNS_DIR / "overhead" / f"split_{name}_{round_}"
            runs[name].append(
                _one(
                    nproc=2,
                    mode=mode,
                    steps=steps,
                    run_dir=run_dir,
                    overrides=overrides,
                    quiet_s=3.0,
                )
            )
    floor = runs["floor"]
    rows: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        rows[name] = {
            "interval_s": median(r["interval_s"] for r in rs),
            "step_time_s": median(r["step_time_s"] for r in rs),
            "interval_overhead": spread(
                [r["interval_s"] / f["interval_s"] - 1.0 for r, f in zip(rs, floor, strict=True)]
            ),
            "step_time_overhead": spread(
                [r["step_time_s"] / f["step_time_s"] - 1.0 for r, f in zip(rs, floor, strict=True)]
            ),
            "runs": rs,
        }
    result = {
        "machine": machine(),
        "nproc": 2,
        "steps": steps,
        "rounds": rounds,
        "warmup_steps": WARMUP,
        "variants": {name: " ".join((m, *o)) for name, (m, o) in SPLIT_VARIANTS.items()},
        "load_average": load_average(),
        "cases": rows,
        **{
            f"{name}_{figure}": rows[name][figure]["median"]
            for name in names
            if name != "floor"
            for figure in ("interval_overhead", "step_time_overhead")
        },
    }

    def pct(o: dict[str, Any]) -> str:
        ci = o["ci"]
        return f"{o['median']:+.1%} ({ci[0]:+.1%}..{ci[1]:+.1%})" if ci else "-"

    print(
        table(
            ["variant", "interval s", "step s", "interval / floor - 1 (CI)", "step / floor - 1"],
            [
                (
                    name,
                    r["interval_s"],
                    r["step_time_s"],
                    pct(r["interval_overhead"]),
                    pct(r["step_time_overhead"]),
                )
                for name, r in rows.items()
            ],
        )
    )
    write_result("overhead_split", result)
    return result


def report(result: dict[str, Any]) -> str:
    lines = [f"load: {result.get('uptime', '')}"]
    for nproc, modes in result["by_nproc"].items():
        rows = []
        for mode, m in modes.items():
            o = m["overhead"]
            sections = m.get("sections_ms") or {}
            rows.append(
                (
                    mode,
                    m["interval_s"],
                    m["step_time_s"],
                    None if m["outside_step_s"] is None else m["outside_step_s"] * 1e3,
                    o["median"],
                    None if o["iqr"] is None else f"{o['iqr'][0]:+.1%}..{o['iqr'][1]:+.1%}",
                    None if o["ci"] is None else f"{o['ci'][0]:+.1%}..{o['ci'][1]:+.1%}",
                    m["step_time_overhead"]["median"],
                    m["between_steps_share"],
                    " ".join(f"{k[:4]}={v:.1f}" for k, v in sections.items()) or None,
                    " ".join(
                        f"{k}={v:+.2%}"
                        for k, v in (m.get("attribution") or {}).items()
                        if v is not None and mode != "none"
                    )
                    or None,
                )
            )
        lines += [
            f"overhead: {nproc} ranks, debug model, {modes['none']['steps']} steps per run, no "
            f"faults, medians after {result['warmup_steps']} warm-up steps, "
            f"{modes['none']['rounds']} interleaved round(s); floor: none with "
            + " ".join(result["features_off_in_floor"]),
            table(
                [
                    "layer",
                    "interval s",
                    "step s",
                    "between ms",
                    "overhead (median)",
                    "IQR",
                    "CI",
                    "step-time overhead",
                    "between-steps share",
                    "sections ms (rank 0)",
                    "within-run cost x floor interval",
                ],
                rows,
            ),
            "",
        ]
    return "\n".join([*lines, targets_table(result["targets"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="20 steps per run")
    parser.add_argument(
        "--rounds", type=int, help="runs per mode (rotating order); default 2 at each rank count"
    )
    parser.add_argument("--nprocs", default="2,4", help="rank counts, comma-separated")
    parser.add_argument("--steps", type=int, help="steps per run (default 32)")
    parser.add_argument(
        "--reanalyze",
        action="store_true",
        help="rebuild overhead.json from the last measurement's run directories (no runs)",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="4 ranks, tiny model, checkpoints every 25 steps: layer x engine (not in make bench)",
    )
    parser.add_argument(
        "--straggler",
        action="store_true",
        help="the straggler detector on vs off, 2 ranks (not in make bench)",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="2 ranks: the layers with every feature off, and the features on plain torchrun, "
        "each against the floor (not in make bench)",
    )
    args = parser.parse_args(argv)
    if args.split:
        split(rounds=max(1, args.rounds or SPLIT_ROUNDS))
        return 0
    if args.straggler:
        straggler(rounds=max(1, args.rounds or STRAGGLER_ROUNDS))
        return 0
    if args.diagnose:
        diagnose()
        return 0
    nprocs = tuple(int(n) for n in args.nprocs.split(",") if n.strip())
    if args.reanalyze:
        reanalyze(nprocs=nprocs)
        return 0
    run(
        quick=args.quick,
        rounds=None if args.rounds is None else max(1, args.rounds),
        steps=args.steps,
        nprocs=nprocs,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
