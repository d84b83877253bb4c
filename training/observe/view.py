"""What a run directory says, as metric samples: the exporter's logic, without the HTTP server.

`RunView.samples()` reads the lines appended to ``metrics.jsonl`` and ``events.jsonl`` since its
last call (whole lines only: a line still being written is read next time) and returns every
sample of the families in ``training/observe/catalog.py``. Restarts and ETTR come from
``training.runlog.accounting.summarize`` (the one definition the report and TensorBoard use),
recomputed when a restart or checkpoint event arrives and at most every ``summary_every_s``
otherwise. Everything is derived from the append-only logs, so a restarted exporter serves the
same totals: its counters never go back.

Standard library only (no torch, no prometheus_client).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.observe import efa
from training.observe.catalog import (
    JOB_LABEL,
    METRICS,
    NODE_LABEL,
    REPLICA_GROUP_LABEL,
    STRAGGLER_EVENT,
)
from training.runlog.accounting import RunDirError, RunSummary, proven_commit, summarize
from training.runlog.files import EVENTS_FILE, METRICS_FILE, parse_jsonl
from training.runlog.replica import READ_KINDS, summarize_replica

GROUP_DIRS = "group-*"
"""The replica groups' run directories under a local replica run's (``training/replica/
launch.py``'s ``group_dir``): the local run's exporter serves each group's replica figures.
On EKS each group's exporter reads its own group's directory."""

CALIBRATION_STEPS = 50
"""Steps of the current attempt whose median is the calibrated step time."""

_SUMMARY_KINDS = frozenset(
    {
        "fault",
        "restart_begin",
        "restart_end",
        "attempt_start",
        "run_start",
        "run_end",
        "hang_detected",
    }
)
_ACTIVE_KINDS = frozenset({"run_start", "attempt_start", "restart_begin", "restart_end"})


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class JsonlTail:
    """The complete lines appended to a JSONL file since the previous call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._identity: tuple[int, int] | None = None

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """(new objects, whether the file was replaced or truncated since the last read: the
        caller then starts over, as the objects are the whole file again)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return [], False
        identity = (stat.st_dev, stat.st_ino)
        restarted = self._identity is not None and (
            identity != self._identity or stat.st_size < self._offset
        )
        if restarted or self._identity is None:
            self._offset = 0
        self._identity = identity
        if stat.st_size == self._offset:
            return [], restarted
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read(stat.st_size - self._offset)
        end = data.rfind(b"\n") + 1  # whole lines only
        self._offset += end
        rows, _ = parse_jsonl(data[:end].splitlines())
        return rows, restarted


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def restart_cause(events: list[dict[str, Any]]) -> str:
    """The cause of one restart incident from its events: the injected fault's kind, 'hang'
    (a hang detector fired), the exception's type (an in-process restart's error), else
    'unknown' (e.g. a rank that died without a word: the in-job layer only sees it gone)."""
    for e in events:
        if e.get("kind") == "fault" and e.get("fault"):
            return str(e["fault"])
    if any(e.get("kind") == "hang_detected" for e in events):
        return "hang"
    for e in events:
        error = e.get("error")
        if e.get("kind") == "restart_begin" and isinstance(error, str) and ":" in error:
            name = error.split(":", 1)[0].strip()
            if name.isidentifier():
                return name
    return "unknown"


@dataclass
class _Steps:
    total: int = 0
    highest: int | None = None
    last_time: float | None = None
    last_duration: float | None = None
    tokens: float = 0.0
    tokens_per_s: float | None = None
    mfu: float | None = None
    loss: float | None = None
    attempt: int | None = None
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=CALIBRATION_STEPS))


@dataclass
class _Events:
    run_start: dict[str, Any] | None = None
    last_active: float | None = None
    last_end: float | None = None
    last_progress: float | None = None
    """The newest run_start or attempt_start."""
    restored_steps: set[int] = field(default_factory=set)
    """Steps restored from checkpoints on storage (a restore proves that checkpoint exists)."""
    commits: dict[Any, tuple[float, float]] = field(default_factory=dict)
    """step (or path) -> (time, write_s) of its commit."""
    staged: dict[Any, float] = field(default_factory=dict)
    """checkpoint step -> the slowest rank's blocking_s."""
    restores: dict[str, int] = field(default_factory=dict)
    restore_last: dict[str, tuple[Any, float]] = field(default_factory=dict)
    """source -> (step of the newest restore, slowest seconds of it)."""
    faults: dict[str, int] = field(default_factory=dict)
    stragglers: dict[int, tuple[float, bool]] = field(default_factory=dict)
    all_events: list[dict[str, Any]] = field(default_factory=list)
    """Restart-related events, for the causes of restarts."""


