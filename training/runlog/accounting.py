"""Run accounting: turn a run directory's JSONL logs into a `RunSummary` (no plotting here).

The run directory contract (written by the trainer):

- ``metrics.jsonl``: rank 0, one object per optimizer step (``time`` = end of the step, ``step``,
  ``loss``, ``lr``, ``step_time_s``, ``tokens_per_s``, ``mfu``, ``attempt``). After a restart from
  a checkpoint the steps after that checkpoint appear again, later and with a higher attempt.
- ``events.jsonl``: any rank, appended, ``{"time", "rank", "kind", "step", ...}``.

Both files may end in a truncated line (a killed process); undecodable lines are skipped and
counted. `summarize` raises `RunDirError` when there is nothing to summarize.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from training.runlog.files import EVENTS_FILE, METRICS_FILE, read_jsonl
from training.runlog.phases import DETECTED, PHASES, RESTART_PHASE
from training.runlog.replica import ReplicaSummary, summarize_replica

# Events that belong to a restart incident. Everything logged between a fault and the first step
# completed after it (by any rank, in any order) is one incident.
_INCIDENT_KINDS = frozenset({"fault", "restart_begin", "restart_end", "attempt_start"})


# Clock skew allowed between hosts when a phase event is matched to the restart it belongs to.
_PHASE_SKEW_S = 1.0


class RunDirError(Exception):
    """The run directory is missing or holds no usable records."""


@dataclass(frozen=True)
class Step:
    """One line of metrics.jsonl (the fields the accounting needs)."""

    time: float
    """Unix time at the end of the step."""
    step: int
    """The 1-based step number just completed."""
    step_time_s: float
    """Seconds the step took (its start is ``time - step_time_s``)."""
    attempt: int
    """0 for the first process/iteration, +1 per restart."""
    loss: float | None
    """Training loss of the step."""
    tokens_per_s: float | None
    """Throughput of the step."""
    mfu: float | None
    """Model FLOPs utilisation of the step, when the trainer knows the peak FLOPs."""


@dataclass(frozen=True)
class PhaseMark:
    """One restart phase (``training/runlog/phases.py``) as the whole job reached it.

    A phase counts as reached when the *last* rank reports it (the job cannot go on before), except
    ``detected``, which is reached when the *first* rank sees the fault.
    """

    phase: str
    """One of ``training.runlog.phases.PHASES``."""
    offset_s: float
    """Seconds from the restart's begin (``Restart.begin_s``; run start for start-up)."""
    duration_s: float
    """Seconds since the phase reached just before it in time (the begin, for the first one):
    what this phase added to the restart. Phases are ordered by time, not by ``PHASES``, since
    the layers do not all pass them in the same order."""
    ranks: int
    """How many ranks reported the phase."""


def _phase_marks(events: list[dict[str, Any]], *, origin: float) -> tuple[PhaseMark, ...]:
    """The `PhaseMark`s of one restart (or the start-up) from its restart_phase events."""
    times: dict[str, list[float]] = {}
    ranks: dict[str, set[Any]] = {}
    for e in events:
        times.setdefault(str(e["phase"]), []).append(float(e["time"]))
        ranks.setdefault(str(e["phase"]), set()).add(e.get("rank"))
    reached = {p: (min(ts) if p == DETECTED else max(ts)) for p, ts in times.items()}
    order = sorted(reached, key=lambda p: (reached[p], PHASES.index(p)))
    marks: list[PhaseMark] = []
    prev = origin
    for p in order:
        t = reached[p]
        marks.append(
            PhaseMark(
                phase=p,
                offset_s=t - origin,
                duration_s=max(0.0, t - prev),  # a phase logged before the begin added nothing
                ranks=len(ranks[p]),
            )
        )
        prev = max(prev, t)
    return tuple(marks)


