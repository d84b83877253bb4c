"""Hang detection calibrated from the observed step times, for in-process restart.

NVRx's in-process ``Wrapper`` takes one fixed ``soft_timeout`` at construction, sized for the
worst step a job may ever take (recipes: 120 s on GPU). The in-job layer already calibrates its
own timeouts (NVRx's ``calculate_and_set_section_timeouts``: observed maxima times a safety
factor); this is the equivalent for the in-process layer. After ``calibrate_after`` steps of the
current attempt, a rank that has not reached a step boundary for

    timeout = max(floor_s - 2 x poll_s, factor x p99 of the observed step times)

is reported to NVRx as interrupted (``interrupt``: the trainer records a soft-timeout
interruption for this rank in the wrapper's store, training/resilience/nvrx.py), from this
watchdog's own thread. ``floor_s`` is the detection deadline at the floor: the watchdog checks
every ``poll_s``, and the report takes about as long again to reach the wrapper, so its least
timeout is twice that shorter. What follows is NVRx's own path for any fault: every rank's
monitor thread aborts its process groups (NCCL's abort on a GPU, which ends the collectives
that hold the ranks in C++; the peer sockets on gloo) and raises ``RankShouldRestart`` in its
main thread, and every rank restarts in place.

The report never needs the main thread: on a GPU a hung rank sits in C++ (``.item()``, a
stream synchronize behind a stuck kernel or NCCL collective), where no Python signal handler
or asynchronous exception runs until the call returns. A rank whose main thread is inside
torch.distributed (blocked in a collective on gloo) does not report itself: it waits for the
hung peer, whose report reaches it through the abort. A rank stuck in a kernel that never
ends is released by NVRx's hard timeout (its monitor process ends the rank), as before.
Margins: the count restarts with each attempt (the first steps after a restart re-warm caches
and allocators), and checkpoint I/O is excluded (``pause``/``resume`` around it; it has its
own budget).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


WINDOW = 1000
"""Step times the calibration looks at: the newest ones."""
RECALIBRATE_EVERY = 16
"""Steps between two recalibrations (a p99 sorts the window: ~40 us a step here, a sixth of the
fast goodput steps' time between steps); a step slow enough to need a longer timeout
recalibrates at once, so the timeout only lags when it could shrink."""


def calibrated_timeout(step_times: list[float], *, floor_s: float, factor: float) -> float:
    """max(floor_s, factor x the 99th percentile (nearest rank) of `step_times`)."""
    return max(floor_s, factor * p99(step_times))


class CalibratedHangWatchdog:
    """Call ``step_started``/``step_finished`` around each step; ``pause``/``resume`` around
    checkpoint I/O; ``close`` at the end of the attempt. ``interrupt`` is called once per
    hung step, from the watchdog's thread."""

    def __init__(
        self,
        *,
        calibrate_after: int,
        floor_s: float,
        interrupt: Callable[[], None],
        factor: float = 5.0,
        on_detect: Callable[[float, float], None] = lambda timeout, waited: None,
        poll_s: float = 0.05,
    ) -> None:
        self.calibrate_after = calibrate_after
        self.floor_s = floor_s
        self.factor = factor
        self.thread_id = threading.main_thread().ident
        self.interrupt = interrupt
        self.on_detect = on_detect
        self.poll_s = poll_s
        self.step_times: deque[float] = deque(maxlen=WINDOW)
        self.steps = 0
        self.timeout_s: float | None = None
        self._started: float | None = None
        self._paused = 0
        self._fired = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        if calibrate_after > 0:
            self._thread.start()

    def step_started(self) -> None:
        with self._lock:
            self._started = time.monotonic()
            self._fired = False

    def step_finished(self) -> None:
        with self._lock:
            if self._started is None:
                return
            elapsed = time.monotonic() - self._started
            self.step_times.append(elapsed)
            self.steps += 1
            self._started = None
            if self.steps < self.calibrate_after:
                return
            due = self.timeout_s is None or self.steps % RECALIBRATE_EVERY == 0
            if due or self.factor * elapsed > self.timeout_s:
                self.timeout_s = calibrated_timeout(
                    list(self.step_times),
                    floor_s=self.floor_s - 2 * self.poll_s,
                    factor=self.factor,
                )

    def pause(self) -> None:
        with self._lock:
            self._paused += 1

    def resume(self) -> None:
        with self._lock:
            self._paused -= 1
            if self._started is not None:
                self._started = time.monotonic()  # the I/O is not part of the step's budget

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)

    def _in_a_collective(self) -> bool:
        """The watched thread is inside torch.distributed (blocked in a collective on gloo):
        it waits for the hung peer, whose report reaches it through the abort."""
        frame = sys._current_frames().get(self.thread_id)
        return frame is not None and "/torch/distributed/" in frame.f_code.co_filename

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            with self._lock:
                if self._fired or self._paused or self._started is None or not self.timeout_s:
                    continue
                waited = time.monotonic() - self._started
                if waited <= self.timeout_s or self._in_a_collective():
                    continue
                self._fired = True
                timeout = self.timeout_s
            log.warning("no step boundary for %.1f s (timeout %.1f s)", waited, timeout)
            self.on_detect(timeout, waited)
            try:
                self.interrupt()
            except Exception:  # the wrapper's soft timeout stays the backstop
                log.exception("reporting the hang to NVRx failed")