class RunView:
    """The samples one exporter serves for ``run_dir``.

    ``reporter``: this exporter serves the job's figures (node 0 of the Job, or the local run);
    every exporter serves its node's: faults and straggler scores of ranks
    ``node * nproc_per_node .. + nproc_per_node - 1`` (a torchrun rank is
    node_rank x nproc_per_node + local_rank), and the EFA counters under ``efa_root``.
    """

    def __init__(
        self,
        *,
        run_dir: Path,
        job: str,
        node: int,
        nproc_per_node: int,
        reporter: bool,
        stall_factor: float,
        stall_floor_s: float,
        checkpoint_interval: int,
        info: dict[str, str] | None = None,
        efa_root: Path = efa.SYSFS_ROOT,
        summary_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.job = job
        self.node = node
        self.nproc_per_node = max(1, nproc_per_node)
        self.reporter = reporter
        self.stall_factor = stall_factor
        self.stall_floor_s = stall_floor_s
        self.checkpoint_interval = checkpoint_interval
        self.info = dict(info or {})
        self.efa_root = efa_root
        self.summary_every_s = summary_every_s
        self._clock = clock
        self._metrics = JsonlTail(self.run_dir / METRICS_FILE)
        self._events = JsonlTail(self.run_dir / EVENTS_FILE)
        self._group_tails: dict[Path, JsonlTail] = {}
        self._replica: dict[Path, list[dict[str, Any]]] = {}
        """events file -> its events ``summarize_replica`` reads (one file: one group)."""
        self._reset()

    def _reset(self) -> None:
        self._steps = _Steps()
        self._ev = _Events()
        self._summary: RunSummary | None = None
        self._summary_at: float | None = None
        self._summary_due = True
        self._restarts: dict[tuple[str, str], float] = {}
        self._lost: dict[str, float] = {}
        self._replica.pop(self._events.path, None)

    # -- reading -----------------------------------------------------------------------------

    def _own_rank(self, rank: Any) -> bool:
        if not isinstance(rank, int):
            return False
        if rank < 0:  # the launcher's own events (rank -1) belong to the reporting node
            return self.reporter
        return rank // self.nproc_per_node == self.node

    def _take_step(self, m: dict[str, Any]) -> None:
        s = self._steps
        step, t, duration = m.get("step"), _num(m.get("time")), _num(m.get("step_time_s"))
        if not isinstance(step, int) or t is None or duration is None:
            return
        attempt = m.get("attempt") if isinstance(m.get("attempt"), int) else 0
        if attempt != s.attempt:
            s.recent.clear()  # a new attempt's steps calibrate afresh
        s.attempt = attempt
        s.total += 1
        s.highest = step if s.highest is None else max(s.highest, step)
        s.last_time = t
        s.last_duration = duration
        s.recent.append(duration)
        s.tokens_per_s = _num(m.get("tokens_per_s"))
        if s.tokens_per_s is not None:
            s.tokens += s.tokens_per_s * duration
        s.mfu = _num(m.get("mfu"))
        s.loss = _num(m.get("loss"))

    def _take_event(self, e: dict[str, Any]) -> None:
        ev = self._ev
        kind, t = e.get("kind"), _num(e.get("time"))
        if not isinstance(kind, str) or t is None:
            return
        if kind in _SUMMARY_KINDS:
            self._summary_due = True
            ev.all_events.append(e)
        if kind == "run_start" and ev.run_start is None:
            ev.run_start = e
        if kind in ("run_start", "attempt_start"):
            ev.last_progress = max(t, ev.last_progress or t)
        if kind in _ACTIVE_KINDS:
            ev.last_active = max(t, ev.last_active or t)
        elif kind == "run_end":
            ev.last_end = max(t, ev.last_end or t)
        elif kind == "checkpoint_committed":
            key = ("step", e["step"]) if e.get("step") is not None else e.get("path")
            ev.commits[key] = (t, _num(e.get("write_s")) or 0.0)
        elif kind == "checkpoint_staged" and e.get("engine") != "nvrx_local":
            blocking = _num(e.get("blocking_s"))
            if blocking is not None and e.get("step") is not None:
                ev.staged[e["step"]] = max(blocking, ev.staged.get(e["step"], 0.0))
        elif kind == "checkpoint_load":
            seconds = _num(e.get("seconds"))
            source = str(e.get("source") or "storage")
            if seconds is not None:
                newest = ev.restore_last.get(source)
                if newest is None or newest[0] != e.get("step"):
                    ev.restore_last[source] = (e.get("step"), seconds)
                else:
                    ev.restore_last[source] = (newest[0], max(newest[1], seconds))
            if e.get("rank") == 0:  # every rank restores; count the job's restores once
                ev.restores[source] = ev.restores.get(source, 0) + 1
            if (proven := proven_commit(e)) is not None:
                ev.restored_steps.add(proven[1])
        if kind == STRAGGLER_EVENT:  # rank 0 writes every rank's score
            threshold = _num(e.get("threshold"))
            for entry in e.get("scores") or []:
                rank, score = entry.get("rank"), _num(entry.get("score"))
                if self._own_rank(rank) and rank >= 0 and score is not None:
                    flagged = threshold is not None and score < threshold
                    ev.stragglers[rank] = (score, flagged)
            return
        if not self._own_rank(e.get("rank")):
            return
        if kind == "fault":
            cause = str(e.get("fault") or "unknown")
            ev.faults[cause] = ev.faults.get(cause, 0) + 1
        elif kind == "hang_detected":
            ev.faults["hang"] = ev.faults.get("hang", 0) + 1

    def _refresh_summary(self) -> None:
        now = self._clock()
        stale = self._summary_at is None or now - self._summary_at >= self.summary_every_s
        if not (self._summary_due or stale):
            return
        self._summary_due = False
        self._summary_at = now
        try:
            summary = summarize(run_dir=self.run_dir)
        except RunDirError:
            return
        self._summary = summary
        t0 = summary.start_time
        events = sorted(self._ev.all_events, key=lambda e: float(e["time"]))
        restarts = summary.restarts
        counts: dict[tuple[str, str], float] = {}
        lost: dict[str, float] = {}
        for i, r in enumerate(restarts):
            begin = t0 + r.begin_s - 1.0  # the clock skew accounting allows between hosts
            end = t0 + restarts[i + 1].begin_s if i + 1 < len(restarts) else float("inf")
            if r.resumed_s is not None:
                end = min(end, t0 + r.resumed_s)
            window = [e for e in events if begin <= float(e["time"]) <= end]
            key = (r.mode, restart_cause(window))
            counts[key] = counts.get(key, 0) + 1
            lost[r.mode] = lost.get(r.mode, 0.0) + r.lost_s
        # Counters never go back: a later regrouping (a late restart_end) may not lower them.
        for key, value in counts.items():
            self._restarts[key] = max(value, self._restarts.get(key, 0))
        for mode, value in lost.items():
            self._lost[mode] = max(value, self._lost.get(mode, 0.0))

    def refresh(self) -> None:
        """Read what the ranks appended since the last call."""
        steps, steps_restarted = self._metrics.read()
        events, events_restarted = self._events.read()
        if steps_restarted or events_restarted:
            # The run directory was reused by a new run: start over from the new files.
            self._metrics = JsonlTail(self.run_dir / METRICS_FILE)
            self._events = JsonlTail(self.run_dir / EVENTS_FILE)
            self._reset()
            steps, _ = self._metrics.read()
            events, _ = self._events.read()
        if self.reporter:
            for m in steps:
                self._take_step(m)
        for e in events:
            self._take_event(e)
        if self.reporter:
            self._keep_replica(self._events.path, events)
            self._read_groups()
            self._refresh_summary()

    def _keep_replica(self, path: Path, events: list[dict[str, Any]]) -> None:
        kept = [e for e in events if e.get("kind") in READ_KINDS]
        if kept:
            self._replica.setdefault(path, []).extend(kept)

    def _read_groups(self) -> None:
        """The replica groups' own run directories under this one (a local replica run)."""
        for path in sorted(self.run_dir.glob(f"{GROUP_DIRS}/{EVENTS_FILE}")):
            tail = self._group_tails.setdefault(path, JsonlTail(path))
            events, restarted = tail.read()
            if restarted:  # a new run in the same directory: its file is read from the top
                self._replica.pop(path, None)
            self._keep_replica(path, events)

    # -- samples ------------------------------------------------------------------------------

    def samples(self) -> list[Sample]:
        """Refresh, then every sample this exporter serves now."""
        self.refresh()
        out: list[Sample] = []

        def add(name: str, value: float | None, **labels: str) -> None:
            if value is None:
                return
            assert name in METRICS, name
            out.append(Sample(name=name, labels={JOB_LABEL: self.job, **labels}, value=value))

        if self.reporter:
            self._job_samples(add)
        node = str(self.node)
        for cause, count in sorted(self._ev.faults.items()):
            add("training_faults_total", count, **{NODE_LABEL: node, "cause": cause})
        for rank, (score, flagged) in sorted(self._ev.stragglers.items()):
            labels = {NODE_LABEL: node, "rank": str(rank)}
            add("training_straggler_score", score, **labels)
            add("training_straggler_flagged", float(flagged), **labels)
        for reading in efa.read_counters(self.efa_root):
            add(reading.metric, reading.value, **{NODE_LABEL: node, "device": reading.device})
        return out

    def calibrated_step_s(self) -> float | None:
        recent = self._steps.recent
        return statistics.median(recent) if recent else None

    def _job_samples(self, add: Callable[..., None]) -> None:
        s, ev = self._steps, self._ev
        if ev.run_start is not None:  # from the run's start on, so its labels never change
            add(
                "training_info",
                1.0,
                recipe=self.info.get("recipe", ""),
                restart_mode=str(
                    ev.run_start.get("restart_mode") or self.info.get("restart_mode", "")
                ),
                world_size=str(ev.run_start.get("world_size") or ""),
            )
        seen = s.last_time is not None or ev.last_active is not None
        newest_activity = max(
            [t for t in (s.last_time, ev.last_active) if t is not None], default=None
        )
        active = (
            seen
            and newest_activity is not None
            and (ev.last_end is None or newest_activity > ev.last_end)
        )
        add("training_run_active", float(active))
        add("training_steps_total", float(s.total))
        add("training_step", None if s.highest is None else float(s.highest))
        add("training_last_step_timestamp_seconds", s.last_time)
        progress = [t for t in (s.last_time, ev.last_progress) if t is not None]
        add("training_last_progress_timestamp_seconds", max(progress, default=None))
        add("training_step_duration_seconds", s.last_duration)
        calibrated = self.calibrated_step_s()
        add("training_step_duration_calibrated_seconds", calibrated)
        threshold = self.stall_floor_s
        if calibrated is not None:
            threshold = max(threshold, self.stall_factor * calibrated)
        add("training_stall_threshold_seconds", threshold)
        add("training_tokens_total", s.tokens)
        add("training_tokens_per_second", s.tokens_per_s)
        add("training_mfu_ratio", s.mfu)
        add("training_loss", s.loss)
        add("training_attempt", None if s.attempt is None else float(s.attempt))
        if self._summary is not None:
            add("training_ettr_ratio", self._summary.ettr)
        for (layer, cause), count in sorted(self._restarts.items()):
            add("training_restarts_total", count, layer=layer, cause=cause)
        for layer, seconds in sorted(self._lost.items()):
            add("training_restart_lost_seconds_total", seconds, layer=layer)
        commit_steps = [k[1] for k in ev.commits if isinstance(k, tuple)]
        # A restore from storage proves its step committed (``proven_commit``).
        unnamed_commits = ev.restored_steps.difference(commit_steps)
        add("training_checkpoints_committed_total", float(len(ev.commits) + len(unnamed_commits)))
        newest_checkpoint = max([*commit_steps, *ev.restored_steps], default=0)
        add("training_checkpoint_last_commit_step", float(newest_checkpoint))
        if ev.commits:
            newest_time, newest_write = max(ev.commits.values())
            add("training_checkpoint_last_commit_timestamp_seconds", newest_time)
            add("training_checkpoint_commit_seconds", newest_write)
        if self.checkpoint_interval > 0:
            add("training_checkpoint_interval_steps", float(self.checkpoint_interval))
        if ev.staged:
            add("training_checkpoint_save_blocking_seconds", ev.staged[max(ev.staged)])
        for source, (_, seconds) in sorted(ev.restore_last.items()):
            add("training_checkpoint_restore_seconds", seconds, source=source)
        for source, count in sorted(ev.restores.items()):
            add("training_checkpoint_restores_total", float(count), source=source)
        self._replica_samples(add)

    def _replica_samples(self, add: Callable[..., None]) -> None:
        """Each replica group's figures (``training/runlog/replica.py``), one events file each."""
        for events in self._replica.values():
            r = summarize_replica(events)
            if r is None or r.group is None:
                continue
            labels = {REPLICA_GROUP_LABEL: str(r.group)}
            add("training_replica_groups", None if r.groups is None else float(r.groups), **labels)
            participants = r.participants
            add(
                "training_replica_quorum_participants",
                None if participants is None else float(participants),
                **labels,
            )
            add("training_replica_quorum_changes_total", float(len(r.quorum_changes)), **labels)
            add("training_replica_waiting", float(r.waiting_since is not None), **labels)
            add("training_replica_waiting_since_timestamp_seconds", r.waiting_since, **labels)
            add("training_replica_steps_discarded_total", float(r.steps_discarded), **labels)
            add("training_replica_stalls_total", float(len(r.stalls)), **labels)
            add(
                "training_replica_stall_seconds_total",
                sum(stall.stall_s for stall in r.stalls),
                **labels,
            )
            if r.stalls:
                add("training_replica_stall_seconds", r.stalls[-1].stall_s, **labels)
            add("training_replica_heals_total", float(len(r.heals)), **labels)
            if r.heals:
                add("training_replica_heal_seconds", r.heals[-1].heal_s, **labels)
            add("training_replica_heal_bytes_total", float(r.heal_bytes_total), **labels)
