"""In-process restart with NVRx's ``inprocess.Wrapper``.

The training function is wrapped; when any rank raises or hangs, every rank aborts, health
checks run (CUDA checks on GPU only; none on CPU), ranks are reassigned, the process group is
re-created with a fresh store prefix, the state comes back from the newest committed checkpoint,
and training continues in the same processes. ``resilience.max_restarts`` bounds the restarts
(NVRx's ``RetryController``); losing a rank stops the job too (``min_world_size``), since the
global batch, and so the result, would change.

Ports: torchrun's store is on MASTER_PORT; the wrapper's own store on MASTER_PORT+1; the
process groups' base store on MASTER_PORT+2 (created once, outside the wrapper; each restart
iteration uses its own prefix of it).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from training import exits
from training.config import JobConfig
from training.hooks import HookChain, StepHooks, Throttle, liveness_report_interval_s
from training.parallel import await_rank0_store
from training.resilience.hang import CalibratedHangWatchdog
from training.resilience.injob import attempt_number, check_attempt, leave_if_evicted
from training.resilience.nvrx import inprocess_wrapper, rank_monitor_client, report_hang
from training.resilience.step_hooks import step_hooks_for
from training.run import release_leftovers, run_training
from training.runlog.metrics import EventLog
from training.runlog.phases import (
    DETECTED,
    PROCESSES_UP,
    RENDEZVOUS_DONE,
    emit_phase,
    process_start_time,
)
from training.runlog.verdict import current_run_id, write_verdict

WRAPPER_PORT_OFFSET = 1
PG_STORE_PORT_OFFSET = 2


class EndRecorder(StepHooks):
    """Keeps the run's outcome once it has ended (``StepHooks.finished``), for the life of the
    process: an in-process restart during the clean-up after the end returns it instead of
    training on."""

    def __init__(self) -> None:
        self.result: object | None = None

    def finished(self, result: object) -> None:
        self.result = result


class PingHooks(StepHooks):
    """Report forward progress to the wrapper's progress watchdog at a step boundary, at most
    once per ``interval_s``; nested under ft_launcher, also a heartbeat to the rank monitor (no
    sections: an in-process restart would leave one open). Each report is a message to another
    process (NVRx's monitor process; the rank monitor's socket, a round trip), so one per step
    cost a fast step's loop ~0.2 ms; the timeouts only need the newest.

    Checkpoint loads and blocking saves can take minutes on a big model (bytes / FSx
    throughput), longer than a soft timeout sized for a step: around them a thread keeps
    pinging, so the timeouts measure a hang, not I/O. It pings for at most
    ``io_budget_s`` (``resilience.checkpoint_section_timeout_s``, the in-job layer's budget for
    the same I/O), so that a checkpoint read stuck on a dead file system is still detected."""

    def __init__(
        self,
        call_wrapper,
        *,
        monitor=None,
        io_budget_s: float,
        interval_s: float,
        watchdog: CalibratedHangWatchdog | None = None,
    ):
        self.call_wrapper = call_wrapper
        self.monitor = monitor
        self.io_budget_s = io_budget_s
        self.interval_s = interval_s
        self.watchdog = watchdog
        self._between_steps = Throttle(every_s=interval_s)
        # Where the current wait of the checkpoint path began (a step's end, a section's entry
        # or exit): its keepalives stop ``io_budget_s`` later, like a section's pinger.
        self._waiting_since = time.monotonic()
        # The rank monitor's client is one socket with no lock of its own (a message, then its
        # reply: NVRx 0.4.1 ``rank_monitor_client.py`` ``_send_heartbeat_impl``); a section's
        # pinger thread and the main thread's keepalive may report at the same time.
        self._reporting = threading.Lock()

    def _report(self) -> None:
        with self._reporting:
            self.call_wrapper.ping()
            if self.monitor is not None:
                self.monitor.send_heartbeat()

    def keepalive(self) -> None:
        """Progress while the checkpoint manager waits outside a section (a pod-memory
        snapshot's publish, the peer exchange, the commit wait after the final save): NVRx's
        wrapper times out on its manual timestamp, which only ``ping`` moves
        (``progress_watchdog.py``: ``Timestamp.is_timed_out`` checks ``auto`` and ``manual``),
        and nested, the rank monitor on its heartbeat. For at most ``io_budget_s`` after the
        last step or section boundary, as the sections' pinger: a wait that outlasts it (a
        worker stuck on a dead file system) is a hang to the watchdog."""
        if time.monotonic() - self._waiting_since > self.io_budget_s:
            return
        if self._between_steps.due():
            self._report()

    def before_step(self, step: int) -> None:
        if self._between_steps.due():
            self._report()
        if self.watchdog is not None:
            self.watchdog.step_started()

    def after_step(self, step: int) -> None:
        self._waiting_since = time.monotonic()
        if self.watchdog is not None:
            self.watchdog.step_finished()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        done = threading.Event()

        def keep_reporting() -> None:
            deadline = time.monotonic() + self.io_budget_s
            while not done.wait(self.interval_s) and time.monotonic() < deadline:
                self._report()  # multiprocessing queue / socket: safe from a second thread

        self._report()
        self._waiting_since = time.monotonic()
        if self.watchdog is not None:
            self.watchdog.pause()
        pinger = threading.Thread(target=keep_reporting, name=f"ping-{name}", daemon=True)
        pinger.start()
        try:
            yield
        finally:
            done.set()
            pinger.join(timeout=self.interval_s + 1)
            if self.watchdog is not None:
                self.watchdog.resume()
            self._report()
            self._waiting_since = time.monotonic()  # the wait after it (the final commit) anew


def give_up_cause(
    err: BaseException, *, attempts: int, max_restarts: int, world_size: int
) -> tuple[int, str]:
    """Why NVRx's wrapper stopped restarting, and the exit code that fits.

    Its ``RetryController`` raises ``RestartAbort`` both at the restart cap and when the world
    has shrunk below ``min_world_size`` (we require the full world: the global batch, and so the
    result, must not change). The second is a rank that died or froze (NVRx's monitor process
    terminated it after the hard timeout): in-process restart cannot bring a rank back, but a
    replacement pod can, so that exit is retryable. The cap is not. Any other end of the
    wrapper (its ``InternalError``, a barrier timeout) is a fault too: retryable."""
    detail = f"{type(err).__name__}: {err}".strip()
    if type(err).__name__ == "RankDiscarded":  # this rank is the lost one (resumed, or late)
        # Worded like the survivors' cause below: every rank writes the verdict, and which
        # one writes last is a race (a survivor's launcher may stop it first).
        terminated = re.search(r"terminated_ranks=\{([^}]*)\}", str(err))
        lost = len([r for r in terminated.group(1).split(",") if r.strip()]) if terminated else 1
        return exits.FAILED, (
            f"{lost} of {world_size} rank(s) died or stopped responding (this one was frozen "
            f"past resilience.hard_timeout_s, and NVRx's in-process restart discarded it); "
            f"in-process restart cannot replace a lost rank, so the pod exits for a "
            f"replacement (or use --restart=nested). NVRx: {detail}"
        )
    shrunk = re.search(r"state\.world_size=(\d+)", str(err))
    left = int(shrunk.group(1)) if shrunk else world_size
    if left < world_size:
        lost = world_size - left
        return exits.FAILED, (
            f"{lost} of {world_size} rank(s) died or stopped responding (killed, or frozen past "
            f"resilience.hard_timeout_s) after {attempts} in-process restart(s); in-process "
            f"restart cannot replace a lost rank, so the pod exits for a replacement "
            f"(or use --restart=nested). NVRx: {detail}"
        )
    iteration = re.search(r"state\.iteration=(\d+) self\.max_iterations=(\d+)", str(err))
    if iteration and int(iteration.group(1)) >= int(iteration.group(2)):
        return exits.RESTARTS_EXHAUSTED, (
            f"in-process restart gave up after {max_restarts} restart(s) "
            f"(resilience.max_restarts): {detail}"
        )
    # Anything else (NVRx's InternalError, a barrier timeout, ...) is not the cap: a replacement
    # pod may succeed, so the exit stays retryable.
    return exits.FAILED, (
        f"NVRx's in-process restart stopped this rank after {attempts} restart(s); the pod "
        f"exits for a replacement. NVRx: {detail}"
    )


def store_ports() -> set[int]:
    master = int(os.environ.get("MASTER_PORT", "29500"))
    return {master, master + WRAPPER_PORT_OFFSET, master + PG_STORE_PORT_OFFSET}


def run_inprocess(config: JobConfig, *, nested: bool = False) -> int:
    """In-process restarts; with `nested`, inside ft_launcher (which respawns dead or frozen
    ranks and enforces the job-wide restart cap, see `training.resilience.injob`)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = int(os.environ.get("MASTER_PORT", "29500"))
    events = EventLog(run_dir=Path(config.run_dir), rank=rank)
    r = config.resilience
    monitor = rank_monitor_client() if nested else None
    if nested:  # a fresh process of the in-job layer (see run_injob)
        attempt = attempt_number()
        emit_phase(
            events, phase=RENDEZVOUS_DONE, attempt=attempt, mode="nested", at=process_start_time()
        )
        emit_phase(events, phase=PROCESSES_UP, attempt=attempt, mode="nested")
    if monitor is not None and rank == 0:
        code = check_attempt(config, client=monitor, events=events)
        if code is not None:
            monitor.shutdown_workload_monitoring()
            return code
    store_timeout = datetime.timedelta(seconds=300)
    if rank != 0:  # rank 0 hosts it: connect once it listens, not after TCPStore's backoff
        await_rank0_store(
            host=master_addr,
            port=master_port + PG_STORE_PORT_OFFSET,
            timeout_s=store_timeout.total_seconds(),
        )
    base_store = dist.TCPStore(
        host_name=master_addr,
        port=master_port + PG_STORE_PORT_OFFSET,
        world_size=world_size,
        is_master=rank == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
        timeout=store_timeout,
    )
    restart_started: list[float] = []
    ended = EndRecorder()

    def train(
        call_wrapper=None,
    ):  # annotated for NVRx in training.resilience.nvrx.inprocess_wrapper
        iteration = call_wrapper.iteration if call_wrapper is not None else 0
        if ended.result is not None:
            # A restart struck during the clean-up after the run's end (its final checkpoint
            # committed): the outcome stands; training on would lose an eviction or a drain.
            release_leftovers()
            return ended.result
        release_leftovers()  # whatever the previous iteration's interrupted clean-up left
        if iteration > 0:
            seconds = time.time() - restart_started[-1] if restart_started else None
            events.emit("restart_end", mode="inprocess", attempt=iteration, seconds=seconds)
            # The wrapper aborted, health-checked and passed its rank-assignment barrier (its
            # rendezvous); the same processes go on.
            emit_phase(events, phase=RENDEZVOUS_DONE, attempt=iteration, mode="inprocess")
        current_rank = int(os.environ["RANK"])
        current_world = int(os.environ["WORLD_SIZE"])
        store = dist.PrefixStore(f"pg_{iteration}", base_store)
        watchdog = None
        if r.calibrate_timeouts_after:

            def detected(timeout: float, waited: float) -> None:
                events.emit(
                    "hang_detected",
                    mode="inprocess",
                    attempt=iteration,
                    timeout_s=round(timeout, 3),
                    waited_s=round(waited, 3),
                )

            watchdog = CalibratedHangWatchdog(
                calibrate_after=r.calibrate_timeouts_after,
                floor_s=r.hang_floor_s,
                # From the watchdog's thread: the main thread may be stuck in C++ (a kernel,
                # an NCCL collective) where nothing raised in it would land.
                interrupt=partial(report_hang, call_wrapper, rank=current_rank),
                on_detect=detected,
            )
        try:
            return run_training(
                config,
                hooks=step_hooks_for(
                    config,
                    layer=HookChain(
                        [
                            PingHooks(
                                call_wrapper,
                                monitor=monitor,
                                io_budget_s=r.checkpoint_section_timeout_s,
                                # The soft timeout is the shorter of the two it reports to
                                # (ft_launcher's heartbeat timeout outlasts soft + hard when
                                # nested: training/command.py).
                                interval_s=liveness_report_interval_s(r.soft_timeout_s),
                                watchdog=watchdog,
                            ),
                            ended,
                        ]
                    ),
                ),
                attempt=iteration,
                store=store,
                rank=current_rank,
                world_size=current_world,
            )
        except BaseException as err:
            restart_started.append(time.time())
            events.emit(
                "restart_begin",
                mode="inprocess",
                attempt=iteration,
                error=f"{type(err).__name__}: {err}"[:300],
            )
            # An exception, or NVRx's monitor interrupting a hang: the wrapper takes over.
            emit_phase(events, phase=DETECTED, attempt=iteration + 1, mode="inprocess")
            events.flush()  # the wrapper may terminate this rank next (a failed health check)
            raise
        finally:
            if watchdog is not None:
                watchdog.close()

    wrapped = inprocess_wrapper(
        train,
        max_restarts=r.max_restarts,
        world_size=world_size,
        soft_timeout_s=r.soft_timeout_s,
        hard_timeout_s=r.hard_timeout_s,
        keep_ports=store_ports(),
        wrapper_port=master_port + WRAPPER_PORT_OFFSET,
        cuda=torch.cuda.is_available() and config.parallel.device != "cpu",
    )
    try:
        result = wrapped()
    except BaseException as err:  # RestartAbort is a BaseException
        code, cause = give_up_cause(
            err, attempts=len(restart_started), max_restarts=r.max_restarts, world_size=world_size
        )
        if nested:
            # The in-job layer takes over: ft_launcher respawns the worker group.
            print(f"error: {cause}; handing over to the in-job restart", file=sys.stderr)
            return exits.FAILED
        # Any surviving rank records it (rank 0 may be the one that was lost).
        events.emit("run_end", status="failed", cause=cause[:500])
        write_verdict(
            run_dir=Path(config.run_dir), code=code, cause=cause[:500], run_id=current_run_id()
        )
        print(f"error: {cause}", file=sys.stderr, flush=True)
        return code
    else:
        if monitor is not None and result is not None:
            leave_if_evicted(monitor, result)
    finally:
        if monitor is not None:
            monitor.shutdown_workload_monitoring()
    if result is None:  # an inactive (spare) rank
        return exits.OK
    return result.exit_code
