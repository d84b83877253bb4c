"""Tests of the run report (training/runlog/report.py, accounting.py) on hand-built run dirs.

Run: .venv/bin/python -m pytest tests/training/runlog/test_report.py -q
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.runlog.report import (
    RunDirError,
    format_summary,
    main,
    summarize,
    write_report,
)

T0 = 1_000.0


def _write(path: Path, rows: list[dict], truncated_tail: str | None = None) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if truncated_tail is not None:
        text += truncated_tail  # a killed process's half-written line, no newline
    path.write_text(text)


def _step(step: int, end: float, step_time: float, attempt: int, tps: float = 1000.0) -> dict:
    return {
        "time": end,
        "step": step,
        "loss": 10.0 / step,
        "lr": 1e-3,
        "step_time_s": step_time,
        "tokens_per_s": tps,
        "mfu": None,
        "attempt": attempt,
    }


def _ev(t: float, kind: str, rank: int = 0, step: int | None = None, **extra) -> dict:
    return {"time": t, "rank": rank, "kind": kind, "step": step, **extra}


@pytest.fixture
def one_restart(tmp_path: Path) -> Path:
    """Steps 1-10 at 1 s each, a fault after step 10, an in-process restart back to the step-5
    checkpoint, then steps 6-15 again at 0.5 s each; a truncated last metrics line."""
    metrics = [_step(k, T0 + 2 + k, 1.0, 0, tps=1000.0 + k) for k in range(1, 11)]
    # Attempt 1 starts its first step at T0+21: step 6 ends at T0+21.5, step 15 at T0+26.
    metrics += [_step(6 + j, T0 + 21 + 0.5 * (j + 1), 0.5, 1, tps=2000.0) for j in range(10)]
    _write(tmp_path / "metrics.jsonl", metrics, truncated_tail='{"time": 1027.5, "step": 1')
    events = [
        _ev(T0, "run_start", 0, world_size=2, restart_mode="inprocess"),
        _ev(T0, "run_start", 1, world_size=2, restart_mode="inprocess"),
        _ev(T0 + 0.5, "attempt_start", 0, attempt=0),
        _ev(T0 + 7.1, "checkpoint_staged", 0, 5, blocking_s=0.2, engine="nvrx_async"),
        _ev(T0 + 7.1, "checkpoint_staged", 1, 5, blocking_s=0.3, engine="nvrx_async"),
        _ev(T0 + 8.0, "checkpoint_committed", 0, 5, path="ckpt/step_5", write_s=0.9),
        # Ranks log the restart in no fixed order and twice each: one incident.
        _ev(T0 + 13.0, "restart_begin", 0, mode="inprocess"),
        _ev(T0 + 12.5, "fault", 1, 10, fault="exception"),
        _ev(T0 + 13.1, "restart_begin", 1, mode="inprocess"),
        _ev(T0 + 19.0, "restart_end", 0, mode="inprocess", seconds=6.0),
        _ev(T0 + 19.2, "restart_end", 1, mode="inprocess", seconds=6.2),
        _ev(T0 + 19.5, "attempt_start", 0, attempt=1),
        _ev(T0 + 20.0, "checkpoint_load", 0, 5, path="ckpt/step_5", seconds=0.4),
        _ev(T0 + 23.6, "checkpoint_staged", 0, 10, blocking_s=0.5, engine="nvrx_async"),
        _ev(T0 + 23.6, "checkpoint_staged", 1, 10, blocking_s=0.4, engine="nvrx_async"),
        _ev(T0 + 24.0, "checkpoint_committed", 0, 10, path="ckpt/step_10", write_s=1.0),
        _ev(T0 + 24.0, "checkpoint_committed", 1, 10, path="ckpt/step_10", write_s=1.0),
        _ev(T0 + 27.0, "run_end", 0, 15, status="completed", cause="max_steps"),
    ]
    _write(tmp_path / "events.jsonl", events)
    return tmp_path


def test_summary_numbers_for_one_restart(one_restart: Path) -> None:
    s = summarize(run_dir=one_restart)
    assert s.steps_completed == 15
    assert s.final_step == 15
    assert s.attempts == 2
    assert s.wall_s == pytest.approx(27.0)  # run_start T0 -> run_end T0+27
    # Last occurrences: steps 1-5 at 1 s, steps 6-15 at 0.5 s. The first steps 6-10 were lost.
    assert s.productive_s == pytest.approx(10.0)
    assert s.ettr == pytest.approx(10.0 / 27.0)
    assert s.faults == 1
    assert len(s.restarts) == 1
    r = s.restarts[0]
    assert (r.mode, r.fault, r.attempt) == ("inprocess", "exception", 1)
    assert r.begin_s == pytest.approx(12.5)  # the fault, not the (earlier-logged) restart_begin
    assert r.resumed_s == pytest.approx(21.5)
    assert r.downtime_s == pytest.approx(21.0 - 12.5)  # to the start of the first step after
    assert r.recomputed_steps == 5
    assert r.recompute_s == pytest.approx(5.0)
    assert r.lost_s == pytest.approx(13.5)
    assert r.restart_s == pytest.approx(6.2)
    assert s.lost_s == pytest.approx(13.5)
    assert s.checkpoints_committed == 2  # the step-10 commit logged by two ranks counts once
    assert s.ckpt_blocking_median_s == pytest.approx(0.4)  # median of slowest ranks (0.3, 0.5)
    assert s.tokens_per_s_median == pytest.approx((1010.0 + 2000.0) / 2)
    assert s.final_loss == pytest.approx(10.0 / 15)
    assert s.status == "completed"
    assert s.world_size == 2
    assert s.skipped_lines == 1  # the truncated last line


def test_a_commit_known_only_from_its_restore_still_counts(one_restart: Path) -> None:
    """SIGKILL between the step-5 commit record and its line's write: the restart restores
    step 5 from storage, which proves that commit (``proven_commit``). A memory restore
    proves nothing about storage."""
    events_file = one_restart / "events.jsonl"
    rows = [json.loads(line) for line in events_file.read_text().splitlines()]
    rows = [r for r in rows if not (r["kind"] == "checkpoint_committed" and r["step"] == 5)]
    rows.append(_ev(T0 + 20.1, "checkpoint_load", 0, 7, seconds=0.1, source="memory"))
    _write(events_file, rows)
    assert summarize(run_dir=one_restart).checkpoints_committed == 2  # 5 (restored), 10


def test_productive_plus_recompute_is_all_step_time(one_restart: Path) -> None:
    s = summarize(run_dir=one_restart)
    assert s.productive_s + sum(r.recompute_s for r in s.restarts) == pytest.approx(10 + 5)


def test_two_restarts_without_fault_event_and_a_cold_one(tmp_path: Path) -> None:
    """Second incident: only restart_begin (no fault event) -> it begins at restart_begin. Steps
    repeated twice count once as lost per incident, using the latest earlier occurrence."""
    m = [_step(k, T0 + k, 1.0, 0) for k in range(1, 5)]  # steps 1-4 end T0+1..T0+4
    m += [_step(k, T0 + 10 + (k - 2), 2.0, 1) for k in range(3, 6)]  # 3,4,5 end T0+11..13
    m += [_step(k, T0 + 30 + (k - 4), 1.0, 2) for k in range(5, 8)]  # 5,6,7 end T0+31..33
    _write(tmp_path / "metrics.jsonl", m)
    events = [
        _ev(T0, "run_start", 0, world_size=8, restart_mode="injob"),
        _ev(T0 + 4.5, "fault", 3, fault="sigkill"),
        _ev(T0 + 5.0, "restart_begin", 0, mode="injob"),
        _ev(T0 + 13.5, "restart_begin", 0, mode="cold"),
        _ev(T0 + 13.6, "restart_begin", 5, mode="cold"),
        _ev(T0 + 40.0, "run_end", 0, status="completed"),
    ]
    _write(tmp_path / "events.jsonl", events)
    s = summarize(run_dir=tmp_path)
    assert s.steps_completed == 7
    assert s.wall_s == pytest.approx(40.0)
    assert s.productive_s == pytest.approx(1 + 1 + 2 + 2 + 1 + 1 + 1)  # 1,2 | 3,4 | 5,6,7
    first, second = s.restarts
    assert (first.mode, first.fault) == ("injob", "sigkill")
    assert first.downtime_s == pytest.approx(9.0 - 4.5)  # step 3 (2 s) ends T0+11, starts T0+9
    assert (first.recomputed_steps, first.recompute_s) == (2, pytest.approx(2.0))
    assert (second.mode, second.fault) == ("cold", None)
    assert second.begin_s == pytest.approx(13.5)
    assert second.downtime_s == pytest.approx(30.0 - 13.5)
    assert (second.recomputed_steps, second.recompute_s) == (1, pytest.approx(2.0))
    assert s.faults == 1
    assert s.attempts == 3


def test_fault_without_restart_is_a_fault_not_a_restart(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [_step(k, T0 + k, 1.0, 0) for k in range(1, 4)])
    _write(
        tmp_path / "events.jsonl",
        [
            _ev(T0, "run_start", world_size=2),
            _ev(T0 + 3.5, "fault", fault="oom"),
            _ev(T0 + 4.0, "run_end", status="failed", cause="oom"),
        ],
    )
    s = summarize(run_dir=tmp_path)
    assert (s.faults, s.restarts, s.status, s.cause) == (1, (), "failed", "oom")
    assert s.ettr == pytest.approx(3.0 / 4.0)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_write_report_writes_summary_and_png(one_restart: Path) -> None:
    s = write_report(run_dir=one_restart)
    saved = json.loads((one_restart / "summary.json").read_text())
    assert saved["ettr"] == pytest.approx(s.ettr)
    assert saved["restarts"][0]["lost_s"] == pytest.approx(13.5)
    w, h = _png_size(one_restart / "timeline.png")
    assert 800 <= w <= 3000 and 300 <= h <= 2000
    assert (one_restart / "timeline.png").stat().st_size > 10_000  # not a blank canvas


def test_format_summary_mentions_key_numbers(one_restart: Path) -> None:
    text = format_summary(summarize(run_dir=one_restart))
    assert "ETTR" in text and "37.0%" in text  # 10 / 27
    assert "inprocess" in text and "exception" in text and "13.5 s" in text


def test_timeline_is_quick_for_1000_steps(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [_step(k, T0 + k, 1.0, 0) for k in range(1, 1001)])
    ev = [_ev(T0, "run_start", world_size=2)]
    ev += [
        _ev(T0 + k + 0.5, "checkpoint_committed", 0, k, path=f"c{k}") for k in range(50, 1001, 50)
    ]
    _write(tmp_path / "events.jsonl", ev)
    write_report(run_dir=tmp_path)  # warm up matplotlib's import and font cache
    start = time.perf_counter()
    write_report(run_dir=tmp_path)
    assert time.perf_counter() - start < 3.0  # ~0.3 s here; generous for a loaded 2-core box


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "empty_files", "garbage"])
def test_cli_missing_or_empty_run_dir_exits_2(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    if kind != "missing":
        run.mkdir()
    if kind == "empty_files":
        (run / "metrics.jsonl").write_text("")
        (run / "events.jsonl").write_text("")
    if kind == "garbage":
        (run / "metrics.jsonl").write_text('{"time": 1, "st')
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run directory") and str(run) in err
    with pytest.raises(RunDirError):
        summarize(run_dir=run)


def test_cli_as_module(one_restart: Path, tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "training.runlog.report", str(one_restart)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert "ETTR" in ok.stdout and (one_restart / "timeline.png").is_file()
    bad = subprocess.run(
        [sys.executable, "-m", "training.runlog.report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "does not exist" in bad.stderr


def _ph(t: float, phase: str, attempt: int, rank: int = 0, mode: str = "inprocess") -> dict:
    return _ev(t, "restart_phase", rank, phase=phase, attempt=attempt, mode=mode)


@pytest.fixture
def with_phases(one_restart: Path) -> Path:
    """`one_restart` plus the phases of the start-up and of the in-process restart (fault at
    T0+12.5), two ranks each, logged in no fixed order."""
    rows = [
        _ph(T0 + 0.6, "process_group_up", 0, 0),
        _ph(T0 + 0.7, "process_group_up", 0, 1),
        _ph(T0 + 1.8, "model_built", 0, 1),
        _ph(T0 + 1.5, "model_built", 0, 0),
        _ph(T0 + 2.0, "checkpoint_loaded", 0, 0),
        _ph(T0 + 1.9, "checkpoint_loaded", 0, 1),
        _ph(T0 + 3.0, "first_step", 0, 0),
        _ph(T0 + 3.1, "first_step", 0, 1),
        # The restart: rank 1 detects first; no survivors_stopped or processes_up (in-process).
        _ph(T0 + 13.05, "detected", 1, 0),
        _ph(T0 + 12.9, "detected", 1, 1),
        _ph(T0 + 19.3, "rendezvous_done", 1, 1),
        _ph(T0 + 19.0, "rendezvous_done", 1, 0),
        _ph(T0 + 19.6, "process_group_up", 1, 0),
        _ph(T0 + 19.5, "process_group_up", 1, 1),
        _ph(T0 + 19.9, "model_built", 1, 0),
        _ph(T0 + 20.0, "model_built", 1, 1),
        _ph(T0 + 20.9, "checkpoint_loaded", 1, 0),
        _ph(T0 + 20.9, "checkpoint_loaded", 1, 1),
        _ph(T0 + 21.6, "first_step", 1, 1),
        _ph(T0 + 21.5, "first_step", 1, 0),
    ]
    with (one_restart / "events.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return one_restart


def _marks(marks) -> list[tuple[str, float, float, int]]:
    return [(m.phase, round(m.offset_s, 6), round(m.duration_s, 6), m.ranks) for m in marks]


def test_restart_phases_offsets_and_durations(with_phases: Path) -> None:
    s = summarize(run_dir=with_phases)
    (r,) = s.restarts
    # From the fault (T0+12.5): detected by the first rank, every other phase by the last.
    assert _marks(r.phases) == [
        ("detected", 0.4, 0.4, 2),
        ("rendezvous_done", 6.8, 6.4, 2),
        ("process_group_up", 7.1, 0.3, 2),
        ("model_built", 7.5, 0.4, 2),
        ("checkpoint_loaded", 8.4, 0.9, 2),
        ("first_step", 9.1, 0.7, 2),
    ]
    assert r.costliest_phase == "rendezvous_done"
    assert sum(m.duration_s for m in r.phases) == pytest.approx(r.phases[-1].offset_s)
    # first_step is the slowest rank finishing the first step after the restart (rank 0's
    # metrics line for it came 0.1 s earlier); the downtime ends at that step's start.
    assert r.phases[-1].offset_s == pytest.approx(r.resumed_s - r.begin_s + 0.1)
    assert r.downtime_s == pytest.approx(8.5)
    # Start-up: from the run start (T0), attempt 0's events only.
    assert _marks(s.startup_phases) == [
        ("process_group_up", 0.7, 0.7, 2),
        ("model_built", 1.8, 1.1, 2),
        ("checkpoint_loaded", 2.0, 0.2, 2),
        ("first_step", 3.1, 1.1, 2),
    ]
    assert s.phase_totals_s == pytest.approx(
        {
            "detected": 0.4,
            "rendezvous_done": 6.4,
            "process_group_up": 0.3,
            "model_built": 0.4,
            "checkpoint_loaded": 0.9,
            "first_step": 0.7,
        }
    )
    assert list(s.phase_totals_s) == [
        "detected",
        "rendezvous_done",
        "process_group_up",
        "model_built",
        "checkpoint_loaded",
        "first_step",
    ]


def test_phases_without_events_are_empty(one_restart: Path) -> None:
    s = summarize(run_dir=one_restart)
    assert s.restarts[0].phases == () and s.restarts[0].costliest_phase is None
    assert s.startup_phases == () and s.phase_totals_s == {}
    assert "restart phases" not in format_summary(s)


def test_phases_of_a_failed_recovery_in_time_order(tmp_path: Path) -> None:
    """An in-job restart whose first recovery dies too (one incident, attempts 1 and 2): phases
    ordered by time (rendezvous_done is the worker's start, before processes_up), the last
    attempt's times count, the first detection starts it; an attempt-0 event just before the
    fault (another host's clock) stays with the start-up."""
    m = [_step(k, T0 + k, 1.0, 0) for k in range(1, 5)]  # steps 1-4 end T0+1..T0+4
    m += [_step(3, T0 + 18.5, 1.0, 2), _step(4, T0 + 19.5, 1.0, 2)]
    _write(tmp_path / "metrics.jsonl", m)
    events = [
        _ev(T0, "run_start", 0, world_size=2, restart_mode="injob"),
        _ph(T0 + 1.0, "first_step", 0, 0, "injob"),
        _ph(T0 + 4.0, "first_step", 0, 1, "injob"),  # 0.5 s before the fault: start-up's
        _ev(T0 + 4.5, "fault", 1, 4, fault="sigkill"),
        _ph(T0 + 5.0, "detected", 1, 0, "injob"),
        _ev(T0 + 5.0, "restart_begin", 0, mode="injob", attempt=0),
        _ph(T0 + 6.0, "survivors_stopped", 1, 0, "injob"),
        _ph(T0 + 8.0, "rendezvous_done", 1, 0, "injob"),
        _ph(T0 + 8.2, "rendezvous_done", 1, 1, "injob"),
        _ph(T0 + 10.0, "processes_up", 1, 0, "injob"),
        _ph(T0 + 10.5, "processes_up", 1, 1, "injob"),
        _ev(T0 + 11.0, "fault", 0, fault="exception"),
        _ph(T0 + 11.2, "detected", 2, 1, "injob"),
        _ph(T0 + 13.0, "rendezvous_done", 2, 0, "injob"),
        _ph(T0 + 15.0, "processes_up", 2, 0, "injob"),
        _ph(T0 + 15.5, "process_group_up", 2, 0, "injob"),
        _ph(T0 + 16.0, "model_built", 2, 0, "injob"),
        _ph(T0 + 17.0, "checkpoint_loaded", 2, 0, "injob"),
        _ph(T0 + 18.6, "first_step", 2, 0, "injob"),
        _ev(T0 + 20.0, "run_end", 0, 4, status="completed"),
    ]
    _write(tmp_path / "events.jsonl", events)
    s = summarize(run_dir=tmp_path)
    (r,) = s.restarts
    assert (r.mode, r.fault, r.attempt) == ("injob", "sigkill", 2)
    assert r.downtime_s == pytest.approx(17.5 - 4.5)
    assert _marks(r.phases) == [
        ("detected", 0.5, 0.5, 2),
        ("survivors_stopped", 1.5, 1.0, 1),
        ("rendezvous_done", 8.5, 7.0, 2),
        ("processes_up", 10.5, 2.0, 2),
        ("process_group_up", 11.0, 0.5, 1),
        ("model_built", 11.5, 0.5, 1),
        ("checkpoint_loaded", 12.5, 1.0, 1),
        ("first_step", 14.1, 1.6, 1),
    ]
    assert r.costliest_phase == "rendezvous_done"
    assert _marks(s.startup_phases) == [("first_step", 4.0, 4.0, 2)]


def test_phases_in_summary_json_table_and_timeline(with_phases: Path) -> None:
    s = write_report(run_dir=with_phases)
    saved = json.loads((with_phases / "summary.json").read_text())
    r = saved["restarts"][0]
    assert r["costliest_phase"] == "rendezvous_done"
    assert [p["phase"] for p in r["phases"]][:2] == ["detected", "rendezvous_done"]
    assert r["phases"][1]["offset_s"] == pytest.approx(6.8)
    assert r["phases"][1]["duration_s"] == pytest.approx(6.4)
    assert saved["startup_phases"][0] == {
        "phase": "process_group_up",
        "offset_s": pytest.approx(0.7),
        "duration_s": pytest.approx(0.7),
        "ranks": 2,
    }
    assert saved["phase_totals_s"]["rendezvous_done"] == pytest.approx(6.4)
    text = format_summary(s)
    table = text[text.index("restart phases") :].splitlines()
    assert table[1].split() == ["#", "detect", "rdzv", "pg", "model", "ckpt", "step1", "costliest"]
    assert table[2].split() == ["start", "-", "-", "0.70", "1.10", "0.20", "1.10"]
    row = ["1", "0.40", "6.40", "0.30", "0.40", "0.90", "0.70", "rendezvous_done"]
    assert table[3].split() == row
    w, h = _png_size(with_phases / "timeline.png")
    assert (w, h) == (1300, 750)  # the taller layout with the phase bars
    assert (with_phases / "timeline.png").stat().st_size > 10_000


def test_startup_phases_before_run_start_count_from_the_first(tmp_path: Path) -> None:
    """In-job workers log rendezvous_done (their start) and processes_up (imports done) before
    rank 0 logs run_start: the start-up is measured from the earliest of them."""
    _write(tmp_path / "metrics.jsonl", [_step(1, T0 + 3.0, 1.0, 0)])
    events = [
        _ph(T0 - 9.0, "rendezvous_done", 0, 0, "injob"),
        _ph(T0 - 8.9, "rendezvous_done", 0, 1, "injob"),
        _ph(T0 - 0.5, "processes_up", 0, 0, "injob"),
        _ev(T0, "run_start", 0, world_size=2, restart_mode="injob"),
        _ph(T0 + 0.1, "process_group_up", 0, 0, "injob"),
        _ph(T0 + 3.0, "first_step", 0, 0, "injob"),
    ]
    _write(tmp_path / "events.jsonl", events)
    s = summarize(run_dir=tmp_path)
    assert _marks(s.startup_phases) == [
        ("rendezvous_done", 0.1, 0.1, 2),  # from the first worker's start to the last one's
        ("processes_up", 8.5, 8.4, 1),
        ("process_group_up", 9.1, 0.6, 1),
        ("first_step", 12.0, 2.9, 1),
    ]
    assert s.wall_s == pytest.approx(3.0)  # the wall clock still starts at run_start


def test_straggler_reports_and_evictions_in_the_summary(one_restart: Path) -> None:
    """The report shows each node's lowest relative score and the nodes the policy evicted."""
    events = (one_restart / "events.jsonl").read_text()
    extra = [
        _ev(T0 + 5, "straggler_report", step=5, nodes={"node-a": 1.0, "node-b": 0.41}),
        _ev(T0 + 9, "straggler_report", step=10, nodes={"node-a": 0.93, "node-b": 0.12}),
        _ev(T0 + 9, "straggler_eviction", step=10, node="node-b", ranks=[1], score=0.12),
    ]
    (one_restart / "events.jsonl").write_text(events + "".join(json.dumps(e) + "\n" for e in extra))
    summary = summarize(run_dir=one_restart)
    assert summary.straggler_reports == 2
    assert summary.straggler_lowest == {"node-a": 0.93, "node-b": 0.12}
    assert summary.evicted_nodes == ("node-b",)
    text = format_summary(summary)
    assert "lowest: node-b 0.12" in text and "evicted nodes" in text
    assert json.loads(json.dumps(summary.to_json()))["evicted_nodes"] == ["node-b"]


def test_no_straggler_rows_without_reports(one_restart: Path) -> None:
    text = format_summary(summarize(run_dir=one_restart))
    assert "straggler reports" not in text and "evicted nodes" not in text
