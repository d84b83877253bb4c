"""Restart benchmark: seconds from a fault to the next completed training step.

Three local runs (2 CPU ranks, gloo, a tiny model so steps take ~0.1 s; a checkpoint every 10
steps), 5 faults of each kind per run, one fault every 20 steps, kinds and ranks taking turns:

- in-process restart (NVRx ``inprocess.Wrapper``): ``exception`` and ``hang``;
- in-job restart (``ft_launcher``): ``sigkill`` and ``hang``;
- cold restart (plain torchrun, ``--restart none --cold-restarts K``: the whole job is launched
  again and resumes from the newest committed checkpoint): ``sigkill``.

Latency of one fault = (end of the first step started after the fault event) - (fault event
time), from events.jsonl and metrics.jsonl; p50 and max per layer and kind. Hangs are detected
by the calibrated detectors, short fixed timeouts backing them (``bench.common.HANG_TIMEOUTS``).

    python -m bench.restart            # 3 runs, 25 faults, ~8 min
    python -m bench.restart --quick    # in-process only, 1 fault of each kind

The floor of an in-job restart, measured in the same run (``floor``): the same number of fresh
processes (torchrun) importing torch and NVRx, forming the process group, building the model
without initialising it, loading (and verifying) the in-job run's newest checkpoint through
``CheckpointManager.load_latest`` and running one step. Floor = the last rank's end of that
step - the first rank's process start (from /proc); median of ``FLOOR_REPEATS``. What an in-job
restart adds to it is detection, stopping the survivors and ft_launcher's rendezvous.

Writes bench/results/restart.json: ``inprocess_p50_s``, ``injob_p50_s``, ``cold_p50_s`` (p50
over every fault of that layer, its kinds pooled; the planner reads them) and per-kind detail.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    HANG_TIMEOUTS,
    RUNS_DIR,
    TINY_MODEL,
    call_logged,
    fmt,
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
from training.checkpoint.layout import committed_steps, step_dir
from training.resilience.hang import p99
from training.runlog.accounting import summarize
from training.runlog.files import EVENTS_FILE, METRICS_FILE, append_jsonl
from training.runlog.phases import DETECTED, RESTART_PHASE

FLOOR_REPEATS = 3
FLOOR_PHASES = ("imported", "group_up", "built", "loaded", "first_step")
"""The floor's phases: torch + NVRx imported, process group up, model built, checkpoint
loaded, one step done."""
FIRST_FAULT = 25
SPACING = 20
PER_KIND = 5


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One run: a restart layer and the fault kinds it gets, in turn."""

    layer: str
    """inprocess, injob or cold."""
    kinds: tuple[str, ...]

    @property
    def restart(self) -> str:
        return "none" if self.layer == "cold" else self.layer


SCENARIOS = (
    Scenario(layer="inprocess", kinds=("exception", "hang")),
    Scenario(layer="injob", kinds=("sigkill", "hang")),
    Scenario(layer="cold", kinds=("sigkill",)),
)


def fault_latencies(run_dir: Path) -> list[tuple[str, float | None]]:
    """Per fault event, in time order: its kind and the seconds to the end of the first step
    started after it (None: training never resumed)."""
    faults = sorted(
        (float(e["time"]), str(e.get("fault")))
        for e in read_jsonl(run_dir / EVENTS_FILE)
        if e.get("kind") == "fault"
    )
    # (start, end) of every logged step. The first step *started* after the fault counts: a
    # survivor may still log the step it finished just before its peer's fault fired.
    steps = sorted(
        (float(m["time"]) - float(m["step_time_s"]), float(m["time"]))
        for m in read_jsonl(run_dir / METRICS_FILE)
    )
    out: list[tuple[str, float | None]] = []
    for t, kind in faults:
        after = next((end for start, end in steps if start > t), None)
        out.append((kind, after - t if after is not None else None))
    return out


