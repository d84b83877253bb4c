"""TensorBoard scalars of a run (training/runlog/tensorboard.py) from hand-built run directories.

Run: .venv/bin/python -m pytest tests/training/runlog/test_tensorboard.py -q
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from training.runlog import tensorboard as tb

T0 = 1_000.0


def _step(step: int, end: float, step_time: float, attempt: int) -> dict:
    return {
        "time": end,
        "step": step,
        "loss": 10.0 / step,
        "lr": 1e-3 * attempt + 1e-3,
        "step_time_s": step_time,
        "tokens_per_s": 1000.0 * (attempt + 1),
        "mfu": 0.4,
        "attempt": attempt,
    }


def _ev(t: float, kind: str, rank: int = 0, step: int | None = None, **extra: Any) -> dict:
    return {"time": t, "rank": rank, "kind": kind, "step": step, **extra}


def _ph(t: float, phase: str, attempt: int, rank: int = 0) -> dict:
    return _ev(t, "restart_phase", rank, phase=phase, attempt=attempt, mode="inprocess")


METRICS = [_step(k, T0 + 2 + k, 1.0, 0) for k in range(1, 11)] + [
    _step(6 + j, T0 + 21 + 0.5 * (j + 1), 0.5, 1) for j in range(10)
]
# Up to the fault (T0+12.5), then the restart and the rest.
EVENTS_BEFORE = [
    _ev(T0, "run_start", 0, world_size=2, restart_mode="inprocess"),
    _ph(T0 + 0.7, "process_group_up", 0, 1),
    _ph(T0 + 1.8, "model_built", 0, 0),
    _ph(T0 + 2.0, "checkpoint_loaded", 0, 0),
    _ph(T0 + 3.1, "first_step", 0, 1),
    _ev(T0 + 7.1, "checkpoint_staged", 0, 5, blocking_s=0.2),
    _ev(T0 + 7.1, "checkpoint_staged", 1, 5, blocking_s=0.3),
    _ev(T0 + 8.0, "checkpoint_committed", 0, 5, path="ckpt/step_5", write_s=0.9),
    _ev(T0 + 9.1, "memory_snapshot", 0, 7, blocking_s=0.01),
    _ev(T0 + 9.1, "memory_snapshot", 1, 7, blocking_s=0.02),
]
EVENTS_AFTER = [
    _ev(T0 + 12.5, "fault", 1, 10, fault="exception"),
    _ev(T0 + 13.0, "restart_begin", 0, mode="inprocess"),
    _ph(T0 + 12.9, "detected", 1, 1),
    _ph(T0 + 19.3, "rendezvous_done", 1, 1),
    _ev(T0 + 19.3, "restart_end", 0, mode="inprocess", seconds=6.3),
    _ev(T0 + 19.5, "attempt_start", 0, attempt=1),
    _ph(T0 + 19.6, "process_group_up", 1, 0),
    _ph(T0 + 20.0, "model_built", 1, 1),
    _ph(T0 + 20.9, "checkpoint_loaded", 1, 0),
    _ph(T0 + 21.6, "first_step", 1, 1),
    _ev(T0 + 23.6, "checkpoint_staged", 0, 10, blocking_s=0.5),
    _ev(T0 + 23.6, "checkpoint_staged", 1, 10, blocking_s=0.4),
    _ev(T0 + 24.0, "checkpoint_committed", 0, 10, path="ckpt/step_10", write_s=1.0),
    _ev(T0 + 24.0, "checkpoint_committed", 1, 10, path="ckpt/step_10", write_s=1.2),
    _ev(T0 + 27.0, "run_end", 0, 15, status="completed"),
]


def _lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(_lines(METRICS) + '{"time": 1027.5, "st')  # killed
    (run / "events.jsonl").write_text(_lines(EVENTS_BEFORE + EVENTS_AFTER))
    return run


class RecordingWriter:
    """SummaryWriter's surface, recording what it is given."""

    def __init__(self, *, log_dir: str, sink: list[tuple[str, float, int]]) -> None:
        self.log_dir, self.sink = log_dir, sink
        self.flushes = 0

    def add_scalar(self, tag: str, scalar_value: float, global_step: int, walltime: float) -> None:
        self.sink.append((tag, scalar_value, global_step))

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        pass


def _recording(sink: list[tuple[str, float, int]]):
    return lambda **kw: RecordingWriter(sink=sink, **kw)


def _by_tag(rows: list[tuple[str, float, int]], tag: str) -> list[tuple[int, float]]:
    return [(step, pytest.approx(v)) for t, v, step in rows if t == tag]


