"""Rank 0's commits and retention, in order, on a thread of their own.

Once every rank's files are durable (the manager's barrier), what is left of an asynchronous
save is rank 0's alone: read every rank's manifest, write and fsync the commit record, delete
the checkpoints retention no longer keeps. In the training loop that stalled every rank at
the next collective: 4-12 ms for the commit and 12-18 ms for one retention ``rmtree`` of a
2-rank checkpoint on this machine's disk; on FSx with thousands of ranks it is one manifest
read per rank and one unlink per shard file, seconds. Nothing about it needs the main thread:
the files are durable, and a process that dies before the record is written leaves a torn
checkpoint, which is never loaded and is swept at the next start, as a death mid-commit did.

Jobs run in submission order (a commit and then its retention, so the newest committed step
is never a victim). A job's exception is kept and raised in the main thread at the next
``submit``, ``drain`` or ``raise_if_failed``, where it is a fault like any other.

Across in-process restarts: a fault can interrupt :meth:`Committer.close` before its join (NVRx
raises asynchronously into the main thread), leaving the thread committing while the next
attempt sweeps uncommitted step directories: a commit record written into a directory being
deleted vouches for missing files. So every committer thread is remembered until it is joined,
and a new committer (one per attempt's checkpoint manager, made before that sweep) first waits
for the threads an earlier attempt left (:func:`finish_leftover_commits`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

POLL_S = 0.05
"""The longest pause between two ``keepalive`` calls of :meth:`Committer.drain`."""


_RUNNING: list[threading.Thread] = []
"""Committer threads started and not yet joined (any attempt of this process)."""


def finish_leftover_commits() -> None:
    """Wait for the commit threads an interrupted clean-up left running (their jobs are commits
    of durable files and their retention: worth finishing, and each ends after its queue's
    stop entry). Joined without a bound, as :meth:`Committer.close` joins."""
    for thread in list(_RUNNING):
        thread.join()
        with contextlib.suppress(ValueError):
            _RUNNING.remove(thread)


class Committer:
    def __init__(self) -> None:
        finish_leftover_commits()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.raise_if_failed()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ckpt-commit", daemon=True)
            _RUNNING.append(self._thread)
            self._thread.start()
        self._jobs.put(job)

    def drain(self, *, keepalive: Callable[[], None] = lambda: None) -> None:
        """Wait until every submitted job has run, calling ``keepalive`` every ``POLL_S``
        meanwhile (a commit on a busy file system takes seconds); raise the first failure."""
        if self._thread is not None:
            done = self._jobs.all_tasks_done  # ``Queue.join``'s own condition, with a timeout
            while True:
                with done:
                    if not self._jobs.unfinished_tasks:
                        break
                    done.wait(timeout=POLL_S)
                keepalive()  # outside the queue's lock: the thread may finish a job meanwhile
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Run what was submitted, then stop the thread. Raises nothing: also called after a
        fault, where a commit of durable files is still worth finishing and its failure is not
        this attempt's news. Joined without a bound, like the commit in the loop was: the next
        attempt's sweep of torn checkpoints must not race a commit still writing its record."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join()
        with contextlib.suppress(ValueError):
            _RUNNING.remove(self._thread)
        self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except BaseException as err:  # kept for the main thread
                if self._error is None:
                    self._error = err
            finally:
                self._jobs.task_done()