NVRX_TIMEOUT_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\] \[WARNING\] \[RankMonServer[^\]]*\] "
    r"FT timeout elapsed\."
)
"""What an NVRx 0.4.1 rank monitor logs when a section or heartbeat timeout fires, just before
it kills its rank (``rank_monitor_server.py``, ``_periodic_rank_check``). The monitor is NVRx's
process, so an in-job hang's detection is in the launcher's log, not in events.jsonl."""


def detection_times(run_dir: Path, *, layer: str) -> list[float]:
    """Epoch seconds at which the layer detected a hang: the in-process wrapper's ``detected``
    restart phase (the soft timeout's callback), or an in-job rank monitor's timeout line in
    ``launcher.log`` (ft_launcher's output, in this process's local time)."""
    if layer == "inprocess":
        return sorted(
            float(e["time"])
            for e in read_jsonl(run_dir / EVENTS_FILE)
            if e.get("kind") == RESTART_PHASE and e.get("phase") == DETECTED
        )
    log = run_dir / "launcher.log"
    times = []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if match := NVRX_TIMEOUT_LINE.match(line):
            stamp = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
            times.append(stamp + int(match.group(2)) / 1000)
    return sorted(times)


def hang_detections(run_dir: Path, *, layer: str) -> list[float | None]:
    """Per hang fault, in time order: seconds from the fault to the first detection after it
    and before the next fault (None: none seen)."""
    faults = sorted(
        float(e["time"])
        for e in read_jsonl(run_dir / EVENTS_FILE)
        if e.get("kind") == "fault" and e.get("fault") == "hang"
    )
    every_fault = sorted(
        float(e["time"]) for e in read_jsonl(run_dir / EVENTS_FILE) if e.get("kind") == "fault"
    )
    detected = detection_times(run_dir, layer=layer)
    out: list[float | None] = []
    for t in faults:
        later = [f for f in every_fault if f > t]
        until = later[0] if later else float("inf")
        out.append(next((d - t for d in detected if t < d < until), None))
    return out


def step_time_p99(run_dir: Path) -> float | None:
    """The 99th percentile of the run's step times (every logged step, the first steps after
    each restart included: the calibrated timeouts must survive them)."""
    times = [float(m["step_time_s"]) for m in read_jsonl(run_dir / METRICS_FILE)]
    return p99(times) if times else None


def run_scenario(scenario: Scenario, *, per_kind: int) -> dict[str, dict[str, Any]]:
    """One run with ``per_kind`` faults of each kind (kinds and ranks alternate, one every
    ``SPACING`` steps); returns per-kind results."""
    count = per_kind * len(scenario.kinds)
    fault_steps = [FIRST_FAULT + SPACING * i for i in range(count)]
    spec = ";".join(
        f"{scenario.kinds[i % len(scenario.kinds)]}@{(i + 1) % 2}:{step}"
        for i, step in enumerate(fault_steps)
    )
    run_dir = RUNS_DIR / "restart" / scenario.layer
    run = run_local(
        run_dir=run_dir,
        nproc=2,
        restart=scenario.restart,
        faults=spec,
        cold_restarts=count + 2 if scenario.layer == "cold" else 0,
        overrides=(
            *TINY_MODEL,
            f"--train.steps={fault_steps[-1] + 10}",
            "--checkpoint.interval=10",
            f"--resilience.max_restarts={count + 3}",
            *HANG_TIMEOUTS,
        ),
        timeout_s=600,
    )
    measured = fault_latencies(run_dir)
    summary = summarize(run_dir=run_dir)
    p99 = step_time_p99(run_dir)
    results: dict[str, dict[str, Any]] = {}
    for kind in scenario.kinds:
        latencies = [v for k, v in measured if k == kind]
        done = [v for v in latencies if v is not None]
        extra: dict[str, Any] = {}
        if kind == "hang":
            detections = hang_detections(run_dir, layer=scenario.layer)
            extra = {
                "detection_s": detections,
                "after_detection_s": [
                    None if d is None or v is None else v - d
                    for d, v in zip(detections, latencies, strict=False)
                ],
            }
        results[f"{scenario.layer}_{kind}"] = {
            **extra,
            "step_time_p99_s": p99,
            "run_faults": summary.faults,
            "run_restarts": len(summary.restarts),
            "layer": scenario.layer,
            "kind": kind,
            "faults_injected": per_kind,
            "faults_seen": len(latencies),
            "recovered": len(done),
            "latencies_s": latencies,
            "p50_s": median(done),
            "max_s": max(done) if done else None,
            "returncode": run.returncode,
            "run_wall_s": run.wall_s,
            "run_dir": str(run_dir),
        }
    return results


