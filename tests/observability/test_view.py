"""The exporter's view of a run directory (training/observe/view.py), on real files written the way
the ranks write them (`append_jsonl`), with a fake sysfs tree for EFA (the kernel's layout).

    .venv/bin/pytest tests/observability/test_view.py -q
"""

from __future__ import annotations

from pathlib import Path

from training.observe.catalog import METRICS, STRAGGLER_EVENT
from training.observe.view import RunView, restart_cause
from training.runlog.files import EVENTS_FILE, METRICS_FILE, append_jsonl


def _view(run_dir: Path, **overrides) -> RunView:
    args = dict(
        run_dir=run_dir,
        job="llama",
        node=0,
        nproc_per_node=2,
        reporter=True,
        stall_factor=10.0,
        stall_floor_s=60.0,
        checkpoint_interval=4,
        info={"recipe": "debug_cpu", "restart_mode": "injob"},
        efa_root=run_dir / "no-sysfs",
        summary_every_s=0.0,
    )
    args.update(overrides)
    return RunView(**args)


def _values(view: RunView) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "training_job"))): s.value
        for s in view.samples()
    }


def _step(run_dir: Path, step: int, *, t: float, attempt: int = 0, dt: float = 0.5) -> None:
    append_jsonl(
        run_dir / METRICS_FILE,
        {
            "time": t,
            "step": step,
            "loss": 5.0 - step / 10,
            "lr": 1e-3,
            "step_time_s": dt,
            "tokens_per_s": 1000.0,
            "mfu": None,
            "attempt": attempt,
        },
    )


def _event(run_dir: Path, kind: str, *, t: float, rank: int = 0, **extra) -> None:
    append_jsonl(run_dir / EVENTS_FILE, {"time": t, "rank": rank, "kind": kind, **extra})


def test_steps_checkpoints_and_thresholds(tmp_path: Path) -> None:
    _event(tmp_path, "run_start", t=100.0, world_size=4, restart_mode="injob")
    _event(tmp_path, "attempt_start", t=100.5, attempt=0)
    for step in range(1, 9):
        _step(tmp_path, step, t=101.0 + step)
    _event(tmp_path, "checkpoint_staged", t=105.1, step=4, blocking_s=0.2, rank=0)
    _event(tmp_path, "checkpoint_staged", t=105.2, step=4, blocking_s=0.3, rank=1)
    _event(tmp_path, "checkpoint_committed", t=106.0, step=4, write_s=1.5, path="p4")
    values = _values(_view(tmp_path))
    assert values[("training_steps_total", ())] == 8
    assert values[("training_step", ())] == 8
    assert values[("training_last_step_timestamp_seconds", ())] == 109.0
    assert values[("training_last_progress_timestamp_seconds", ())] == 109.0
    assert values[("training_tokens_total", ())] == 8 * 1000.0 * 0.5
    assert values[("training_step_duration_calibrated_seconds", ())] == 0.5
    # max(floor 60 s, 10 x 0.5 s)
    assert values[("training_stall_threshold_seconds", ())] == 60.0
    assert values[("training_checkpoint_last_commit_step", ())] == 4
    assert values[("training_checkpoint_commit_seconds", ())] == 1.5
    assert values[("training_checkpoint_save_blocking_seconds", ())] == 0.3  # the slowest rank
    assert values[("training_checkpoint_interval_steps", ())] == 4
    assert values[("training_run_active", ())] == 1
    info = [k for k in values if k[0] == "training_info"]
    assert info == [
        (
            "training_info",
            (("recipe", "debug_cpu"), ("restart_mode", "injob"), ("world_size", "4")),
        )
    ]
    assert ("training_mfu_ratio", ()) not in values  # CPU: no peak FLOP/s, no MFU
    assert 0 < values[("training_ettr_ratio", ())] <= 1


def test_the_threshold_follows_the_calibrated_step_time(tmp_path: Path) -> None:
    for step in range(1, 20):
        _step(tmp_path, step, t=float(step * 9), dt=9.0)
    values = _values(_view(tmp_path))
    assert values[("training_stall_threshold_seconds", ())] == 90.0  # 10 x 9 s > 60 s floor


