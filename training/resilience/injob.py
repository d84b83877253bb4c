"""In-job restart: ranks run under NVRx's ``ft_launcher``, which respawns them within the job.

Each rank reports to its rank monitor through ``RankMonitorClient``: a heartbeat per step and
sections around the step, checkpoint loading and checkpoint staging. When a worker is killed,
segfaults, aborts, raises (OOM included) or hangs past its section/heartbeat timeout, the
launcher stops the survivors and spawns new workers (``--max-restarts`` caps it); they resume
from the newest committed checkpoint. After ``resilience.calibrate_timeouts_after`` steps of an
attempt, the step section's timeout is computed from the measured steps (NVRx's timeouts
calculator, synchronized across ranks, at least ``hang_floor_s`` less the rank monitors' check
interval, so a hang at the floor is detected within ``hang_floor_s``) instead of the
configured upper bound; the other timeouts stay as configured (:func:`calibrate_step_timeout`).

Lack of progress and the restart cap: every attempt records the best step reached before it in
``<run_dir>/.attempts/<rendezvous id>/``; when ``NO_PROGRESS_ATTEMPTS`` restarts in a row end
without getting past it, or ``resilience.max_restarts`` restarts have been spent, rank 0 records
the verdict (``training.runlog.verdict``) and asks ``ft_launcher`` to shut the workload down, so the
launchers exit with a code that says why (``training.exits``) instead of retrying.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from training import exits
from training.command import injob_timeout_floor_s
from training.config import JobConfig
from training.hooks import CHECKPOINT, STEP, StepHooks, Throttle, liveness_report_interval_s
from training.resilience.nvrx import rank_monitor_client
from training.resilience.step_hooks import step_hooks_for
from training.run import run_training
from training.runlog import writer
from training.runlog.files import METRICS_FILE, parse_jsonl
from training.runlog.metrics import EventLog
from training.runlog.phases import (
    DETECTED,
    PROCESSES_UP,
    RENDEZVOUS_DONE,
    SURVIVORS_STOPPED,
    emit_phase,
    process_start_time,
)
from training.runlog.verdict import current_run_id, write_verdict

NO_PROGRESS_ATTEMPTS = 3


def attempt_number() -> int:
    """ft_launcher (torchelastic) counts restarts of the worker group in this variable."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def calibrate_step_timeout(client, *, floor_s: float) -> float | None:
    """Set the step section's timeout from the steps observed so far: NVRx's calculation
    (``TimeoutsCalc.get_section_timeouts``: its safety factor, 5, times the longest step any
    rank has timed; ``synchronize_all`` is an all-reduce, so call it on every rank), but at
    least ``floor_s``. Returns the timeout set, or None when no step has been timed yet.

    Only the step section: heartbeats come once per step, so their intervals also span the
    checkpoint saves and the final save and wait, which the first steps of an attempt never
    show; NVRx's ``calculate_and_set_hb_timeouts`` (and the checkpoint and out-of-section
    timeouts) calibrated from them would kill a healthy rank while it saves. Those keep their
    configured values. ``calculate_and_set_section_timeouts`` has no floor, so the calculated
    timeouts go to the rank monitor through the client's own setter (NVRx 0.4.1
    ``rank_monitor_client.py`` ``_set_calculated_timeouts``), as that method does."""
    calc = client.timeouts_calc
    calc.synchronize_all()
    if not calc.can_get_section_timeouts(selected_sections=[STEP], calc_out_of_section=False):
        return None
    timeouts = calc.get_section_timeouts(
        selected_sections=[STEP], calc_out_of_section=False, current=client.section_timeouts
    )
    timeouts.section[STEP] = max(timeouts.section[STEP], floor_s)
    client._set_calculated_timeouts(new_hb_timeouts=None, new_section_timeouts=timeouts)
    return timeouts.section[STEP]


