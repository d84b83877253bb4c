"""Smoke test of the benchmarks: the fastest path runs and its JSON has the keys others read."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support import run_in_repo


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_quick_checkpoint_benchmark_writes_its_keys(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "BENCH_RESULTS_DIR": str(tmp_path / "results"),
        "BENCH_RUNS_DIR": str(tmp_path / "runs"),
        "OMP_NUM_THREADS": "1",
    }
    proc = run_in_repo(
        [sys.executable, "-m", "bench.run_all", "--quick", "--only", "checkpoint"],
        env=env,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    result = json.loads((tmp_path / "results" / "checkpoint.json").read_text())
    for key in ("nvrx_async_blocking_s", "torch_async_blocking_s", "sync_blocking_s"):
        assert result[key] > 0, key
    assert result["all_committed"], result["problems"]
    assert {t["verdict"] for t in result["targets"]} <= {"PASS", "MISS", "n/a"}
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert summary["failed"] == []
    assert "checkpoint.nvrx_async_blocking_s" in summary["headlines"]
    assert "=== summary" in proc.stdout


def test_goodput_window_counts_only_the_last_occurrence_of_each_step(tmp_path: Path) -> None:
    """Steady-state ETTR: steps after the first one, up to the cut, superseded ones excluded."""
    from bench.goodput import fault_spec, window_stats

    run = tmp_path / "run"
    run.mkdir()
    # Steps 1..50 end at t = 1..50; a fault at 50.5; steps 41.. are redone, ending at t = k + 20.
    steps = [(k, float(k), 0) for k in range(1, 51)] + [(k, k + 20.0, 1) for k in range(41, 90)]
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"time": t, "step": k, "step_time_s": 0.9, "attempt": a}) + "\n"
            for k, t, a in steps
        )
    )
    events = [
        {"time": 0.0, "rank": 0, "kind": "run_start", "world_size": 2},
        {"time": 50.5, "rank": 1, "kind": "fault", "step": 51, "fault": "exception"},
        {"time": 51.0, "rank": 0, "kind": "restart_begin", "mode": "inprocess"},
        {"time": 55.0, "rank": 0, "kind": "attempt_start", "attempt": 1},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    stats = window_stats(run_dir=run, t_first=1.0, window_s=100.0)
    # last occurrences in (1, 101]: steps 2..40 and 41..81, 0.9 s each
    assert stats["productive_s"] == pytest.approx(80 * 0.9)
    assert stats["ettr"] == pytest.approx(0.72)
    assert stats["faults_in_window"] == 1
    (cost,) = stats["fault_costs"]
    assert cost["fault"] == "exception" and cost["resumed"]
    # resumed by step 41 (attempt 1) ending at 61: downtime 60.1 - 50.5; steps 41..50 redone
    assert cost["downtime_s"] == pytest.approx(60.1 - 50.5)
    assert cost["recompute_s"] == pytest.approx(10 * 0.9)
    assert stats["unrecovered"] == 0
    spec = fault_spec(kinds=("exception", "hang"), faults=3, first_s=30.0, every_s=60.0)
    assert spec == "exception@1:30s;hang@1:90s;exception@1:150s"
    from training.faults import parse_faults

    assert [f.after_s for f in parse_faults(spec)] == [30.0, 90.0, 150.0]


def test_goodput_replica_ettr_counts_the_jobs_committed_steps(tmp_path: Path) -> None:
    """The replica comparison's ETTR: each group's step numbers whose last occurrence completed
    in the window, averaged over the groups, x the window's median step time / the window; the
    same faults for the flat modes as trainer faults at the same global ranks."""
    from bench.goodput import (
        committed_work,
        ettr_committed,
        flat_fault_spec,
        replica_fault_schedule,
    )

    groups = [tmp_path / "group-0", tmp_path / "group-1"]
    # Both groups commit steps 1..20 at t = 1..20 (0.5 s each); step 11 is discarded and redone
    # after a 9 s stall (it ends at 30, the later steps 10 s later too); group 1 also logged a
    # first try of step 11 before its restart (superseded: counted once).
    for g, group in enumerate(groups):
        group.mkdir()
        rows = [(k, float(k) if k <= 10 else k + 9.5, 0.5) for k in range(1, 21)]
        if g == 1:
            rows.append((11, 10.9, 0.5))
        (group / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"time": t, "step": k, "step_time_s": st}) + "\n" for k, t, st in rows
            )
        )
    work = committed_work(group_dirs=groups, t_first=1.0, window_s=30.0)
    # (1, 31]: steps 2..10 and 11..21 -> 11..20 end at 20.5..29.5: 19 steps per group.
    assert work["committed_steps_per_group"] == [19, 19]
    assert work["fault_free_step_s"] == 0.5
    assert ettr_committed(work, window_s=30.0) == pytest.approx(19 * 0.5 / 30.0)
    schedule = replica_fault_schedule(faults=3, first_s=30.0, every_s=60.0, ranks_per_group=2)
    assert [(f["kind"], f["group"], f["global_rank"]) for f in schedule] == [
        ("sigkill", 1, 3),
        ("sigstop", 0, 1),
        ("sigkill", 1, 2),
    ]
    assert flat_fault_spec(schedule) == "sigkill@3:30s;sigstop@1:90s;sigkill@2:150s"


def test_restart_hang_detection_from_the_rank_monitors_log(tmp_path: Path) -> None:
    """In-job, the detection of a hang is an NVRx rank monitor's log line (its process writes
    no event of ours): each hang fault takes the first such line after it and before the next
    fault; the lines' local time converts to the events' epoch seconds. A hang with no line
    before the next fault is None, not the next hang's detection."""
    import time

    from bench.restart import hang_detections

    run = tmp_path / "run"
    run.mkdir()
    base = time.mktime(time.strptime("2026-12-04 19:15:31", "%Y-%m-%d %H:%M:%S"))
    events = [
        {"time": base + 0.5, "rank": 0, "kind": "fault", "fault": "hang"},
        {"time": base + 10.0, "rank": 1, "kind": "fault", "fault": "sigkill"},
        {"time": base + 20.0, "rank": 0, "kind": "fault", "fault": "hang"},
        {"time": base + 30.0, "rank": 0, "kind": "fault", "fault": "hang"},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "launcher.log").write_text(
        "[2026-12-04 19:15:33,090] [WARNING] [RankMonServer31091@vm:0] Section 'step' has been "
        "open for 2.07 seconds. Timeout is 2.00 seconds.\n"
        "[2026-12-04 19:15:33,090] [WARNING] [RankMonServer31091@vm:0] FT timeout elapsed.\n"
        "[2026-12-04 19:15:33,099] [WARNING] [RankMonServer31092@vm:1] FT timeout elapsed.\n"
        "[rank0]: RuntimeError: FT timeout elapsed. (a worker's own text, not the monitor's)\n"
        "[2026-12-04 19:15:52,700] [WARNING] [RankMonServer31091@vm:0] FT timeout elapsed.\n"
    )
    detections = hang_detections(run, layer="injob")
    assert detections[0] == pytest.approx(2.09 - 0.5, abs=1e-6)
    assert detections[1] == pytest.approx(1.7, abs=1e-6)
    assert detections[2] is None


