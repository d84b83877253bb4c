"""The restart_phase event schema. Run: .venv/bin/pytest tests/training/test_phases.py -q"""

import json
from pathlib import Path

import pytest

from training.metrics import EventLog
from training.phases import PHASES, PROCESS_GROUP_UP, RESTART_PHASE, emit_phase


def test_emit_phase_writes_one_event_line(tmp_path: Path) -> None:
    events = EventLog(run_dir=tmp_path, rank=1)
    emit_phase(events, phase=PROCESS_GROUP_UP, attempt=2, mode="injob")
    emit_phase(events, phase=PHASES[-1], attempt=2)
    rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == [RESTART_PHASE, RESTART_PHASE]
    assert rows[0]["phase"] == "process_group_up" and rows[0]["attempt"] == 2
    assert rows[0]["mode"] == "injob" and rows[0]["rank"] == 1
    assert rows[1]["phase"] == "first_step" and "mode" not in rows[1]


def test_unknown_phase_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not one of"):
        emit_phase(EventLog(run_dir=tmp_path, rank=0), phase="warmup", attempt=0)