class MonitorHooks(StepHooks):
    """Heartbeats and sections for the rank monitor; the step section's timeout calibrated
    after ``calibrate_after`` steps (0: never).

    A hang's detection is the rank monitor's (NVRx's process, which kills the rank and writes
    nothing to the run's events), so a thread of this rank records it: when the open step
    section outlives the monitor's current step timeout, it writes the ``detected`` restart
    phase at the moment the timeout elapsed (the monitor acts within one check interval after
    it). The thread runs while the main thread hangs (a hang in a collective or a sleep
    releases the GIL) and wakes at the deadline itself, before the monitor's check can come."""

    WITNESS_POLL_S = 0.05

    def __init__(
        self,
        client,
        *,
        calibrate_after: int,
        floor_s: float,
        events: EventLog,
        attempt: int,
        mode: str,
        heartbeat_every_s: float,
    ) -> None:
        self.client = client
        self._heartbeats = Throttle(every_s=heartbeat_every_s)
        self.calibrate_after = calibrate_after
        self.floor_s = floor_s
        self.events = events
        self.attempt = attempt
        self.mode = mode
        self.steps_seen = 0
        self.calibrated = False
        self._step_opened: float | None = None
        self._beating = False  # the steps' heartbeats have begun
        self._closed = threading.Event()
        self._witness = threading.Thread(
            target=self._witness_loop, name="hang-witness", daemon=True
        )
        self._witness.start()

    def close(self) -> None:
        self._closed.set()
        self._witness.join(timeout=1.0)

    def step_timeout_s(self) -> float | None:
        """The step section's timeout the rank monitor applies now (configured or calibrated)."""
        timeouts = getattr(self.client, "section_timeouts", None)
        return None if timeouts is None else timeouts.section.get(STEP)

    def _witness_loop(self) -> None:
        recorded: float | None = None
        while True:
            wait_s = self.WITNESS_POLL_S
            opened, timeout = self._step_opened, self.step_timeout_s()
            if opened is not None and timeout is not None and opened != recorded:
                remaining = opened + timeout - time.time()
                if remaining <= 0:
                    recorded = opened
                    emit_phase(
                        self.events,
                        phase=DETECTED,
                        attempt=self.attempt + 1,
                        mode=self.mode,
                        at=opened + timeout,
                        by="step_section_timeout",
                    )
                    # The rank monitor kills this process within one check interval: the line
                    # must not wait for the writer's next flush (training/runlog/writer.py).
                    writer.flush()
                    continue
                # Woken at the deadline itself: the monitor kills the rank at its first check
                # after it, up to one check interval later.
                wait_s = min(wait_s, remaining)
            if self._closed.wait(wait_s):
                return

    def before_step(self, step: int) -> None:
        # Each call is a round trip to the rank monitor; the step section (two more) is what
        # times a step, the heartbeat only needs to beat well within its fixed timeout.
        self._beating = True
        if self._heartbeats.due():
            self.client.send_heartbeat()
        self.client.start_section(STEP)
        self._step_opened = time.time()

    def after_step(self, step: int) -> None:
        self._step_opened = None
        self.client.end_section(STEP)
        self.steps_seen += 1
        if self.calibrate_after and not self.calibrated and self.steps_seen >= self.calibrate_after:
            self.calibrated = True
            timeout = calibrate_step_timeout(self.client, floor_s=self.floor_s)  # collective
            if timeout is not None:
                self.events.emit(
                    "hang_timeout_calibrated", step=step, mode="injob", timeout_s=round(timeout, 3)
                )

    def keepalive(self) -> None:
        """A heartbeat (throttled like the steps') while the checkpoint manager waits. The rank
        monitor checks the heartbeat timeout on every pass whether or not a section is open
        (NVRx 0.4.1 ``rank_monitor_server.py``: ``_periodic_rank_check`` calls
        ``_is_hb_timeout_elapsed`` and ``_is_section_timeout_elapsed`` side by side, and only
        ``_handle_heartbeat_msg`` moves ``last_hb_time``; a section message does not), so a
        wait inside the checkpoint section longer than the heartbeat timeout kills the rank.
        Not before the first step's heartbeat: until then the monitor applies the initial
        heartbeat timeout to start-up and the checkpoint load together, and a heartbeat from
        the load would switch it to the shorter subsequent timeout for the rest of the load
        (``_is_hb_timeout_elapsed``: the initial timeout applies while ``last_hb_time`` is
        None). A wait that never ends is still bounded by its section's timeout, or outside
        one by the out-of-section timeout."""
        if self._beating and self._heartbeats.due():
            self.client.send_heartbeat()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.client.start_section(CHECKPOINT)
        try:
            yield
        finally:
            self.client.end_section(CHECKPOINT)


