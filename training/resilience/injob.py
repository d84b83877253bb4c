"""In-job restart: ranks run under NVRx's ``ft_launcher``, which respawns them within the job.

Each rank reports to its rank monitor through ``RankMonitorClient``: a heartbeat per step and
sections around the step, checkpoint loading and checkpoint staging. When a worker is killed,
segfaults, aborts, raises (OOM included) or hangs past its section/heartbeat timeout, the
launcher stops the survivors and spawns new workers (``--max-restarts`` caps it); they resume
from the newest committed checkpoint. After enough steps have been observed, the section
timeouts are computed from the measured timings (NVRx's timeouts calculator, synchronized across
ranks) instead of the configured upper bounds (``resilience.calibrate_timeouts_after``).

Lack of progress: every attempt records the best step reached before it in
``<run_dir>/.attempts/``; when ``NO_PROGRESS_ATTEMPTS`` restarts in a row end without getting
past it, the attempt stops at once with a clear cause (exit code 3) instead of training into
the same fault again; ``--max-restarts`` bounds the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from training.config import JobConfig
from training.metrics import EventLog
from training.trainer import EXIT_PREEMPTED, StepHooks

EXIT_NO_PROGRESS = 3
NO_PROGRESS_ATTEMPTS = 3


def attempt_number() -> int:
    """ft_launcher (torchelastic) counts restarts of the worker group in this variable."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class MonitorHooks(StepHooks):
    """Heartbeats and sections for the rank monitor."""

    def __init__(self, client, *, calibrate_after: int) -> None:
        self.client = client
        self.calibrate_after = calibrate_after
        self.steps_seen = 0
        self.calibrated = False

    def before_step(self, step: int) -> None:
        self.client.send_heartbeat()
        self.client.start_section("step")

    def after_step(self, step: int) -> None:
        self.client.end_section("step")
        self.steps_seen += 1
        if self.calibrate_after and not self.calibrated and self.steps_seen >= self.calibrate_after:
            # Collective across ranks (NVRx synchronizes the calculated timeouts).
            self.client.calculate_and_set_section_timeouts(skip_if_not_ready=True)
            self.client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
            self.calibrated = True

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.client.start_section("checkpoint")
        try:
            yield
        finally:
            self.client.end_section("checkpoint")


def best_step_so_far(run_dir: Path, *, tail_bytes: int = 1 << 16) -> int:
    """The highest step completed by any attempt so far (rank 0's metrics; the tail is enough,
    since the latest attempts' steps are at the end of the file)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - tail_bytes))
        lines = handle.read().decode(errors="replace").splitlines()
    best = 0
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            best = max(best, int(json.loads(line)["step"]))
    return best


def _record_attempt(run_dir: Path, *, attempt: int, best_step: int) -> list[dict]:
    directory = run_dir / ".attempts"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{attempt:05d}.json").write_text(
        json.dumps({"attempt": attempt, "best_step": best_step})
    )
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def stuck(history: list[dict], *, limit: int = NO_PROGRESS_ATTEMPTS) -> bool:
    """True when the last ``limit`` restarts each ended without completing a step beyond the
    best one before them: the same fault strikes again before the run gets any further."""
    if len(history) < limit + 1:
        return False
    recent = [h["best_step"] for h in history[-(limit + 1) :]]
    return len(set(recent)) == 1


def run_injob(config: JobConfig) -> int:
    from training.nvrx import rank_monitor_client
    from training.run import run_training

    attempt = attempt_number()
    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(config.run_dir)
    events = EventLog(run_dir=run_dir, rank=rank)
    if attempt > 0:
        events.emit("restart_end", mode="injob", attempt=attempt)
    if rank == 0:
        best = best_step_so_far(run_dir)
        history = _record_attempt(run_dir, attempt=attempt, best_step=best)
        if attempt > 0 and stuck(history):
            cause = (
                f"no progress: {NO_PROGRESS_ATTEMPTS} restarts in a row failed before getting "
                f"past step {best}; stopping instead of repeating the same fault"
            )
            events.emit("run_end", status="failed", cause=cause)
            print(f"error: {cause}", file=sys.stderr, flush=True)
            return EXIT_NO_PROGRESS
    client = rank_monitor_client()
    try:
        hooks = MonitorHooks(client, calibrate_after=config.resilience.calibrate_timeouts_after)
        result = run_training(config, hooks=hooks, attempt=attempt)
    except BaseException:
        events.emit("restart_begin", mode="injob", attempt=attempt)
        raise
    finally:
        client.shutdown_workload_monitoring()
    return EXIT_PREEMPTED if result.preempted else 0
