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
from collections.abc import Iterator
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1
# What a launcher's ``killpg`` sends (see :func:`die_with_parent`); what a helper ignores.
HELPER_IGNORED_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


@contextmanager
def spawning_helper() -> Iterator[None]:
    """Start helper processes inside this: SIGTERM and SIGINT are blocked in the calling thread
    meanwhile, and a spawned child inherits that mask (fork and exec keep it), so a launcher's
    ``killpg`` during the child's start-up (seconds, importing torch) stays pending in it until
    :func:`die_with_parent` ignores them, instead of killing a writer the rank's final save
    will need. CPython's resource tracker starts its helper the same way
    (``multiprocessing/resource_tracker.py``, ``_IGNORED_SIGNALS``). A signal sent to this
    process meanwhile is delivered when the block ends: nothing is lost."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELPER_IGNORED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def die_with_parent(parent_pid: int) -> None:
    """Run first thing in a helper process: get SIGKILL when the parent dies (also when it is
    SIGKILLed itself, which no exit handler sees), and exit at once if it is already gone.

    The helper also ignores SIGTERM and SIGINT. A launcher stops a rank by signalling its whole
    process group (torch elastic's ``SubprocessHandler.close`` calls ``os.killpg``; a terminal's
    Ctrl-C does the same), which would kill the checkpoint writer in the middle of the rank's
    final save on a drain. The rank decides when its helpers stop."""
    for signum in HELPER_IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)  # also drops one left pending by spawning_helper
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELPER_IGNORED_SIGNALS)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(0)
