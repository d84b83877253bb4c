"""Hang detection calibrated from the observed step times, for in-process restart.

NVRx's in-process ``Wrapper`` takes one fixed ``soft_timeout`` at construction, sized for the
worst step a job may ever take (recipes: 120 s on GPU). The in-job layer already calibrates its
own timeouts (NVRx's ``calculate_and_set_section_timeouts``: observed maxima times a safety
factor); this is the equivalent for the in-process layer. After ``calibrate_after`` steps of the
current attempt, a rank that has not reached a step boundary for

    timeout = max(floor_s - 2 x poll_s, factor x p99 of the observed step times)

raises :class:`HangDetected` in its main thread (``floor_s`` is the detection deadline at the
floor: the watchdog checks every ``poll_s``, and the exception takes as long again to reach the
wrapper, so its least timeout is twice that shorter; measured at one poll: 1.96-2.001 s), which
the wrapper treats like any fault: it records the interruption in its store, the peers'
monitor threads abort their process groups (which frees ranks blocked in a collective) and
every rank restarts in place. A rank whose main thread is inside torch.distributed (blocked
in a collective) does not raise: the hung peer's exception reaches it through that abort.
Margins: the count restarts with each attempt (the first steps after a restart re-warm caches
and allocators), checkpoint I/O is excluded (``pause``/``resume`` around it; it has its own
budget), and NVRx's fixed soft timeout stays as the backstop for a rank stuck inside one C
call that never checks for signals.

The exception arrives through SIGUSR2, whose handler raises it: the way KeyboardInterrupt
reaches Python code, also inside ``time.sleep`` and other C calls that check for signals.
``PyThreadState_SetAsyncExc`` was tried first: it can land inside NVRx's progress-watchdog
callback (run in the main thread through ``Py_AddPendingCall``), where ctypes drops it, or
surface as ``SystemError: error return without exception set``.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


HANG_SIGNAL = signal.SIGUSR2


class HangDetected(RuntimeError):
    """No step boundary within the calibrated timeout."""


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
    checkpoint I/O; ``close`` at the end of the attempt."""

    def __init__(
        self,
        *,
        calibrate_after: int,
        floor_s: float,
        factor: float = 5.0,
        on_detect: Callable[[float, float], None] = lambda timeout, waited: None,
        poll_s: float = 0.05,
        repeat_s: float = 0.5,
    ) -> None:
        """Create in the main thread (it installs the SIGUSR2 handler there)."""
        self.calibrate_after = calibrate_after
        self.floor_s = floor_s
        self.factor = factor
        self.thread_id = threading.main_thread().ident
        self.on_detect = on_detect
        self.poll_s = poll_s
        self.repeat_s = repeat_s
        self.step_times: deque[float] = deque(maxlen=WINDOW)
        self.steps = 0
        self.timeout_s: float | None = None
        self._started: float | None = None
        self._paused = 0
        self._fired = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._previous_handler = None
        if calibrate_after > 0:
            self._previous_handler = signal.signal(HANG_SIGNAL, self._raise)
            self._thread.start()

    def _raise(self, signum: int, frame: object) -> None:
        # An exception already on its way out (this rank's fault, or NVRx's RankShouldRestart
        # after a peer's) must not be replaced: NVRx's wrapper consumes RankShouldRestart once,
        # and a HangDetected in its place makes the wrapper end this rank with InternalError.
        # The handler runs in the main thread, so sys.exc_info() is the exception it is
        # handling, also in the `finally` blocks and `__exit__`s it unwinds through.
        if sys.exc_info()[1] is not None:
            return
        if self._fired and not self._closed.is_set():  # ours, for this attempt
            raise HangDetected(f"no step boundary within {self.timeout_s:.1f} s (calibrated)")

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
        if self._previous_handler is not None:
            signal.signal(HANG_SIGNAL, self._previous_handler)
            self._previous_handler = None

    def _in_a_collective(self) -> bool:
        """The watched thread is inside torch.distributed (blocked in a collective, in C): an
        asynchronous exception cannot land there; the hung peer's own exception reaches this
        rank through the wrapper's abort instead."""
        frame = sys._current_frames().get(self.thread_id)
        return frame is not None and "/torch/distributed/" in frame.f_code.co_filename

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            with self._lock:
                if self._paused or self._started is None or not self.timeout_s:
                    continue
                waited = time.monotonic() - self._started
                if waited <= self.timeout_s or self._in_a_collective():
                    continue
                first = not self._fired
                self._fired = True
                timeout = self.timeout_s
            if first:
                log.warning("no step boundary for %.1f s (timeout %.1f s)", waited, timeout)
                self.on_detect(timeout, waited)
            # Again until the attempt ends (close) or a step boundary is reached, in case the
            # first one met code that swallows exceptions.
            os.kill(os.getpid(), HANG_SIGNAL)
            # Waiting on `_closed`, not sleeping: `close` (the attempt's end, on the restart's
            # critical path) must not wait out the repeat interval.
            if self._closed.wait(self.repeat_s):
                return
