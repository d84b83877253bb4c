"""Tie a helper process's life to the process that started it (Linux ``PR_SET_PDEATHSIG``).

Standard library only, on purpose: a helper started with the ``spawn`` method imports this
module to run :func:`die_with_parent` first thing, and importing torch there would cost every
rank seconds of CPU at start-up, on the critical path of every restart.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Run first thing in a helper process: get SIGKILL when the parent dies (also when it is
    SIGKILLed itself, which no exit handler sees), and exit at once if it is already gone.

    The helper also ignores SIGTERM and SIGINT. A launcher stops a rank by signalling its whole
    process group (torch elastic's ``SubprocessHandler.close`` calls ``os.killpg``; a terminal's
    Ctrl-C does the same), which would kill the checkpoint writer in the middle of the rank's
    final save on a drain. The rank decides when its helpers stop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(0)
