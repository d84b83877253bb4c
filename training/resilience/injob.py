"""In-job restart: ranks run under NVRx's ``ft_launcher``, which respawns them within the job.

Each rank reports to its rank monitor through ``RankMonitorClient``: a heartbeat per step and
sections around the step, checkpoint loading and checkpoint staging. When a worker is killed,
segfaults, aborts, raises (OOM included) or hangs past its section/heartbeat timeout, the
launcher stops the survivors and spawns new workers (``--max-restarts`` caps it); they resume
from the newest committed checkpoint. After enough steps have been observed, the section
timeouts are computed from the measured timings (NVRx's timeouts calculator, synchronized across
ranks) instead of the configured upper bounds (``resilience.calibrate_timeouts_after``).

Lack of progress: every attempt records the step it resumed from in ``<run_dir>/.attempts/``;
when ``no_progress_attempts`` attempts in a row resume from the same checkpoint, the attempt
stops at once with a clear cause (exit code 3) instead of training into the same fault again.
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


def _record_attempt(run_dir: Path, *, attempt: int, resumed_from: int | None) -> list[dict]:
    directory = run_dir / ".attempts"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{attempt:05d}.json").write_text(
        json.dumps({"attempt": attempt, "resumed_from": resumed_from})
    )
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def stuck(history: list[dict], *, limit: int = NO_PROGRESS_ATTEMPTS) -> bool:
    """True when the last ``limit`` attempts all resumed from the same checkpoint (a fault that
    hits before the next checkpoint every time), or ``limit`` attempts never got one."""
    if len(history) < limit:
        return False
    recent = [h["resumed_from"] for h in history[-limit:]]
    return len(set(recent)) == 1


def run_injob(config: JobConfig) -> int:
    from training.checkpoint import committed_steps
    from training.nvrx import rank_monitor_client
    from training.run import run_training

    attempt = attempt_number()
    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(config.run_dir)
    events = EventLog(run_dir=run_dir, rank=rank)
    if attempt > 0:
        events.emit("restart_end", mode="injob", attempt=attempt)
    steps = committed_steps(Path(config.checkpoint_dir))
    resumed_from = steps[-1] if steps else None
    if rank == 0:
        history = _record_attempt(run_dir, attempt=attempt, resumed_from=resumed_from)
        if attempt > 0 and stuck(history):
            cause = (
                f"no progress: the last {NO_PROGRESS_ATTEMPTS} attempts all resumed from "
                f"step {resumed_from}; the fault recurs before the next checkpoint"
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
