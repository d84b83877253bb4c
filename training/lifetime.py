"""Tie a helper process's life to the process that started it (Linux ``PR_SET_PDEATHSIG``).

Standard library only, on purpose: helpers started with the ``spawn`` method import this module
to run :func:`die_with_parent` first thing, and importing torch there would cost every rank
seconds of CPU at start-up, on the critical path of every restart. Modules a helper will need
later are imported in a background thread instead (``preload``).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, preload: tuple[str, ...] = ()) -> None:
    """Run first thing in a helper process: get SIGKILL when the parent dies (also when it is
    SIGKILLed itself, which no exit handler sees), and exit at once if it is already gone.
    ``preload``: modules to import in a daemon thread, so that the helper's first real request
    does not wait for them (a request that needs one meanwhile waits on its import lock)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(0)
    if preload:
        threading.Thread(
            target=lambda: [importlib.import_module(name) for name in preload],
            name="preload",
            daemon=True,
        ).start()