def best_step_so_far(run_dir: Path, *, tail_bytes: int = 1 << 16) -> int:
    """The highest step completed by any attempt so far (rank 0's metrics; the tail is enough,
    since the latest attempts' steps are at the end of the file)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return 0
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - tail_bytes))
        rows, _ = parse_jsonl(handle.read().splitlines())
    return max((row["step"] for row in rows if isinstance(row.get("step"), int)), default=0)


def _record_attempt(directory: Path, *, best_step: int) -> list[dict]:
    """Append this attempt to the job's history (one file per worker-group start) and return it.

    Attempts are counted here, not with ``TORCHELASTIC_RESTART_COUNT``: that counter is per
    launcher, and a replaced pod's launcher starts again at 0 while its peers do not.
    """
    directory.mkdir(parents=True, exist_ok=True)
    attempt = len(list(directory.glob("*.json")))
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


def final_verdict(history: list[dict], *, max_restarts: int) -> tuple[int, str] | None:
    """(exit code, cause) when this attempt must not run: no progress, or the cap reached."""
    restarts = len(history) - 1
    best = history[-1]["best_step"]
    if restarts > 0 and stuck(history):
        return exits.NO_PROGRESS, (
            f"no progress: {NO_PROGRESS_ATTEMPTS} restarts in a row failed before getting "
            f"past step {best}; stopping instead of repeating the same fault"
        )
    if restarts > max_restarts:
        return exits.RESTARTS_EXHAUSTED, (
            f"in-job restart cap reached: {max_restarts} restart(s) "
            f"(resilience.max_restarts), best step {best}"
        )
    return None


def stop_workload(client, *, run_dir: Path, code: int, cause: str) -> None:
    """Record the verdict for the launchers, then ask ft_launcher to end the whole workload
    (NVRx's ``WorkloadAction.ShutdownWorkload``: the launcher closes the rendezvous, so every
    node's launcher exits instead of restarting the workers)."""
    from nvidia_resiliency_ext.fault_tolerance import WorkloadAction
    from nvidia_resiliency_ext.fault_tolerance.data import WorkloadControlRequest

    write_verdict(run_dir=run_dir, code=code, cause=cause, run_id=current_run_id())
    client.send_workload_control_request(
        WorkloadControlRequest(WorkloadAction.ShutdownWorkload, description=cause[:200])
    )


def exclude_this_node(client, *, cause: str) -> None:
    """Ask this node's ``ft_launcher`` to leave the node out of the next rendezvous (NVRx
    0.4.1 ``WorkloadAction.ExcludeThisNode``): the request waits in the launcher's IPC
    connector; when the worker group ends, the launcher's next rendezvous attempt meets it
    (``_ft_rendezvous.py``, ``_handle_control_requests_from_rank`` in
    ``_add_to_participants``), raises ``UnhealthyNodeException``, and the launcher leaves the
    rendezvous without closing it (``launcher.py``, ``launch_agent``) and exits 0 instead of
    restarting the workers. The other nodes' launchers restart theirs and wait in the open
    rendezvous for the pod that replaces this one."""
    from nvidia_resiliency_ext.fault_tolerance import WorkloadAction
    from nvidia_resiliency_ext.fault_tolerance.data import WorkloadControlRequest

    client.send_workload_control_request(
        WorkloadControlRequest(WorkloadAction.ExcludeThisNode, description=cause[:200])
    )


def leave_if_evicted(client, result) -> None:
    """After a run stopped for a straggler's eviction: the evicted node's ranks ask their
    launcher to stop (:func:`exclude_this_node`); every other rank exits PREEMPTED, which
    its launcher treats as a failed worker group and restarts in-job."""
    if result.eviction is not None and result.eviction.this_node:
        exclude_this_node(client, cause=result.eviction.cause)


def check_attempt(config: JobConfig, *, client, events: EventLog) -> int | None:
    """Rank 0, before training: the exit code if this attempt must not run."""
    run_dir = Path(config.run_dir)
    history = _record_attempt(
        run_dir / ".attempts" / (current_run_id() or "default"), best_step=best_step_so_far(run_dir)
    )
    verdict = final_verdict(history, max_restarts=config.resilience.max_restarts)
    if verdict is None:
        return None
    code, cause = verdict
    events.emit("run_end", status="failed", cause=cause)
    print(f"error: {cause}", file=sys.stderr, flush=True)
    stop_workload(client, run_dir=run_dir, code=code, cause=cause)
    return code


def run_injob(config: JobConfig) -> int:
    attempt = attempt_number()
    rank = int(os.environ.get("RANK", "0"))
    events = EventLog(run_dir=Path(config.run_dir), rank=rank)
    mode = config.resilience.restart
    if attempt > 0:
        events.emit("restart_end", mode="injob", attempt=attempt)
    # ft_launcher spawns the workers as soon as its rendezvous round completes, so this
    # process's start time marks the rendezvous; now, with torch and NVRx imported, it is up.
    emit_phase(events, phase=RENDEZVOUS_DONE, attempt=attempt, mode=mode, at=process_start_time())
    emit_phase(events, phase=PROCESSES_UP, attempt=attempt, mode=mode)
    client = rank_monitor_client()
    try:
        if rank == 0:
            code = check_attempt(config, client=client, events=events)
            if code is not None:
                return code
        hooks = MonitorHooks(
            client,
            calibrate_after=config.resilience.calibrate_timeouts_after,
            floor_s=injob_timeout_floor_s(config.resilience),
            events=events,
            attempt=attempt,
            mode=mode,
            heartbeat_every_s=liveness_report_interval_s(config.resilience.heartbeat_timeout_s),
        )
        try:
            result = run_training(
                config, hooks=step_hooks_for(config, layer=hooks), attempt=attempt
            )
        except BaseException:
            # This rank saw the fault (its own, or a collective that failed with a dead peer)
            # and leaves now; the launcher restarts the workers.
            events.emit("restart_begin", mode="injob", attempt=attempt)
            emit_phase(events, phase=DETECTED, attempt=attempt + 1, mode=mode)
            emit_phase(events, phase=SURVIVORS_STOPPED, attempt=attempt + 1, mode=mode)
            writer.flush()  # the launcher may stop this process before its exit's flush
            raise
        finally:
            hooks.close()
        leave_if_evicted(client, result)
    finally:
        client.shutdown_workload_monitoring()
    return result.exit_code
