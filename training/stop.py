"""A stop request (SIGTERM) that a rank honours within seconds, even when it is blocked.

Who sends SIGTERM to a rank: the kubelet on a drain or eviction (through the pod supervisor and
the launcher), and the launcher itself when it stops a node's workers for a restart because a
peer failed. A healthy rank finishes its step, takes a final checkpoint at the same step as every
other rank (the loop all-reduces the flag) and exits 143. A rank blocked in a collective with a
dead or frozen peer never reaches the end of its step: Python runs signal handlers only between
bytecodes of the main thread, so the flag alone would wait for the collective's timeout (gloo:
the process group timeout; NCCL: its watchdog), and the launcher would SIGKILL the rank after
``--workers-stop-timeout``.

So the signal also reaches a watcher thread through ``signal.set_wakeup_fd`` (the C-level
handler writes to the pipe at once, whatever the main thread is doing). The watcher gives the
loop ``grace_s()`` to reach the next step boundary, where it starts the final checkpoint
(:meth:`StopRequest.saving`), counted from the signal or from the rank's latest sign of progress
(:func:`progress`), whichever is later; if the loop has not got there, the rank has made no
progress worth saving since, and the watcher exits the process with 143 (``os._exit``: the
main thread is stuck, so nothing that needs it can run).

Progress is what a rank blocked in a collective cannot show: a step finished, the work between
two steps finished (the trainer marks both), and each pass of a checkpoint wait that the rank
checks itself (the checkpoint manager's ``keepalive``: the NVRx worker's start, an earlier
save's write, a snapshot's publish): a SIGTERM during a save slower than the grace (the first
save of an attempt waits seconds for its writer's start on a busy node) must not end a healthy
rank short of the boundary it is about to reach, or the drain loses the steps since the last
checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from training import exits

log = logging.getLogger(__name__)

_installed: StopRequest | None = None
"""The stop request installed in this process (SIGTERM has one handler per process)."""


def progress() -> None:
    """This process's training thread made progress that it checked (a pass of a checkpoint
    wait, a step or the work between two steps finished): the installed stop request's grace
    runs from now. A no-op when none is installed."""
    request = _installed
    if request is not None:
        request.progress()


def reporting_progress(keepalive: Callable[[], None]) -> Callable[[], None]:
    """``keepalive`` that also reports :func:`progress`: a wait that checks its progress pass
    by pass (a checkpoint's) is not a rank blocked in a collective, and a SIGTERM during it (the
    first save waits for the NVRx worker's start, seconds on a busy node) must not cost the
    drain its final checkpoint."""

    def beat() -> None:
        keepalive()
        progress()

    return beat


class StopRequest:
    """Install with ``with StopRequest(grace_s=...) as stop:``; ``stop.requested`` is the flag."""

    def __init__(
        self,
        *,
        grace_s: Callable[[], float],
        on_signal: Callable[[], None] = lambda: None,
        on_forced_exit: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_signal` and `on_forced_exit` run on the watcher thread (record restart phases)."""
        self._grace_s = grace_s
        self._on_signal = on_signal
        self._on_forced_exit = on_forced_exit
        self._event = threading.Event()
        self._saving = threading.Event()
        self._done = threading.Event()
        self._previous_handler = None
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None
        self._progress_at = float("-inf")
        """``time.monotonic()`` of the latest :meth:`progress`."""

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def saving(self) -> None:
        """The loop reached a step boundary and starts its final checkpoint: no deadline now
        (the pod's grace period bounds the save)."""
        self._saving.set()

    def progress(self) -> None:
        """The loop made progress (see the module's docstring): after a SIGTERM, the grace to
        the next step boundary runs from now."""
        self._progress_at = time.monotonic()

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def install(self) -> None:
        """Take over SIGTERM (the previous handler and wakeup fd come back on uninstall)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals are delivered to the main thread only; nothing to install
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous_handler = signal.signal(signal.SIGTERM, lambda *_: self._event.set())
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="stop-request", daemon=True)
        self._watcher.start()
        global _installed
        _installed = self

    def uninstall(self) -> None:
        if self._pipe is None:
            return
        global _installed
        if _installed is self:
            _installed = None
        self._done.set()
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGTERM, self._previous_handler)
        read_fd, write_fd = self._pipe
        with contextlib.suppress(OSError):
            os.write(write_fd, b"\0")  # wake the watcher so that it sees _done
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        os.close(read_fd)
        os.close(write_fd)
        self._pipe = None

    def _watch(self) -> None:
        assert self._pipe is not None
        read_fd = self._pipe[0]
        while not self._done.is_set():
            try:
                received = os.read(read_fd, 64)
            except OSError:
                return
            if self._done.is_set():
                return
            if signal.SIGTERM in received:
                self._event.set()
                self._call(self._on_signal)
                self._enforce()
                return

    @staticmethod
    def _call(callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:  # a record must never stop the stop
            log.exception("stop-request callback failed")

    def _enforce(self) -> None:
        signalled = time.monotonic()
        while True:
            if self._saving.is_set() or self._done.is_set():
                return
            # Read at every pass: the latest progress, and the grace as the loop measures it.
            grace = self._grace_s()
            if time.monotonic() >= max(signalled, self._progress_at) + grace:
                break
            time.sleep(0.05)
        if self._saving.is_set() or self._done.is_set():
            return
        message = (
            f"SIGTERM: no step boundary within {grace:.1f} s of the signal or of the rank's last "
            f"progress (blocked in a collective or I/O); exiting {exits.PREEMPTED} without a "
            "final checkpoint"
        )
        log.warning(message)
        print(message, file=sys.stderr, flush=True)
        self._call(self._on_forced_exit)
        os._exit(exits.PREEMPTED)