def test_goodput_splits_the_time_between_steps_by_what_the_step_before_did() -> None:
    """Saves and snapshots are told apart by their events; a restart's gap (another attempt, a
    repeated step number) and steps outside the window are no steady-state time."""
    from bench.goodput import between_steps
    from training.runlog.accounting import Step

    def step(t: float, n: int, attempt: int = 0) -> Step:
        return Step(
            time=t, step=n, step_time_s=0.1, attempt=attempt, loss=None, tokens_per_s=None, mfu=None
        )

    steps = [
        step(0.10, 1),  # before the window
        step(1.00, 2),
        step(1.11, 3),  # 0.01 s after step 2: other
        step(1.25, 4),  # 0.04 s after step 3, which saved
        step(1.37, 5),  # 0.02 s after step 4, which took a snapshot
        step(5.00, 4, attempt=1),  # a restart: not steady state
        step(5.13, 5, attempt=1),  # 0.03 s: other
        step(9.00, 6, attempt=1),  # after the window
    ]
    events = [  # between the two steps, from either rank
        {"kind": "checkpoint_staged", "step": 3, "time": 1.12},
        {"kind": "checkpoint_staged", "step": 3, "time": 1.13},
        {"kind": "memory_snapshot", "step": 4, "time": 1.26},
    ]
    got = between_steps(steps=steps, events=events, t_first=0.5, t_cut=6.0)
    assert {k: (g["n"], round(g["total_s"], 6)) for k, g in got.items()} == {
        "after_checkpoint": (1, 0.04),
        "after_memory_snapshot": (1, 0.02),
        "other": (2, 0.04),
    }


def test_every_benchmark_run_has_its_corpus_even_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m bench.restart`` from a fresh clone crashed (no data/stdlib: only run_all,
    overhead's and goodput's own mains built it). The command line of every run is where the
    corpus is built: a missing one is built, a present one is left alone."""
    import subprocess

    from bench import common

    built: list[list[str]] = []
    monkeypatch.setattr(common, "CORPUS_DIR", tmp_path / "stdlib")
    monkeypatch.setattr(subprocess, "run", lambda command, **_: built.append(command))
    common.local_command(run_dir=tmp_path / "run", nproc=2)
    assert built and built[0][-3:] == ["--stdlib", "--out", str(tmp_path / "stdlib")], built
    (tmp_path / "stdlib").mkdir()
    (tmp_path / "stdlib" / "meta.json").write_text("{}")
    common.local_command(run_dir=tmp_path / "run", nproc=2)
    assert len(built) == 1, built