def _read_back(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_convert_writes_every_kind_of_scalar(run_dir: Path) -> None:
    import tensorboard  # noqa: F401  (pinned in the lock: missing fails, never skips)

    n = tb.convert(run_dir=run_dir)
    got = _read_back(run_dir / tb.TB_SUBDIR)
    # TensorBoard keeps the last occurrence of a repeated step: the attempt after the restart.
    assert got["train/loss"] == pytest.approx({k: 10.0 / k for k in range(1, 16)})
    assert got["train/step_time_s"] == pytest.approx(
        {k: 1.0 if k <= 5 else 0.5 for k in range(1, 16)}
    )
    assert got["train/tokens_per_s"][15] == pytest.approx(2000.0)
    assert got["train/mfu"][3] == pytest.approx(0.4)
    assert got["train/lr"][12] == pytest.approx(2e-3)
    assert got["train/attempt"][6] == 1
    # The slowest rank's stall and write per checkpoint.
    assert got["checkpoint/blocking_s"] == pytest.approx({5: 0.3, 10: 0.5})
    assert got["checkpoint/write_s"] == pytest.approx({5: 0.9, 10: 1.2})
    assert got["checkpoint/memory_snapshot_s"] == pytest.approx({7: 0.02})
    # Restart 1: fault T0+12.5, first step after it starts T0+21.
    assert got["restart/downtime_s"] == pytest.approx({1: 8.5})
    assert got["restart/recompute_s"] == pytest.approx({1: 5.0})
    assert got["restart/lost_s"] == pytest.approx({1: 13.5})
    assert got["restart_phase/detected_s"] == pytest.approx({1: 0.4})
    assert got["restart_phase/rendezvous_done_s"] == pytest.approx({1: 6.4})
    assert got["restart_phase/first_step_s"] == pytest.approx({1: 0.7})
    assert got["startup_phase/model_built_s"] == pytest.approx({0: 1.1})
    assert got["run/ettr"] == pytest.approx({15: 10.0 / 27.0})
    assert n == 20 * 6 + 4 + 1 + 3 + 6 + 4 + 1  # steps, checkpoints, snapshot, restart, phases
    # A second conversion replaces the first (no doubled points, one event file).
    assert tb.convert(run_dir=run_dir) == n
    assert len(list((run_dir / tb.TB_SUBDIR).glob("events.out.tfevents.*"))) == 1
    assert _read_back(run_dir / tb.TB_SUBDIR) == got


def test_tailer_reads_incrementally_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    sink: list[tuple[str, float, int]] = []
    tailer = tb.Tailer(run_dir=run, writer_factory=_recording(sink), settle_s=0.0)
    assert tailer.poll() == 0  # nothing there yet: no writer, no files
    assert not (run / tb.TB_SUBDIR).exists()
    first = [json.dumps(m) for m in METRICS[:3]]
    # The fourth line is being written: it waits for the next poll.
    (run / "metrics.jsonl").write_text("\n".join(first) + "\n" + json.dumps(METRICS[3])[:20])
    (run / "events.jsonl").write_text(_lines(EVENTS_BEFORE))
    tailer.poll()
    assert _by_tag(sink, "train/loss") == [(1, 10.0), (2, 5.0), (3, 10.0 / 3)]
    assert _by_tag(sink, "checkpoint/blocking_s") == [(5, 0.3)]  # settle_s=0: drained now
    assert _by_tag(sink, "startup_phase/first_step_s") == [(0, 1.1)]
    assert (run / tb.TB_SUBDIR / tb.STATE_FILE).is_file()
    # The rest of line 4 and the steps up to the fault; then a new process takes over.
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(METRICS[3])[20:] + "\n" + _lines(METRICS[4:10]))
    tailer.poll()
    assert [s for t, _, s in sink if t == "train/loss"] == list(range(1, 11))
    tailer.close()

    sink2: list[tuple[str, float, int]] = []
    again = tb.Tailer(run_dir=run, writer_factory=_recording(sink2), settle_s=0.0)
    assert again.state.metrics_offset == (run / "metrics.jsonl").stat().st_size
    with (run / "events.jsonl").open("a") as f:
        f.write(_lines(EVENTS_AFTER[:6]))  # the restart, not resumed yet
    again.poll()
    assert not [t for t, _, _ in sink2 if t.startswith("restart")]  # still down
    with (run / "metrics.jsonl").open("a") as f:
        f.write(_lines(METRICS[10:]))
    with (run / "events.jsonl").open("a") as f:
        f.write(_lines(EVENTS_AFTER[6:]))
    again.poll()
    again.close()
    # Nothing the first tailer wrote is written again; the restart once, with its phases.
    assert [s for t, _, s in sink2 if t == "train/loss"] == list(range(6, 16))
    assert _by_tag(sink2, "restart/downtime_s") == [(1, 8.5)]
    assert _by_tag(sink2, "restart_phase/rendezvous_done_s") == [(1, 6.4)]
    assert not [t for t, _, _ in sink2 if t.startswith("startup_phase")]
    assert _by_tag(sink2, "checkpoint/write_s") == [(10, 1.2)]
    assert _by_tag(sink2, "run/ettr") == [(15, 10.0 / 27.0)]