def floor_worker(argv: list[str]) -> int:
    """One rank of the floor run, under torchrun: what a restarted rank cannot skip."""
    from training.runlog.phases import process_start_time

    started = process_start_time() or time.time()
    import nvidia_resiliency_ext.fault_tolerance  # noqa: F401  (an in-job worker imports it)
    import torch.distributed as dist

    from training.checkpoint.manager import CheckpointManager, needs_cpu_collectives
    from training.overrides import build_config
    from training.parallel import dist_env_from_environment, init_process_group
    from training.runlog.metrics import EventLog
    from training.trainer import Trainer

    imported = time.time()
    config, _ = build_config(argv)
    env = dist_env_from_environment(
        config.parallel, cpu_collectives=needs_cpu_collectives(config.checkpoint)
    )
    init_process_group(env, timeout_s=config.parallel.pg_timeout_s)
    group_up = time.time()
    run_dir = Path(config.run_dir)
    events = EventLog(run_dir=run_dir, rank=env.rank)
    checkpoints = CheckpointManager.for_job(
        config=config,
        rank=env.rank,
        world_size=env.world_size,
        events=events,
    )
    resume = checkpoints.resume_expected()
    trainer = Trainer(config=config, env=env, events=events, initialize=not resume)
    built = time.time()
    step = checkpoints.load_latest(trainer)
    loaded = time.time()
    trainer.train_step()
    append_jsonl(
        run_dir / "floor.jsonl",
        {
            "rank": env.rank,
            "started": started,
            "imported": imported,
            "group_up": group_up,
            "built": built,
            "loaded": loaded,
            "first_step": time.time(),
            "step": step,
        },
    )
    dist.destroy_process_group()
    return 0


def measure_floor(*, source_run: Path, repeats: int) -> dict[str, Any]:
    """Fresh 2-rank processes loading ``source_run``'s newest committed checkpoint (a copy, so
    the run's own files stay as they were), ``repeats`` times."""
    steps = committed_steps(source_run / "checkpoints")
    if not steps:
        return {"floor_s": None, "problem": f"no committed checkpoint under {source_run}"}
    samples: list[dict[str, float]] = []
    for repeat in range(repeats):
        run_dir = RUNS_DIR / "restart" / "floor" / f"r{repeat}"
        shutil.rmtree(run_dir, ignore_errors=True)
        (run_dir / "checkpoints").mkdir(parents=True)
        newest = step_dir(source_run / "checkpoints", steps[-1])
        shutil.copytree(newest, run_dir / "checkpoints" / newest.name)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "bench.restart",
            "floor-worker",
            "--recipe=debug_cpu",
            f"--run-dir={run_dir}",
            *TINY_MODEL,
            "--checkpoint.engine=sync",  # no background writer: nothing is saved
            *HANG_TIMEOUTS,
        ]
        code = call_logged(command, log_path=run_dir / "floor.log", timeout_s=180)
        rows = read_jsonl(run_dir / "floor.jsonl")
        if code != 0 or len(rows) != 2:
            return {"floor_s": None, "problem": f"floor run {run_dir} exited {code}"}
        t0 = min(r["started"] for r in rows)
        # Per phase, from the first rank's start to the last rank reaching it.
        sample = {f"{k}_s": max(r[k] for r in rows) - t0 for k in FLOOR_PHASES}
        samples.append({**sample, "loaded_step": rows[0]["step"]})
    medians = {key: median(s[key] for s in samples) for key in samples[0] if key.endswith("_s")}
    return {"floor_s": medians["first_step_s"], "phases_s": medians, "samples": samples}


