"""JSONL appends off the training thread: one buffered writer per process.

Before, every step rank 0 opened, appended to and closed ``metrics.jsonl`` on FSx (Lustre),
and every rank appended to the one ``events.jsonl``, on the training thread: two metadata RPCs
and an O_APPEND whole-file lock per line, while the other ranks waited at the next collective
(shared/reviews/checkpoint-tiers.md, "8. Per-step hot path").

Now a line is encoded on the caller's thread (the record may be mutated afterwards) and queued;
a daemon thread appends whatever is queued every ``FLUSH_INTERVAL_S``: one ``open``, one
``write`` of whole lines with ``O_APPEND`` and one ``close`` per file per flush, so the lines of
concurrent processes still never interleave (a ``write`` to a regular file holds the inode's
lock on Linux; Lustre takes its whole-file lock for O_APPEND) and one process's lines keep
their order. The file is reopened at every flush rather than kept open: a run directory that is
removed and made again (benchmarks, tests) gets its lines, at one open per second, not per step.

What a crash can lose: the lines queued since the last flush, at most ``FLUSH_INTERVAL_S`` plus
one write's time. Every path that can run code flushes first: a clean end and an uncaught
exception (``atexit``), SIGTERM (the loop's final checkpoint and ``run_end``, then a normal
exit; a forced exit flushes before ``os._exit``: ``training.trainer``), an in-process restart
(``training.resilience.inprocess`` flushes at ``restart_begin``), an injected fault
(``training.resilience.inject`` flushes before it fires). Only SIGKILL (and a frozen node) skips
them: up to the last ``FLUSH_INTERVAL_S`` of lines. A commit's event is flushed when it is
emitted (``training.checkpoint.manager``): it names a durable fact. Standard library only.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

FLUSH_INTERVAL_S = 0.5
"""Longest a queued line waits for its write (half the one-second loss budget, so a slow
write on a loaded file system still keeps lines older than a second safe)."""


def encode_line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def write_lines(path: Path, data: bytes) -> None:
    """Append whole lines with one O_APPEND ``write`` (looping only on a short write)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


class BufferedAppender:
    """Queues lines per file; a daemon thread (started at the first line) writes them."""

    def __init__(self, *, interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._queue: deque[tuple[Path, bytes]] = deque()  # append/popleft are thread-safe
        self._write_lock = threading.Lock()  # one flush at a time: a process's lines in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.dropped = 0
        """Lines a failed write lost (a warning on stderr says which file and why)."""

    def append(self, path: Path, record: dict[str, Any]) -> None:
        self._queue.append((path, encode_line(record)))
        if self._thread is None:
            self._start()

    def pending(self) -> int:
        return len(self._queue)

    def flush(self) -> None:
        """Write every line queued so far, on the caller's thread (waits for a flush under way
        on the writer thread, so the lines stay in order)."""
        with self._write_lock:
            batches: dict[Path, list[bytes]] = {}
            while True:
                try:
                    path, line = self._queue.popleft()
                except IndexError:
                    break
                batches.setdefault(path, []).append(line)
            for path, lines in batches.items():
                try:
                    write_lines(path, b"".join(lines))
                except OSError as err:  # the run goes on; its log says what was lost
                    self.dropped += len(lines)
                    print(
                        f"warning: runlog: {len(lines)} line(s) for {path} not written: {err}",
                        file=sys.stderr,
                        flush=True,
                    )

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self.flush()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="runlog-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()


_appender: BufferedAppender | None = None
_appender_lock = threading.Lock()


def appender() -> BufferedAppender:
    """This process's writer (made at first use; flushed at exit)."""
    global _appender
    if _appender is None:
        with _appender_lock:
            if _appender is None:
                _appender = BufferedAppender()
                atexit.register(_appender.close)
    return _appender


def flush() -> None:
    """Write every queued line of this process now (before ``os._exit``, a fault, a restart)."""
    if _appender is not None:
        _appender.flush()


def _forget_in_child() -> None:
    # A forked child (a checkpoint worker) has a copy of the parent's queue and no writer
    # thread: its lines are the parent's to write, so it starts empty.
    # Its copy of the parent's writer may be mid-flush (a held lock): never used again.
    global _appender, _appender_lock
    if _appender is not None:
        atexit.unregister(_appender.close)
    _appender = None
    _appender_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