def test_restarts_by_layer_and_cause_and_their_counters_never_go_back(tmp_path: Path) -> None:
    _event(tmp_path, "run_start", t=0.0, world_size=2)
    _event(tmp_path, "attempt_start", t=0.1, attempt=0)
    for step in range(1, 5):
        _step(tmp_path, step, t=float(step))
    # An injected exception, recovered in-process.
    _event(tmp_path, "fault", t=4.5, rank=1, fault="exception", step=5)
    _event(tmp_path, "restart_begin", t=4.6, rank=1, mode="inprocess", error="RuntimeError: x")
    _event(tmp_path, "restart_end", t=5.0, rank=1, mode="inprocess", attempt=1)
    for step in range(5, 9):
        _step(tmp_path, step, t=5.0 + step, attempt=1)
    view = _view(tmp_path)
    values = _values(view)
    key = ("training_restarts_total", (("cause", "exception"), ("layer", "inprocess")))
    assert values[key] == 1
    assert values[("training_faults_total", (("cause", "exception"), ("node", "0")))] == 1
    # A hang caught by the watchdog, then a rank lost without a word (in-job).
    _event(tmp_path, "hang_detected", t=14.0, rank=0, mode="inprocess", attempt=1)
    _event(tmp_path, "restart_begin", t=14.1, rank=0, mode="inprocess", error="HangError: y")
    _event(tmp_path, "restart_end", t=15.0, rank=0, mode="inprocess", attempt=2)
    _step(tmp_path, 9, t=16.0, attempt=2)
    _event(tmp_path, "restart_begin", t=17.0, rank=0, mode="injob", attempt=2)
    _event(tmp_path, "restart_end", t=20.0, rank=0, mode="injob", attempt=3)
    _step(tmp_path, 10, t=21.0, attempt=3)
    values = _values(view)
    assert values[("training_restarts_total", (("cause", "hang"), ("layer", "inprocess")))] == 1
    assert values[("training_restarts_total", (("cause", "unknown"), ("layer", "injob")))] == 1
    assert values[key] == 1
    assert values[("training_faults_total", (("cause", "hang"), ("node", "0")))] == 1
    lost = values[("training_restart_lost_seconds_total", (("layer", "injob"),))]
    assert lost > 0
    assert values[("training_attempt", ())] == 3


def test_restart_cause_names_the_exception_type() -> None:
    begin = {"kind": "restart_begin", "error": "CheckpointError: every committed ..."}
    assert restart_cause([begin]) == "CheckpointError"
    assert restart_cause([{"kind": "restart_begin", "error": "odd text"}]) == "unknown"
    assert restart_cause([begin, {"kind": "fault", "fault": "sigkill"}]) == "sigkill"


def test_each_node_serves_its_own_ranks_and_only_node_0_the_job(tmp_path: Path) -> None:
    _event(tmp_path, "run_start", t=0.0, world_size=4)
    _step(tmp_path, 1, t=1.0)
    _event(tmp_path, "fault", t=1.5, rank=3, fault="sigkill", step=2)

    # The detector's reports (rank 0 writes every rank's score): node 1 serves ranks 2 and 3.
    def report(t: float, step: int, score_2: float) -> None:
        scores = [
            {"rank": 0, "node": "a", "score": 1.0},
            {"rank": 2, "node": "b", "score": score_2},
            {"rank": 3, "node": "b", "score": None},
        ]
        _event(tmp_path, STRAGGLER_EVENT, t=t, rank=0, step=step, threshold=0.5, scores=scores)

    report(1.6, 2, 0.3)
    node1_slow = _values(_view(tmp_path, node=1, reporter=False))
    assert node1_slow[("training_straggler_flagged", (("node", "1"), ("rank", "2")))] == 1
    report(1.7, 3, 0.95)
    node0 = _values(_view(tmp_path, node=0, reporter=True))
    node1 = _values(_view(tmp_path, node=1, reporter=False))
    assert not any(name.startswith("training_faults") for name, _ in node0)
    assert node1[("training_faults_total", (("cause", "sigkill"), ("node", "1")))] == 1
    # The newest score of each rank.
    assert node1[("training_straggler_score", (("node", "1"), ("rank", "2")))] == 0.95
    assert node1[("training_straggler_flagged", (("node", "1"), ("rank", "2")))] == 0
    # Another node's rank and a rank that timed nothing are not served here.
    served = {dict(labels)["rank"] for name, labels in node1 if name == "training_straggler_score"}
    assert served == {"2"}
    assert ("training_steps_total", ()) in node0
    assert all(METRICS[name].scope == "node" for name, _ in node1), (
        "a non-reporting node served a job-level figure"
    )


def test_a_torn_line_is_read_once_complete(tmp_path: Path) -> None:
    _step(tmp_path, 1, t=1.0)
    view = _view(tmp_path)
    assert _values(view)[("training_steps_total", ())] == 1
    with open(tmp_path / METRICS_FILE, "a") as handle:
        handle.write('{"time": 2.0, "step": 2, "step_time_s": 0.5, "atte')
    assert _values(view)[("training_steps_total", ())] == 1
    with open(tmp_path / METRICS_FILE, "a") as handle:
        handle.write('mpt": 0}\n')
    assert _values(view)[("training_steps_total", ())] == 2


