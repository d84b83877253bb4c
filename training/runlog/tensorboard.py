"""TensorBoard scalars of a run directory: step metrics, checkpoint stalls and restarts.

    python -m training.runlog.tensorboard runs/local   # convert a finished run (rewrites scalars)
    tensorboard --logdir /fsx/runs                      # every run's <run_dir>/tensorboard/

During training, rank 0 runs a `Tailer` (``start_tailer``, called from ``training/run.py``): a
daemon thread that reads the new lines of ``metrics.jsonl`` and ``events.jsonl`` every 5
seconds and writes them as scalars into ``<run_dir>/tensorboard/``, and flushes at exit. The JSONL
files stay the source of truth; this is a view of them.

Scalars (global step in brackets):

- ``train/{loss,lr,step_time_s,tokens_per_s,mfu,attempt}`` [the step]: one per metrics line; the
  steps repeated after a restart are written again (TensorBoard keeps the later ones).
- ``checkpoint/blocking_s`` [checkpoint step]: the slowest rank's ``checkpoint_staged`` stall;
  ``checkpoint/write_s`` [checkpoint step]: the slowest ``checkpoint_committed`` write;
  ``checkpoint/memory_snapshot_s`` [snapshot step]: the slowest rank's ``memory_snapshot``
  stall (the snapshots restarts restore: ``training/checkpoint/pod_memory.py``);
- ``restore/<source>_s`` and ``restore/<source>_bytes`` [restart number]: where each restart
  restored from (``training/checkpoint/tiers.py``: memory, pod_memory, peer, local, storage),
  the slowest rank's load time and the bytes all ranks restored.
- ``restart/{downtime_s,recompute_s,lost_s}`` and ``restart_phase/<phase>_s`` [the restart's
  number, 1-based, as in the report]: one per incident, once the first step after it is done
  (``training.runlog.accounting`` defines them); ``startup_phase/<phase>_s`` [0].
- ``straggler/rank_<rank>`` and ``straggler/node/<node>`` [the report's step]: each rank's and
  each node's relative performance score (``straggler_report``, training/resilience/straggler.py);
  ``straggler/evicted`` [the step]: 1 for each eviction.
- ``replica/quorum_participants`` and ``replica/quorum_wait_s`` [the step] (group rank 0's),
  ``replica/stall_s`` (the slowest rank's), ``replica/heal_s`` (the slowest rank's),
  ``replica/heal_bytes`` (all ranks') and ``replica/step_discarded`` (1 each) [the step], from
  a replica group's events (``training/runlog/replica.py``; each group has its run directory).
- ``run/ettr`` [the last step]: when the tailer closes.

Optional: without the ``tensorboard`` package (``pip install '.[tensorboard]'``) the tailer prints
one line and does nothing. ``TRAINING_TENSORBOARD=0`` turns it off. A new rank-0 process (in-job
restart) resumes where the previous one stopped, from ``tensorboard/.tailer_state.json``.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from training.runlog.accounting import RunDirError, RunSummary, summarize
from training.runlog.files import EVENTS_FILE, METRICS_FILE, parse_jsonl
from training.runlog.replica import DISCARDED, HEAL, QUORUM, STALL
from training.runlog.replica import KINDS as REPLICA_KINDS
from training.runlog.report import run_dir_main

TB_SUBDIR = "tensorboard"
STATE_FILE = ".tailer_state.json"
DISABLE_ENV = "TRAINING_TENSORBOARD"  # "0": no tailer

# metrics.jsonl field -> scalar tag.
STEP_FIELDS: dict[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "step_time_s": "train/step_time_s",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "attempt": "train/attempt",
}
# Events that change what `summarize` says about restarts.
_RESTART_KINDS = frozenset(
    {"fault", "restart_begin", "restart_end", "attempt_start", "restart_phase"}
)


@dataclass(frozen=True)
class Scalar:
    """One value for ``SummaryWriter.add_scalar``."""

    tag: str
    value: float
    step: int
    walltime: float


class _Writer(Protocol):
    def add_scalar(
        self, tag: str, scalar_value: float, global_step: int, walltime: float
    ) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


def tensorboard_installed() -> bool:
    """Whether the ``tensorboard`` package can be imported (cheap: no import)."""
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        return False


def summary_writer_class() -> Callable[..., _Writer] | None:
    """torch's ``SummaryWriter``, or None when it cannot be imported (no tensorboard package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch raises ImportError when tensorboard is missing
        return None
    return SummaryWriter


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def step_scalars(record: dict[str, Any]) -> list[Scalar]:
    """The scalars of one metrics.jsonl line (none when it has no step or time)."""
    step, t = record.get("step"), _num(record.get("time"))
    if not isinstance(step, int) or t is None:
        return []
    return [
        Scalar(tag=tag, value=v, step=step, walltime=t)
        for name, tag in STEP_FIELDS.items()
        if (v := _num(record.get(name))) is not None
    ]