def run(*, quick: bool = False) -> dict[str, Any]:
    """Run the scenarios one after the other, print the table and write the JSON."""
    per_kind = 1 if quick else PER_KIND
    scenarios = [s for s in SCENARIOS if s.layer == "inprocess"] if quick else list(SCENARIOS)
    results: dict[str, dict[str, Any]] = {}
    for scenario in scenarios:
        results.update(run_scenario(scenario, per_kind=per_kind))
    floor: dict[str, Any] = {"floor_s": None, "problem": "not measured in --quick"}
    if not quick:
        floor = measure_floor(source_run=RUNS_DIR / "restart" / "injob", repeats=FLOOR_REPEATS)
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
        target(
            "in-job SIGKILL -> next step / fresh-process floor (p50)",
            ratio(results.get("injob_sigkill", {}).get("p50_s"), floor["floor_s"]),
            goal=1.5,
            higher_is_better=False,
        ),
        *hang_targets(results),
        target(
            "restarts beyond the faults injected (false detections), every run",
            float(sum(max(0, r["run_restarts"] - r["run_faults"]) for r in runs(results))),
            goal=0,
            higher_is_better=False,
        ),
    ]
    result = {
        "machine": machine(),
        "quick": quick,
        "faults_per_kind": per_kind,
        "fault_spacing_steps": SPACING,
        "timeouts": list(HANG_TIMEOUTS),
        "inprocess_p50_s": pooled["inprocess"],
        "injob_p50_s": pooled["injob"],
        "cold_p50_s": pooled["cold"],
        "injob_floor": floor,
        "scenarios": results,
        "targets": targets,
    }
    print(report(result), flush=True)
    write_result("restart", result)
    return result


def runs(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per run (a run's kinds share its restart counts)."""
    return list({r["run_dir"]: r for r in results.values()}.values())


def hang_targets(results: dict[str, dict[str, Any]]) -> list[dict]:
    """Per layer, the issue's hang goals: detection <= max(5 x p99 step time, 2 s) for its worst
    hang (a detection bound is a guarantee), and hang -> next step <= detection + 3 s at the
    p50, like the other latency targets (the scenario's ``after_detection_s`` has every hang)."""
    out = []
    for layer, label in (("inprocess", "in-process"), ("injob", "in-job")):
        hang = results.get(f"{layer}_hang")
        if hang is None:
            continue
        p99 = hang["step_time_p99_s"]
        bound = max(5 * p99, 2.0) if p99 is not None else None
        detections = hang["detection_s"]
        worst = None if None in detections or not detections else max(detections)
        after = hang["after_detection_s"]
        median_after = None if None in after or not after else median(after)
        out += [
            target(
                f"{label} hang detection (max) / max(5 x p99 step {fmt(p99)} s, 2 s)",
                ratio(worst, bound),
                goal=1.0,
                higher_is_better=False,
            ),
            target(
                f"{label} hang -> next step, s after detection (p50)",
                median_after,
                goal=3.0,
                higher_is_better=False,
            ),
        ]
    return out


def report(result: dict[str, Any]) -> str:
    rows = [
        (
            name,
            f"{r['recovered']}/{r['faults_injected']}",
            r["p50_s"],
            r["max_s"],
            r["returncode"],
            r["run_wall_s"],
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
            "in-job restart floor (fresh processes -> checkpoint loaded -> one step), s from "
            "the first process start:",
            table(
                ["phase", "s"],
                list((result["injob_floor"].get("phases_s") or {}).items()),
            ),
            "",
            targets_table(result["targets"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["floor-worker"]:
        return floor_worker(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="in-process only, 2 faults each")
    args = parser.parse_args(argv)
    run(quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