def test_a_restarted_exporter_serves_the_same_totals(tmp_path: Path) -> None:
    _event(tmp_path, "run_start", t=0.0, world_size=2)
    for step in range(1, 6):
        _step(tmp_path, step, t=float(step))
    _event(tmp_path, "checkpoint_committed", t=3.0, step=2, write_s=0.1)
    first = _view(tmp_path)
    first.samples()
    _step(tmp_path, 6, t=6.0)
    assert _values(first) == _values(_view(tmp_path))


def test_a_reused_run_directory_starts_over(tmp_path: Path) -> None:
    for step in range(1, 6):
        _step(tmp_path, step, t=float(step))
    view = _view(tmp_path)
    assert _values(view)[("training_steps_total", ())] == 5
    (tmp_path / METRICS_FILE).unlink()
    _step(tmp_path, 1, t=100.0)
    assert _values(view)[("training_steps_total", ())] == 1


def test_the_run_ends_and_is_no_longer_active(tmp_path: Path) -> None:
    _event(tmp_path, "run_start", t=0.0, world_size=2)
    _step(tmp_path, 1, t=1.0)
    view = _view(tmp_path)
    assert _values(view)[("training_run_active", ())] == 1
    _event(tmp_path, "run_end", t=2.0, status="completed", cause=None)
    assert _values(view)[("training_run_active", ())] == 0


def test_restores_by_source(tmp_path: Path) -> None:
    _event(tmp_path, "checkpoint_load", t=1.0, rank=0, step=8, path="p", seconds=2.0)
    _event(tmp_path, "checkpoint_load", t=1.1, rank=1, step=8, path="p", seconds=2.5)
    _event(
        tmp_path,
        "checkpoint_load",
        t=5.0,
        rank=0,
        step=10,
        path="memory",
        seconds=0.1,
        source="memory",
    )
    values = _values(_view(tmp_path))
    assert values[("training_checkpoint_restore_seconds", (("source", "storage"),))] == 2.5
    assert values[("training_checkpoint_restore_seconds", (("source", "memory"),))] == 0.1
    assert values[("training_checkpoint_restores_total", (("source", "storage"),))] == 1
    # A restore from storage proves that checkpoint: the overdue alert counts from it.
    assert values[("training_checkpoint_last_commit_step", ())] == 8


def test_a_commit_whose_event_a_sigkill_lost_is_counted_from_its_restore(tmp_path: Path) -> None:
    """SIGKILL between the commit record and its event's write: the restart restores that
    checkpoint from storage, and the commit still counts once (seen in CI: 5 of 6 counted)."""
    for step in (4, 8, 16):
        _event(tmp_path, "checkpoint_committed", t=float(step), step=step, write_s=1.0, path="p")
    # Step 12 was committed but its line was lost; steps 8 and 12 are each restored once.
    _event(tmp_path, "checkpoint_load", t=9.0, rank=0, step=8, path="p8", seconds=1.0)
    _event(tmp_path, "checkpoint_load", t=13.0, rank=0, step=12, path="p12", seconds=1.0)
    _event(tmp_path, "checkpoint_load", t=13.5, rank=0, step=10, seconds=0.1, source="memory")
    values = _values(_view(tmp_path))
    assert values[("training_checkpoints_committed_total", ())] == 4  # 4, 8, 12, 16
    assert values[("training_checkpoint_last_commit_step", ())] == 16


def test_efa_counters_of_this_node(tmp_path: Path) -> None:
    """The EFA driver's sysfs layout: /sys/class/infiniband/<dev>/ports/1/hw_counters/<name>."""
    sysfs = tmp_path / "sys"
    for device, tx in (("rdmap16s27", 1000), ("rdmap32s27", 3000)):
        counters = sysfs / device / "ports" / "1" / "hw_counters"
        counters.mkdir(parents=True)
        (counters / "tx_bytes").write_text(f"{tx}\n")
        (counters / "rx_bytes").write_text("7\n")
        (counters / "rdma_read_bytes").write_text("11\n")
        # rdma_write_bytes missing: an older driver; skipped, not zero
    values = _values(_view(tmp_path, node=1, reporter=False, efa_root=sysfs))
    assert (
        values[("efa_transmitted_bytes_total", (("device", "rdmap16s27"), ("node", "1")))] == 1000
    )
    assert (
        values[("efa_transmitted_bytes_total", (("device", "rdmap32s27"), ("node", "1")))] == 3000
    )
    assert values[("efa_received_bytes_total", (("device", "rdmap32s27"), ("node", "1")))] == 7
    assert not any(name == "efa_rdma_write_bytes_total" for name, _ in values)
