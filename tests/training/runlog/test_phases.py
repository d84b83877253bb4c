"""The restart_phase event schema. Run: .venv/bin/pytest tests/training/runlog/test_phases.py -q"""

import json
from pathlib import Path

import pytest

from training.runlog.metrics import EventLog
from training.runlog.phases import PHASES, PROCESS_GROUP_UP, RESTART_PHASE, emit_phase


def test_emit_phase_writes_one_event_line(tmp_path: Path) -> None:
    events = EventLog(run_dir=tmp_path, rank=1)
    emit_phase(events, phase=PROCESS_GROUP_UP, attempt=2, mode="injob")
    emit_phase(events, phase=PHASES[-1], attempt=2)
    events.flush()
    rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == [RESTART_PHASE, RESTART_PHASE]
    assert rows[0]["phase"] == "process_group_up" and rows[0]["attempt"] == 2
    assert rows[0]["mode"] == "injob" and rows[0]["rank"] == 1
    assert rows[1]["phase"] == "first_step" and "mode" not in rows[1]


def test_unknown_phase_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not one of"):
        emit_phase(EventLog(run_dir=tmp_path, rank=0), phase="warmup", attempt=0)


def test_phases_written_by_emit_phase_reach_the_summary(tmp_path: Path) -> None:
    """The writer (emit_phase through EventLog, with `at`) and the reader (accounting) agree."""
    from training.runlog.accounting import summarize

    t0 = 5_000.0
    rank0, rank1 = EventLog(run_dir=tmp_path, rank=0), EventLog(run_dir=tmp_path, rank=1)
    rank0.emit("run_start", world_size=2, time=t0)
    metrics = [
        {"time": t0 + 2, "step": 1, "step_time_s": 1.0, "attempt": 0},
        {"time": t0 + 3, "step": 2, "step_time_s": 1.0, "attempt": 0},
        {"time": t0 + 12, "step": 2, "step_time_s": 1.0, "attempt": 1},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    rank1.emit("fault", step=2, fault="exception", time=t0 + 4)
    rank1.emit("restart_begin", mode="inprocess", time=t0 + 4.5)
    for at, phase, ev in [
        (t0 + 4.5, "detected", rank1),
        (t0 + 6.0, "rendezvous_done", rank0),
        (t0 + 7.0, "process_group_up", rank0),
        (t0 + 9.0, "checkpoint_loaded", rank0),
        (t0 + 12.0, "first_step", rank0),
    ]:
        emit_phase(ev, phase=phase, attempt=1, mode="inprocess", at=at)
    rank0.flush()
    (r,) = summarize(run_dir=tmp_path).restarts
    assert [(m.phase, m.offset_s, m.duration_s) for m in r.phases] == [
        ("detected", 0.5, 0.5),
        ("rendezvous_done", 2.0, 1.5),
        ("process_group_up", 3.0, 1.0),
        ("checkpoint_loaded", 5.0, 2.0),
        ("first_step", 8.0, 3.0),
    ]
    assert r.costliest_phase == "first_step"