@dataclass(frozen=True)
class Restart:
    """One restart incident: a fault (or a bare restart_begin) and the recovery after it.

    Time lost is defined as ``lost_s = downtime_s + recompute_s`` where

    - ``downtime_s`` runs from the incident's begin (the first ``fault`` event; if the incident has
      no fault event, the first ``restart_begin``; failing both, its first event) to the *start*
      of the first step completed after it (that step's ``time - step_time_s``). The start, not
      the end, so that the step's own compute is not counted twice: it is productive (or, if it
      repeats a step, part of ``recompute_s``). Clamped at 0.
    - ``recompute_s`` is the summed ``step_time_s`` of the step occurrences completed *before* the
      begin that are superseded by an occurrence of the same step number completed after it:
      work done since the last checkpoint and thrown away by this restart.

    So ``productive_s + sum(r.recompute_s) == sum of every step_time_s`` in the run.
    """

    mode: str
    """inprocess, injob or cold (from restart_begin/restart_end), or "unknown"."""
    fault: str | None
    """The fault kind (exception, hang, sigkill, ...) of the incident's first fault event."""
    attempt: int | None
    """The attempt number of the first step after the restart (None: the run never resumed)."""
    begin_s: float
    """Seconds since run start at which the incident began (see the class docstring)."""
    resumed_s: float | None
    """Seconds since run start at which the first step after the incident completed."""
    downtime_s: float
    """Seconds from begin to the start of the first step after it (to the run's end if none)."""
    recompute_s: float
    """Seconds of step work done before the incident and done again after it."""
    recomputed_steps: int
    """How many step numbers were completed before the incident and repeated after it."""
    restart_s: float | None
    """The longest ``seconds`` reported by this incident's restart_end events, if any."""
    restore_source: str | None = None
    """The tier the restart restored from (``checkpoint_load``'s ``source``: memory,
    pod_memory, peer, local, storage; training/checkpoint/tiers.py); None when it loaded none."""
    restore_step: int | None = None
    """The step it restored."""
    restore_s: float | None = None
    """The slowest rank's load, in seconds."""
    restore_bytes: int | None = None
    """Bytes restored, all ranks together."""
    phases: tuple[PhaseMark, ...] = ()
    """The restart phases recorded for this incident, in the order they were reached (any phase
    may be missing: a layer that does not see it does not log it)."""

    @property
    def lost_s(self) -> float:
        """Total time lost to this incident: downtime plus recomputed work."""
        return self.downtime_s + self.recompute_s

    @property
    def costliest_phase(self) -> str | None:
        """The phase with the longest duration (None when no phase was recorded)."""
        if not self.phases:
            return None
        return max(self.phases, key=lambda m: m.duration_s).phase

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, with lost_s and costliest_phase spelled out."""
        return {**asdict(self), "lost_s": self.lost_s, "costliest_phase": self.costliest_phase}


@dataclass(frozen=True)
class RunSummary:
    """What one run achieved and what its faults cost (all times in seconds)."""

    run_dir: str
    """The run directory summarized."""
    status: str | None
    """The last run_end status (completed, failed, preempted); None while running or killed."""
    cause: str | None
    """The last run_end cause, if any."""
    world_size: int | None
    """From the first run_start event."""
    steps_completed: int
    """Unique step numbers completed."""
    final_step: int | None
    """The highest step number completed."""
    attempts: int
    """How many attempts (processes or in-process iterations) produced steps or attempt_start."""
    wall_s: float
    """First run_start (or the earliest record) to the last step or run_end, whichever is later."""
    productive_s: float
    """Sum of step_time_s over the last occurrence of each step number."""
    ettr: float
    """Effective training time ratio: productive_s / wall_s (0 when wall_s is 0)."""
    lost_s: float
    """Sum of every restart's lost_s."""
    faults: int
    """Incidents that contain at least one fault event (recovered or not)."""
    restarts: tuple[Restart, ...]
    """Incidents that contain a restart (restart_begin/restart_end or a new attempt)."""
    checkpoints_committed: int
    """Distinct committed checkpoints (by step, else by path), duplicates across ranks removed;
    a checkpoint restored from storage counts (``proven_commit``)."""
    ckpt_blocking_median_s: float | None
    """Median over checkpoints of the slowest rank's blocking_s (the training stall)."""
    tokens_per_s_median: float | None
    """Median tokens/s over every step occurrence."""
    mfu_median: float | None
    """Median MFU over the step occurrences that report one."""
    final_loss: float | None
    """Loss of the last occurrence of the highest step."""
    skipped_lines: int
    """JSONL lines that could not be parsed (e.g. a truncated last line) and were ignored."""
    start_time: float
    """Unix time the wall clock starts from (x = 0 on the timeline)."""
    startup_phases: tuple[PhaseMark, ...] = ()
    """Phases of the first attempt's start: offsets from the run start, or from the first phase
    when it came earlier (in-job workers log their start and imports before run_start)."""
    straggler_reports: int = 0
    """``straggler_report`` events (training/resilience/straggler.py)."""
    straggler_lowest: dict[str, float] = field(default_factory=dict)
    """Each node's lowest score over those reports (1.0: as fast as the fastest rank)."""
    evicted_nodes: tuple[str, ...] = ()
    """Nodes the straggler policy evicted (``straggler_eviction``), in order."""
    replica: ReplicaSummary | None = None
    """``restart=replica``: this group's quorums, heals and survivors' stalls
    (``training/runlog/replica.py``); None for other modes."""

    @property
    def phase_totals_s(self) -> dict[str, float]:
        """Seconds each phase took summed over every restart, in ``PHASES`` order."""
        totals: dict[str, float] = {}
        for p in PHASES:
            durations = [m.duration_s for r in self.restarts for m in r.phases if m.phase == p]
            if durations:
                totals[p] = sum(durations)
        return totals

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (restarts as a list of dicts, with lost_s spelled out)."""
        out = asdict(self)
        out["restarts"] = [r.to_json() for r in self.restarts]
        out["phase_totals_s"] = self.phase_totals_s
        if self.replica is not None:
            r = self.replica
            out["replica"].update(
                participants=r.participants,
                stall_p50_s=r.stall_p50_s,
                stall_max_s=r.stall_max_s,
                heal_bytes_total=r.heal_bytes_total,
            )
        return out


@dataclass(frozen=True)
class RunLogs:
    """The parsed contents of a run directory."""

    steps: tuple[Step, ...]
    """Every metrics line, sorted by time."""
    events: tuple[dict[str, Any], ...]
    """Every event line with a numeric time and a kind, sorted by time."""
    skipped_lines: int
    """Lines that were not valid JSON objects of the expected shape."""


def _num(value: Any) -> float | None:
    """A finite float, or None for null/missing/non-numeric values."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def load_run(*, run_dir: Path) -> RunLogs:
    """Parse metrics.jsonl and events.jsonl, skipping lines that are not usable records."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} does not exist")
    raw_steps, bad_m = read_jsonl(run_dir / METRICS_FILE)
    raw_events, bad_e = read_jsonl(run_dir / EVENTS_FILE)
    skipped = bad_m + bad_e
    steps: list[Step] = []
    for m in raw_steps:
        t, s, st = _num(m.get("time")), m.get("step"), _num(m.get("step_time_s"))
        if t is None or not isinstance(s, int) or st is None:
            skipped += 1
            continue
        attempt = m.get("attempt")
        steps.append(
            Step(
                time=t,
                step=s,
                step_time_s=st,
                attempt=attempt if isinstance(attempt, int) else 0,
                loss=_num(m.get("loss")),
                tokens_per_s=_num(m.get("tokens_per_s")),
                mfu=_num(m.get("mfu")),
            )
        )
    events: list[dict[str, Any]] = []
    for e in raw_events:
        if _num(e.get("time")) is None or not isinstance(e.get("kind"), str):
            skipped += 1
            continue
        events.append(e)
    if not steps and not events:
        raise RunDirError(
            f"run directory {run_dir} has no usable records in {METRICS_FILE} or {EVENTS_FILE}"
        )
    steps.sort(key=lambda s: s.time)
    events.sort(key=lambda e: float(e["time"]))
    return RunLogs(steps=tuple(steps), events=tuple(events), skipped_lines=skipped)


def _incidents(
    events: tuple[dict[str, Any], ...], step_times: list[float]
) -> list[list[dict[str, Any]]]:
    """Group fault/restart events into incidents: no step completes inside an incident.

    Ranks log the same restart several times and in no fixed order, so grouping by "no progress
    in between" is what makes per-rank duplicates collapse into one incident.
    """
    groups: list[list[dict[str, Any]]] = []
    prev_t: float | None = None
    for e in events:
        if e["kind"] not in _INCIDENT_KINDS:
            continue
        if e["kind"] == "attempt_start" and not (e.get("attempt") or 0):
            continue  # the first attempt's start is not a restart
        t = float(e["time"])
        # Start a new incident when a step completed since the previous incident event.
        progressed = prev_t is not None and bisect.bisect_right(
            step_times, t
        ) > bisect.bisect_right(step_times, prev_t)
        if not groups or progressed:
            groups.append([])
        groups[-1].append(e)
        prev_t = t
    # A slow rank may log restart_end after the first step: it belongs to the previous incident.
    merged: list[list[dict[str, Any]]] = []
    for g in groups:
        if merged and all(e["kind"] == "restart_end" for e in g):
            merged[-1].extend(g)
        else:
            merged.append(g)
    return merged


def _assign_phases(
    events: tuple[dict[str, Any], ...], restarts: list[Restart], *, t0: float
) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """Split the restart_phase events into one list per restart and the start-up's list.

    By time: an event belongs to the last restart that began before it (within the clock skew
    allowed between hosts; inside that margin the event's attempt decides). Time, not only the
    attempt number, because a failed recovery spans several attempts in one incident and cold
    relaunches renumber attempts.
    """
    per_restart: list[list[dict[str, Any]]] = [[] for _ in restarts]
    startup: list[dict[str, Any]] = []
    begins = [t0 + r.begin_s for r in restarts]
    for e in events:
        if e["kind"] != RESTART_PHASE or e.get("phase") not in PHASES:
            continue
        t = float(e["time"])
        n = bisect.bisect_right(begins, t + _PHASE_SKEW_S)  # restarts begun by t (+ skew)
        if n == 0:
            startup.append(e)
            continue
        i = n - 1
        attempt = e.get("attempt")
        # Near a boundary, an attempt that names the previous restart (or start-up) wins.
        if begins[i] > t and attempt != restarts[i].attempt:
            if i == 0:
                if not attempt:
                    startup.append(e)
                    continue
            elif attempt == restarts[i - 1].attempt:
                i -= 1
        per_restart[i].append(e)
    return per_restart, startup


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def proven_commit(event: dict[str, Any]) -> Any | None:
    """The checkpoint an event proves committed (``("step", n)``, else its path), or None: a
    ``checkpoint_committed`` line, or a restore from storage, which loads only a committed
    checkpoint. The restore stands in for a commit line that a SIGKILL between the commit
    record and the line's write lost (docs/observability.md)."""
    kind, step = event.get("kind"), event.get("step")
    if kind == "checkpoint_committed":
        return ("step", step) if step is not None else event.get("path")
    if kind == "checkpoint_load" and (event.get("source") or "storage") == "storage":
        return ("step", step) if isinstance(step, int) else None
    return None


def summarize(*, run_dir: Path) -> RunSummary:
    """Compute the `RunSummary` of a run directory (see `Restart` for how time lost is defined).

    Raises `RunDirError` if the directory is missing or holds no usable records.
    """
    logs = load_run(run_dir=run_dir)
    steps, events = logs.steps, logs.events
    step_times = [s.time for s in steps]

    starts = [float(e["time"]) for e in events if e["kind"] == "run_start"]
    if starts:
        t0 = min(starts)
    else:  # no run_start (e.g. truncated): the earliest evidence of the run
        candidates = [float(e["time"]) for e in events] + [s.time - s.step_time_s for s in steps]
        t0 = min(candidates)
    ends = [float(e["time"]) for e in events if e["kind"] == "run_end"]
    t_end = max([*ends, *(s.time for s in steps), t0])
    wall = t_end - t0

    # The last occurrence of each step number is the one that counts; earlier ones were lost.
    last: dict[int, Step] = {}
    for s in steps:
        last[s.step] = s
    productive = sum(s.step_time_s for s in last.values())

    restarts: list[Restart] = []
    faults = 0
    for group in _incidents(events, step_times):
        kinds = {e["kind"] for e in group}
        fault_events = [e for e in group if e["kind"] == "fault"]
        faults += bool(fault_events)
        if not kinds & {"restart_begin", "restart_end", "attempt_start"}:
            continue  # a fault nobody restarted from (the run failed): not a restart
        begin_ev = (
            fault_events[0]
            if fault_events
            else next((e for e in group if e["kind"] == "restart_begin"), group[0])
        )
        begin = float(begin_ev["time"])
        modes = Counter(
            str(e["mode"])
            for e in group
            if e["kind"] in ("restart_begin", "restart_end")
            if e.get("mode")
        )
        restart_secs = [
            v
            for e in group
            if e["kind"] == "restart_end"
            if (v := _num(e.get("seconds"))) is not None
        ]
        i = bisect.bisect_right(step_times, begin)
        after = steps[i] if i < len(steps) else None
        before_steps = steps[:i]
        later_numbers = {s.step for s in steps[i:]}
        # Occurrences before the incident that a later occurrence supersedes: thrown-away work.
        # Only the latest pre-incident occurrence of a step number counts here; older ones were
        # already superseded by an earlier incident.
        latest_before: dict[int, Step] = {}
        for s in before_steps:
            latest_before[s.step] = s
        redone = [s for n, s in latest_before.items() if n in later_numbers]
        if after is not None:
            downtime = max(0.0, after.time - after.step_time_s - begin)
        else:
            downtime = max(0.0, t_end - begin)
        resumed_at = after.time if after is not None else float("inf")
        loads = [
            e
            for e in events
            if e["kind"] == "checkpoint_load" and begin <= float(e["time"]) <= resumed_at
        ]
        restarts.append(
            Restart(
                mode=modes.most_common(1)[0][0] if modes else "unknown",
                fault=str(fault_events[0].get("fault")) if fault_events else None,
                attempt=after.attempt if after is not None else None,
                begin_s=begin - t0,
                resumed_s=after.time - t0 if after is not None else None,
                downtime_s=downtime,
                recompute_s=sum(s.step_time_s for s in redone),
                recomputed_steps=len(redone),
                restart_s=max(restart_secs) if restart_secs else None,
                restore_source=str(loads[-1].get("source", "storage")) if loads else None,
                restore_step=int(loads[-1]["step"]) if loads else None,
                restore_s=max((_num(e.get("seconds")) or 0.0 for e in loads), default=None),
                restore_bytes=sum(int(e.get("bytes") or 0) for e in loads) if loads else None,
            )
        )

    per_restart, startup = _assign_phases(events, restarts, t0=t0)
    restarts = [
        replace(r, phases=_phase_marks(ev, origin=t0 + r.begin_s))
        for r, ev in zip(restarts, per_restart, strict=True)
    ]

    committed = {key for e in events if (key := proven_commit(e)) is not None}
    # The stall a checkpoint causes is the slowest rank's: group staged events per step.
    blocking: dict[Any, float] = {}
    for e in events:
        if e["kind"] == "checkpoint_staged" and (b := _num(e.get("blocking_s"))) is not None:
            key = e.get("step") if e.get("step") is not None else float(e["time"])
            blocking[key] = max(b, blocking.get(key, 0.0))

    run_start = next((e for e in events if e["kind"] == "run_start"), None)
    run_end = next((e for e in reversed(events) if e["kind"] == "run_end"), None)
    ws = run_start.get("world_size") if run_start else None
    attempt_numbers = {s.attempt for s in steps} | {
        e["attempt"]
        for e in events
        if e["kind"] == "attempt_start" and isinstance(e.get("attempt"), int)
    }
    final = last[max(last)] if last else None
    straggler_reports = [e for e in events if e["kind"] == "straggler_report"]
    lowest: dict[str, float] = {}
    for e in straggler_reports:
        for node, score in (e.get("nodes") or {}).items():
            if (v := _num(score)) is not None:
                lowest[str(node)] = min(v, lowest.get(str(node), v))
    return RunSummary(
        run_dir=str(run_dir),
        status=str(run_end["status"]) if run_end and run_end.get("status") else None,
        cause=str(run_end["cause"]) if run_end and run_end.get("cause") else None,
        world_size=ws if isinstance(ws, int) else None,
        steps_completed=len(last),
        final_step=final.step if final else None,
        attempts=(max(attempt_numbers) + 1) if attempt_numbers else 0,
        wall_s=wall,
        productive_s=productive,
        ettr=productive / wall if wall > 0 else 0.0,
        lost_s=sum(r.lost_s for r in restarts),
        faults=faults,
        restarts=tuple(restarts),
        checkpoints_committed=len(committed),
        ckpt_blocking_median_s=_median(list(blocking.values())),
        tokens_per_s_median=_median([s.tokens_per_s for s in steps if s.tokens_per_s is not None]),
        mfu_median=_median([s.mfu for s in steps if s.mfu is not None]),
        final_loss=final.loss if final else None,
        skipped_lines=logs.skipped_lines,
        start_time=t0,
        startup_phases=_phase_marks(
            startup, origin=min([t0, *(float(e["time"]) for e in startup)])
        ),
        straggler_reports=len(straggler_reports),
        straggler_lowest=dict(sorted(lowest.items())),
        evicted_nodes=tuple(
            str(e.get("node")) for e in events if e["kind"] == "straggler_eviction"
        ),
        replica=summarize_replica(events),
    )