def test_tailer_waits_for_the_other_ranks(run_dir: Path) -> None:
    """With a settle time, a checkpoint's stall and a restart wait for every rank's report."""
    sink: list[tuple[str, float, int]] = []
    tailer = tb.Tailer(run_dir=run_dir, writer_factory=_recording(sink), settle_s=60.0)
    tailer.poll()
    assert _by_tag(sink, "train/loss")  # steps go out at once
    assert not [t for t, _, _ in sink if t.startswith(("checkpoint/", "restart", "startup"))]
    tailer.close()  # the end writes what is held back
    assert _by_tag(sink, "checkpoint/blocking_s") == [(5, 0.3), (10, 0.5)]
    assert _by_tag(sink, "restart/lost_s") == [(1, 13.5)]


def test_start_tailer_runs_in_a_thread_on_rank_0(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tensorboard  # noqa: F401  (pinned in the lock: missing fails, never skips)

    monkeypatch.setattr(tb, "_ACTIVE", {})
    assert tb.start_tailer(run_dir=run_dir, rank=1) is None
    tailer = tb.start_tailer(run_dir=run_dir, rank=0, poll_s=0.05)
    assert tailer is not None
    assert tb.start_tailer(run_dir=run_dir, rank=0) is tailer  # once per process (in-process)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / tb.TB_SUBDIR / tb.STATE_FILE).is_file():
            assert time.monotonic() < deadline, "the tailer wrote nothing"
            time.sleep(0.05)
        # This process stops being rank 0 (ranks reassigned): its tailer stops and flushes.
        assert tb.start_tailer(run_dir=run_dir, rank=1) is None
        assert tailer._thread is None
    finally:
        tailer.close()
        atexit.unregister(tailer.close)
    assert _read_back(run_dir / tb.TB_SUBDIR)["train/loss"][15] == pytest.approx(10.0 / 15)


def test_disabled_by_env(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tb, "_ACTIVE", {})
    monkeypatch.setenv(tb.DISABLE_ENV, "0")
    assert tb.start_tailer(run_dir=run_dir, rank=0) is None


def test_without_tensorboard_one_line_and_nothing_else(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # What an environment without the package looks like to an import.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(tb, "_ACTIVE", {})
    monkeypatch.setattr(tb, "_SAID_MISSING", set())
    assert not tb.tensorboard_installed()
    assert tb.summary_writer_class() is None
    assert tb.start_tailer(run_dir=run_dir, rank=0) is None
    assert tb.start_tailer(run_dir=run_dir, rank=0) is None  # an in-process restart: silent
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensorboard: not installed" in err
    assert tb.main([str(run_dir)]) == 1
    assert "not installed" in capsys.readouterr().err
    assert not (run_dir / tb.TB_SUBDIR).exists()


def test_cli(run_dir: Path, tmp_path: Path) -> None:
    import tensorboard  # noqa: F401  (pinned in the lock: missing fails, never skips)

    ok = subprocess.run(
        [sys.executable, "-m", "training.runlog.tensorboard", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "wrote 139 scalars" in ok.stdout
    assert list((run_dir / tb.TB_SUBDIR).glob("events.out.tfevents.*"))
    assert tb.main([str(tmp_path / "nope")]) == 2


def test_straggler_scores_become_scalars(run_dir: Path) -> None:
    rows = [
        _ev(
            T0 + 8,
            "straggler_report",
            step=5,
            scores=[
                {"rank": 0, "node": "node-a", "score": 1.0},
                {"rank": 1, "node": "node-b", "score": 0.25},
                {"rank": 2, "node": "node-b", "score": None},  # nothing timed
            ],
            nodes={"node-a": 1.0, "node-b": 0.25},
        ),
        _ev(T0 + 9, "straggler_eviction", step=5, node="node-b", ranks=[1]),
    ]
    with (run_dir / "events.jsonl").open("a") as f:
        f.write(_lines(rows))
    sink: list[tuple[str, float, int]] = []
    tb.Tailer(run_dir=run_dir, writer_factory=_recording(sink)).close()
    assert _by_tag(sink, "straggler/rank_0") == [(5, 1.0)]
    assert _by_tag(sink, "straggler/rank_1") == [(5, 0.25)]
    assert _by_tag(sink, "straggler/rank_2") == []
    assert _by_tag(sink, "straggler/node/node-b") == [(5, 0.25)]
    assert _by_tag(sink, "straggler/evicted") == [(5, 1.0)]