def restart_scalars(summary: RunSummary, *, index: int) -> list[Scalar]:
    """The scalars of restart number ``index + 1`` of the summary."""
    r = summary.restarts[index]
    n, t = index + 1, summary.start_time + r.begin_s
    out = [
        Scalar(tag="restart/downtime_s", value=r.downtime_s, step=n, walltime=t),
        Scalar(tag="restart/recompute_s", value=r.recompute_s, step=n, walltime=t),
        Scalar(tag="restart/lost_s", value=r.lost_s, step=n, walltime=t),
    ]
    if r.restore_source is not None:
        # One tag per tier (restore/<source>_s, restore/<source>_bytes): the source is in the
        # name, so TensorBoard plots each tier's restores as its own series.
        source = r.restore_source
        if r.restore_s is not None:
            out.append(Scalar(tag=f"restore/{source}_s", value=r.restore_s, step=n, walltime=t))
        if r.restore_bytes is not None:
            out.append(
                Scalar(
                    tag=f"restore/{source}_bytes",
                    value=float(r.restore_bytes),
                    step=n,
                    walltime=t,
                )
            )
    out += [
        Scalar(
            tag=f"restart_phase/{m.phase}_s", value=m.duration_s, step=n, walltime=t + m.offset_s
        )
        for m in r.phases
    ]
    return out


def startup_scalars(summary: RunSummary) -> list[Scalar]:
    t = summary.start_time
    return [
        Scalar(
            tag=f"startup_phase/{m.phase}_s", value=m.duration_s, step=0, walltime=t + m.offset_s
        )
        for m in summary.startup_phases
    ]


@dataclass
class _SlowestRank:
    """The max over ranks of one per-checkpoint value, held until every rank has had time to
    report it (a stall is the slowest rank's); with ``total``, the sum (bytes every rank
    received)."""

    tag: str
    pending: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    """step -> (value, walltime of the first report, monotonic time it was first seen)."""
    total: bool = False

    def add(self, *, step: int, value: float, walltime: float) -> None:
        old = self.pending.get(step)
        if old is None:
            self.pending[step] = (value, walltime, time.monotonic())
        else:
            combined = old[0] + value if self.total else max(old[0], value)
            self.pending[step] = (combined, old[1], old[2])

    def drain(self, *, settle_s: float) -> Iterator[Scalar]:
        now = time.monotonic()
        for step, (value, walltime, seen) in list(self.pending.items()):
            if now - seen >= settle_s:
                del self.pending[step]
                yield Scalar(tag=self.tag, value=value, step=step, walltime=walltime)


@dataclass
class TailState:
    """How far a tailer got; saved after each flush so the next rank-0 process resumes there."""

    metrics_offset: int = 0
    events_offset: int = 0
    restarts_written: int = 0
    startup_written: bool = False


class Tailer:
    """Writes a run directory's JSONL logs as TensorBoard scalars, incrementally.

    `poll` reads the complete lines appended since the last poll; `start` runs it every
    ``poll_s`` seconds in a daemon thread; `close` polls a last time, flushes and closes.
    """

    def __init__(
        self,
        *,
        run_dir: Path,
        writer_factory: Callable[..., _Writer],
        poll_s: float = 5.0,
        settle_s: float = 5.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / TB_SUBDIR
        self.poll_s = poll_s
        # Seconds to wait for the other ranks' reports of a checkpoint or a restart.
        self.settle_s = settle_s
        self._writer_factory = writer_factory
        self._writer: _Writer | None = None
        self.state = self._load_state()
        self._blocking = _SlowestRank(tag="checkpoint/blocking_s")
        self._write = _SlowestRank(tag="checkpoint/write_s")
        self._snapshot = _SlowestRank(tag="checkpoint/memory_snapshot_s")
        self._replica = (
            _SlowestRank(tag="replica/stall_s"),
            _SlowestRank(tag="replica/heal_s"),
            _SlowestRank(tag="replica/heal_bytes", total=True),
        )
        self._restart_seen_at: float | None = None  # monotonic time of the last restart event
        # Written as read: one rank reports them (stragglers, replica quorums and discards).
        self._as_read: list[Scalar] = []
        self._summary: RunSummary | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # poll from the thread vs close from atexit
        self._failed = False
        self.written = 0

    # -- state -----------------------------------------------------------------------------------
    def _load_state(self) -> TailState:
        try:
            raw = json.loads((self.log_dir / STATE_FILE).read_text())
            return TailState(**{k: raw[k] for k in asdict(TailState()) if k in raw})
        except (OSError, ValueError, TypeError):
            return TailState()

    def _save_state(self) -> None:
        tmp = self.log_dir / f"{STATE_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self.state)))
        tmp.replace(self.log_dir / STATE_FILE)  # atomic: a reader never sees half a state

    # -- reading ---------------------------------------------------------------------------------
    def _new_lines(self, name: str, offset: int) -> tuple[list[dict[str, Any]], int]:
        """Records of the complete lines after ``offset``, and the offset after them."""
        path = self.run_dir / name
        try:
            size = path.stat().st_size
        except OSError:
            return [], offset
        if size < offset:
            offset = 0  # the file was replaced (a new run in the same directory)
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        rows, _ = parse_jsonl(data[:end].splitlines())
        return rows, offset + end

    def _event_scalars(self, e: dict[str, Any]) -> None:
        kind, step, t = e.get("kind"), e.get("step"), _num(e.get("time"))
        if t is None:
            return
        if kind in _RESTART_KINDS:
            self._restart_seen_at = time.monotonic()
        if not isinstance(step, int):
            return
        if kind == "checkpoint_staged" and (v := _num(e.get("blocking_s"))) is not None:
            self._blocking.add(step=step, value=v, walltime=t)
        elif kind == "memory_snapshot" and (v := _num(e.get("blocking_s"))) is not None:
            self._snapshot.add(step=step, value=v, walltime=t)
        elif kind == "checkpoint_committed" and (v := _num(e.get("write_s"))) is not None:
            self._write.add(step=step, value=v, walltime=t)
        elif kind == "straggler_report":
            self._as_read += [
                Scalar(tag=f"straggler/rank_{r['rank']}", value=v, step=step, walltime=t)
                for r in e.get("scores") or []
                if (v := _num(r.get("score"))) is not None
            ]
            self._as_read += [
                Scalar(tag=f"straggler/node/{node}", value=v, step=step, walltime=t)
                for node, score in (e.get("nodes") or {}).items()
                if (v := _num(score)) is not None
            ]
        elif kind in REPLICA_KINDS:
            self._replica_scalars(e, step=step, walltime=t)
        elif kind == "straggler_eviction":
            self._as_read.append(Scalar(tag="straggler/evicted", value=1.0, step=step, walltime=t))

    def _replica_scalars(self, e: dict[str, Any], *, step: int, walltime: float) -> None:
        stall, heal_s, heal_bytes = self._replica
        kind = e.get("kind")
        if kind == STALL and (v := _num(e.get("stall_s"))) is not None:
            stall.add(step=step, value=v, walltime=walltime)
        elif kind == HEAL:
            if (v := _num(e.get("heal_s"))) is not None:
                heal_s.add(step=step, value=v, walltime=walltime)
            if (v := _num(e.get("bytes"))) is not None:
                heal_bytes.add(step=step, value=v, walltime=walltime)
        elif e.get("rank") != 0:
            return  # the same quorum or discard on every rank: the group's rank 0 writes it
        elif kind == QUORUM:
            for field_name in ("participants", "wait_s"):
                if (v := _num(e.get(field_name))) is not None:
                    tag = f"replica/quorum_{field_name}"
                    self._as_read.append(Scalar(tag=tag, value=v, step=step, walltime=walltime))
        elif kind == DISCARDED:
            self._as_read.append(
                Scalar(tag="replica/step_discarded", value=1.0, step=step, walltime=walltime)
            )

    def _restart_scalars(self, *, final: bool) -> list[Scalar]:
        """Restarts (and the start-up) not written yet that have settled; everything if final.

        The whole run is re-summarized (incidents need all of it), so only when restart events
        came in and then stopped for ``settle_s``: never in steady training.
        """
        if not final and (
            self._restart_seen_at is None
            or time.monotonic() - self._restart_seen_at < self.settle_s
        ):
            return []
        try:
            summary = summarize(run_dir=self.run_dir)
        except RunDirError:
            return []
        self._summary = summary
        out: list[Scalar] = []
        if not self.state.startup_written and (
            final or any(m.phase == "first_step" for m in summary.startup_phases)
        ):
            out += startup_scalars(summary)
            self.state.startup_written = True
        for i in range(self.state.restarts_written, len(summary.restarts)):
            r = summary.restarts[i]
            # Done once every rank's first_step is in: the slowest may log it after rank 0's
            # metrics line, so a restart without one waits settle_s past its first step.
            done = r.resumed_s is not None and (
                any(m.phase == "first_step" for m in r.phases)
                or time.time() - (summary.start_time + r.resumed_s) >= self.settle_s
            )
            if not (done or final):
                break  # still down: its downtime is not known yet
            out += restart_scalars(summary, index=i)
            self.state.restarts_written = i + 1
        # Still down: look again in settle_s; otherwise wait for the next restart event.
        pending = self.state.restarts_written < len(summary.restarts)
        self._restart_seen_at = time.monotonic() if pending else None
        return out

    # -- writing ---------------------------------------------------------------------------------
    def _emit(self, scalars: list[Scalar]) -> None:
        if not scalars:
            return
        if self._writer is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = self._writer_factory(log_dir=str(self.log_dir))
        for s in scalars:
            self._writer.add_scalar(s.tag, s.value, global_step=s.step, walltime=s.walltime)
        self.written += len(scalars)

    def poll(self, *, final: bool = False) -> int:
        """Write what is new; ``final``: also what has not settled. Returns scalars written."""
        with self._lock:
            before = self.written
            metrics, m_off = self._new_lines(METRICS_FILE, self.state.metrics_offset)
            events, e_off = self._new_lines(EVENTS_FILE, self.state.events_offset)
            scalars = [s for m in metrics for s in step_scalars(m)]
            for e in events:
                self._event_scalars(e)
            settle = 0.0 if final else self.settle_s
            scalars += self._blocking.drain(settle_s=settle)
            scalars += self._write.drain(settle_s=settle)
            scalars += self._snapshot.drain(settle_s=settle)
            for across_ranks in self._replica:
                scalars += across_ranks.drain(settle_s=settle)
            scalars += self._restart_scalars(final=final)
            scalars += self._as_read
            self._as_read = []
            if final and self._summary is not None and self._summary.final_step is not None:
                s = self._summary
                t = s.start_time + s.wall_s
                scalars.append(Scalar(tag="run/ettr", value=s.ettr, step=s.final_step, walltime=t))
            self._emit(scalars)
            self.state.metrics_offset, self.state.events_offset = m_off, e_off
            if self._writer is not None and (self.written > before or final):
                self._writer.flush()  # then the state: a crash in between repeats, never loses
                self._save_state()
            return self.written - before

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as err:  # a view of the logs must never take training down
                self._failed = True
                print(f"tensorboard: tailer stopped: {err!r}", file=sys.stderr, flush=True)
                return

    def start(self) -> Tailer:
        self._thread = threading.Thread(target=self._loop, name="tensorboard-tailer", daemon=True)
        self._thread.start()
        return self

    def close(self, *, timeout_s: float = 30.0, raise_errors: bool = False) -> None:
        """Stop the thread, write the rest, flush and close the event file.

        Errors are printed, not raised (this runs at exit), unless ``raise_errors``.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                return  # stuck in a poll (a hung file system): leave it, the process is exiting
            self._thread = None
        try:
            if not self._failed:
                self.poll(final=True)
        except Exception as err:
            if raise_errors:
                raise
            print(f"tensorboard: last write failed: {err!r}", file=sys.stderr, flush=True)
        finally:
            with self._lock:
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None


# The tailer of this process (at most one: in-process restarts call start_tailer again).
_ACTIVE: dict[str, Tailer] = {}
_SAID_MISSING: set[str] = set()  # the "not installed" line, once per process and run


def start_tailer(*, run_dir: Path, rank: int, poll_s: float = 5.0) -> Tailer | None:
    """Rank 0: start (once per process and run directory) the tailer in a daemon thread.

    Returns None on other ranks, when ``TRAINING_TENSORBOARD=0``, or when tensorboard is not
    installed (one line says so). A process that is no longer rank 0 (an in-process restart
    reassigned ranks) stops its tailer, and the new rank 0 resumes from the saved state.
    """
    key = str(Path(run_dir).resolve())
    if rank != 0:
        old = _ACTIVE.pop(key, None)
        if old is not None:
            old.close()
        return None
    if key in _ACTIVE:
        return _ACTIVE[key]
    if os.environ.get(DISABLE_ENV, "1") == "0" or key in _SAID_MISSING:
        return None
    if not tensorboard_installed():
        print(
            "tensorboard: not installed, no TensorBoard scalars (pip install '.[tensorboard]')",
            file=sys.stderr,
            flush=True,
        )
        _SAID_MISSING.add(key)
        return None

    # torch.utils.tensorboard imports in the thread: not on a restart's critical path.
    def factory(**kwargs: Any) -> _Writer:
        cls = summary_writer_class()
        if cls is None:
            raise RuntimeError("torch.utils.tensorboard cannot be imported")
        return cls(**kwargs)

    tailer = Tailer(run_dir=Path(run_dir), writer_factory=factory, poll_s=poll_s).start()
    _ACTIVE[key] = tailer
    atexit.register(tailer.close)
    return tailer


def convert(*, run_dir: Path) -> int:
    """Rewrite ``<run_dir>/tensorboard/`` from the run's logs; returns the scalars written.

    Raises `RunDirError` for a missing or empty run directory, RuntimeError without tensorboard.
    """
    run_dir = Path(run_dir)
    summarize(run_dir=run_dir)  # RunDirError before anything is deleted
    cls = summary_writer_class()
    if cls is None:
        raise RuntimeError("tensorboard is not installed (pip install '.[tensorboard]')")
    log_dir = run_dir / TB_SUBDIR
    if log_dir.is_dir():  # a conversion replaces the tailer's files, it does not add to them
        for old in [*log_dir.glob("events.out.tfevents.*"), log_dir / STATE_FILE]:
            old.unlink(missing_ok=True)
    tailer = Tailer(run_dir=run_dir, writer_factory=cls)
    tailer.close(raise_errors=True)
    return tailer.written


def main(argv: list[str] | None = None) -> int:
    def write(run_dir: Path) -> str:
        n = convert(run_dir=run_dir)
        return f"wrote {n} scalars to {run_dir / TB_SUBDIR}; tensorboard --logdir {run_dir}"

    return run_dir_main(
        argv,
        prog="python -m training.runlog.tensorboard",
        description=f"Write a run's {METRICS_FILE} and {EVENTS_FILE} as TensorBoard scalars "
        f"into RUN_DIR/{TB_SUBDIR}/ (replacing what is there).",
        action=write,
        failures=(RuntimeError,),  # no tensorboard installed
    )


if __name__ == "__main__":
    sys.exit(main())
