"""Real faults under every restart layer: the run completes and ends bit-identical.

Run: ``.venv/bin/pytest tests/training/resilience/test_resilience.py`` (real 2- and 4-rank jobs
through ``python -m training.launch.local``: torchrun for in-process restart, NVRx's ft_launcher for
in-job restart; real exceptions, hangs, SIGKILL, SIGABRT, SIGSEGV, SIGTERM, crashes during the
checkpoint write and damaged shards; about 5-6 minutes on 2 cores).

Every faulty run is compared with one fault-free run of the same seed and length: the final
model *and optimizer* state must be bit-identical (``torch.equal``), which proves that the
resumed runs replayed exactly the steps they lost, from the right checkpoint, with the right
data position and RNG. Several faults share a run to keep the suite short.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from support import (
    TINY_MODEL,
    events,
    final_state,
    launch_local,
    read_metrics,
    tail,
)
from support import (
    assert_identical as support_assert_identical,
)

from training import exits

STEPS = 24
COMMON = (
    *TINY_MODEL,
    f"--train.steps={STEPS}",
    "--checkpoint.interval=8",
    "--train.log_every=8",
    # Short detection times so hangs are caught in seconds, not minutes.
    "--resilience.soft_timeout_s=6",
    "--resilience.hard_timeout_s=20",
    "--resilience.heartbeat_timeout_s=8",
    "--resilience.step_section_timeout_s=8",
    "--resilience.checkpoint_section_timeout_s=30",
    "--parallel.pg_timeout_s=60",
)


def launch(run_dir: Path, corpus: Path, *args: str, nproc: int = 2, timeout: float = 200):
    return launch_local(run_dir, corpus, *COMMON, *args, nproc=nproc, timeout=timeout)


def assert_identical(state: dict, reference: dict) -> None:
    support_assert_identical(state, reference, steps=STEPS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = launch(run_dir, corpus)
    assert proc.returncode == 0, tail(proc.log)
    return final_state(run_dir)


# name: (restart layer, fault spec, extra arguments). Damaged-shard runs checkpoint every 4
# steps so that an older committed checkpoint exists to fall back to when the newest is damaged
# (commits are asynchronous and can trail the save step by a few steps).
FAULT_RUNS = {
    # in-process restart: every rank survives; the Wrapper restarts the function in place.
    "inprocess-exception-hang-oom": ("inprocess", "exception@1:6;hang@0:13;oom@1:20", ()),
    # No memory snapshots here: a snapshot is taken at save steps too, and at equal steps the
    # pod's memory is read before storage, so the damaged checkpoint would never be read.
    "inprocess-compute-hang-damaged-shards": (
        "inprocess",
        "hang_compute@1:5;corrupt_shard@0:14;truncate_shard@1:22",
        ("--checkpoint.interval=4", "--checkpoint.memory_interval=0"),
    ),
    # in-job restart: ft_launcher kills the survivors and spawns new workers.
    # The abort comes a step after the snapshot of step 10, not right after it: a snapshot is
    # complete once its background publish (CRC32, meta) is, and an abort at the next step's
    # start (1.5 ms later on this machine) cut rank 0's publish short: no step was complete in
    # pod memory, so that restart had nothing newer than storage to restore.
    "injob-sigkill-abort-segfault-oom": (
        "injob",
        "sigkill@1:5;abort@0:12;segfault@1:18;oom@0:22",
        (),
    ),
    "injob-exception-hang-crash-while-writing": (
        "injob",
        "exception@0:4;hang@1:11;ckpt_crash@0:16:staged",
        (),
    ),
    # nested: in-process restart inside ft_launcher. Exceptions and hangs recover in the same
    # processes; a killed or frozen rank is respawned by the in-job layer.
    "nested-exception-hang-sigkill-sigstop": (
        "nested",
        "exception@1:4;hang@0:9;sigkill@1:14;sigstop@0:19",
        (),
    ),
    "injob-crash-before-commit-damaged-sigterm": (
        "injob",
        "ckpt_crash@1:8:written;ckpt_crash@0:12:commit;corrupt_shard@1:19;sigterm@0:22",
        ("--checkpoint.interval=4",),
    ),
}


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", list(FAULT_RUNS))
def test_fault_matrix_ends_bit_identical(
    name: str, tmp_path: Path, corpus: Path, reference: dict
) -> None:
    layer, faults, extra = FAULT_RUNS[name]
    run_dir = tmp_path / "run"
    # The pod's /dev/shm: the memory snapshots (the recipe's checkpoint.memory_interval) live
    # there, in a directory of this test's own.
    pod_memory = Path("/dev/shm") / f"test-resilience-{uuid.uuid4().hex[:12]}"
    try:
        proc = launch(
            run_dir,
            corpus,
            f"--restart={layer}",
            f"--faults={faults}",
            "--resilience.max_restarts=6",
            f"--checkpoint.pod_memory_dir={pod_memory}",
            *extra,
            timeout=360,
        )
        assert proc.returncode == 0, tail(proc.log)
        # A run that ends cleanly leaves nothing in the pod's memory.
        left = [p for p in pod_memory.rglob("*") if p.is_file()] if pod_memory.exists() else []
        assert left == [], left
    finally:
        shutil.rmtree(pod_memory, ignore_errors=True)
    fired = [e for e in events(run_dir) if e["kind"] == "fault"]
    assert len(fired) == faults.count(";") + 1, f"not every fault fired: {fired}"
    assert_identical(final_state(run_dir), reference)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert len(summary["restarts"]) >= 1
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert max(steps) == STEPS and set(steps) == set(range(1, STEPS + 1))
    # Every restart layer records the phases it passes through (training/runlog/phases.py).
    phases = {e["phase"] for e in events(run_dir) if e["kind"] == "restart_phase"}
    expected = {"detected", "rendezvous_done", "process_group_up", "model_built"}
    expected |= {"checkpoint_loaded", "first_step"}
    if layer != "inprocess":
        expected.add("processes_up")
    if layer == "injob":
        expected.add("survivors_stopped")
    assert expected <= phases, f"missing phases: {expected - phases}"
    # A fault can strike before the first commit: not every case resumes.
    assert_init_skipped_on_resume(events(run_dir), resumed_at_least_once=False)
    loads = {(e["step"], e["source"]) for e in events(run_dir) if e["kind"] == "checkpoint_load"}
    if name in POD_MEMORY_RESTORES:
        # Restarts after a fault past step 10 restore the snapshot of step 10 from the pod's
        # memory (the recipe's checkpoint.memory_interval), newer than the committed step 8:
        # in process (hang@13), and in new processes after a SIGKILLed rank (injob: abort@12
        # after sigkill@5; nested: sigkill@14).
        assert (10, "pod_memory") in loads, loads
    if "corrupt_shard" in faults or "truncate_shard" in faults:
        rejected = [e for e in events(run_dir) if e["kind"] == "checkpoint_rejected"]
        assert rejected, "the damaged newest checkpoint must be rejected"
        assert "falling back to the previous" in proc.log.read_text()
    if "ckpt_crash" in faults:
        # The crashed save never got a commit record, so it was never loaded: every load from
        # storage came from a checkpoint that the log shows committed before that load (a
        # pod-memory snapshot is no checkpoint: its own meta and CRC32 vouch for it).
        log = events(run_dir)
        for index, event in enumerate(log):
            if event["kind"] == "checkpoint_load" and event["source"] == "storage":
                committed_before = {
                    e["step"] for e in log[:index] if e["kind"] == "checkpoint_committed"
                }
                assert event["step"] in committed_before, f"loaded uncommitted {event}"


POD_MEMORY_RESTORES = (
    "inprocess-exception-hang-oom",
    "injob-sigkill-abort-segfault-oom",
    "nested-exception-hang-sigkill-sigstop",
)


def assert_init_skipped_on_resume(log: list[dict], *, resumed_at_least_once: bool) -> None:
    """Per rank, every attempt that loaded a checkpoint built its model without initialising
    the weights, and every attempt that loaded none initialised them."""
    per_rank: dict[int, list[tuple[bool, bool]]] = {}
    for event in log:
        attempts = per_rank.setdefault(event["rank"], [])
        if event["kind"] == "restart_phase" and event["phase"] == "model_built":
            attempts.append((event["weights_initialized"], False))
        elif event["kind"] == "checkpoint_load" and attempts:
            attempts[-1] = (attempts[-1][0], True)
    resumed = [a for attempts in per_rank.values() for a in attempts if a[1]]
    assert resumed or not resumed_at_least_once, "no attempt resumed from a checkpoint"
    for rank, attempts in per_rank.items():
        for initialized, loaded in attempts:
            assert initialized != loaded, f"rank {rank}: initialized={initialized}, loaded={loaded}"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sigterm_checkpoints_then_cold_restart_resumes(
    tmp_path: Path, corpus: Path, reference: dict
) -> None:
    """Drain/eviction: SIGTERM makes every rank take a final committed checkpoint at the same
    step and exit 143; the relaunched job resumes from it."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, corpus, "--restart=none", "--faults=sigterm@1:13", "--cold-restarts=1")
    assert proc.returncode == 0, tail(proc.log)
    log = events(run_dir)
    preempted = [e for e in log if e["kind"] == "run_end" and e.get("status") == "preempted"]
    assert preempted and preempted[0]["step"] == 13
    assert any(e["kind"] == "checkpoint_committed" and e["step"] == 13 for e in log)
    assert any(e["kind"] == "checkpoint_load" and e["step"] == 13 for e in log)
    assert_init_skipped_on_resume(log, resumed_at_least_once=True)
    assert_identical(final_state(run_dir), reference)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layer", ["inprocess", "injob"])
def test_fault_on_every_attempt_stops_at_the_cap(layer: str, tmp_path: Path, corpus: Path) -> None:
    run_dir = tmp_path / "run"
    kind = "exception" if layer == "inprocess" else "sigkill"
    proc = launch(
        run_dir,
        corpus,
        f"--restart={layer}",
        f"--faults=always:{kind}@1:5",
        "--resilience.max_restarts=2",
        timeout=240,
    )
    assert proc.returncode != 0
    fired = [e for e in events(run_dir) if e["kind"] == "fault"]
    assert 2 <= len(fired) <= 3, f"expected the cap to stop it after 3 attempts: {len(fired)}"
    text = proc.log.read_text()
    if layer == "inprocess":
        assert "in-process restart gave up after 2 restart(s)" in text
        ends = [e for e in events(run_dir) if e["kind"] == "run_end" and e["rank"] == 0]
        assert ends and ends[-1]["status"] == "failed"
    else:
        assert "no progress" in text or "exit code" in text


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_four_rank_checkpoint_resumes_on_two_ranks(tmp_path: Path, corpus: Path) -> None:
    """Same global batch (4x2 and 2x4): a 4-rank checkpoint loads on 2 ranks (DCP reshards),
    and the continued run matches the 4-rank run's continuation within fp tolerance."""
    four = tmp_path / "four"
    proc = launch(four, corpus, "--train.micro_batch_size=2", nproc=4, timeout=240)
    assert proc.returncode == 0, tail(proc.log)
    two = tmp_path / "two"
    two.mkdir()
    # Start the 2-rank run from the 4-rank run's step-16 checkpoint only.
    (two / "checkpoints").mkdir()
    src = four / "checkpoints" / "step_00000016"
    subprocess.run(["cp", "-r", str(src), str(two / "checkpoints")], check=True)
    proc = launch(two, corpus, "--train.micro_batch_size=4", nproc=2)
    assert proc.returncode == 0, tail(proc.log)
    loads = [e for e in events(two) if e["kind"] == "checkpoint_load"]
    assert loads and loads[0]["step"] == 16
    a, b = final_state(four), final_state(two)
    model_keys = [k for k in a if k.startswith("trainer.model.")]
    assert model_keys
    for key in model_keys:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_inprocess_alone_names_a_frozen_rank_and_exits_for_a_replacement(
    tmp_path: Path, corpus: Path
) -> None:
    """In-process restart cannot bring back a frozen (SIGSTOPped) rank: NVRx terminates it after
    the hard timeout and the world shrinks below the fixed size. The run must say so and exit 1
    (retryable: the Job replaces the pod), not 4 (the restart cap, which fails the Job)."""
    run_dir = tmp_path / "run"
    proc = launch(
        run_dir,
        corpus,
        "--restart=inprocess",
        "--faults=sigstop@1:6",
        "--resilience.hard_timeout_s=12",
        "--resilience.max_restarts=3",
    )
    assert proc.returncode == exits.FAILED, tail(proc.log)
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["code"] == exits.FAILED
    assert "1 of 2 rank(s) died or stopped responding" in verdict["cause"]
    ends = [e for e in events(run_dir) if e["kind"] == "run_end"]
    assert ends and all("gave up after" not in e["cause"] for e in ends)


CALIBRATED_HANGS = "hang@0:11;hang_kernel@1:21"
"""Both in-process hangs of the calibrated watchdog, in one run (each attempt calibrates after
its own 5 steps: the first hang's restart resumes from step 8 or later, so by step 21 the
second attempt is calibrated again)."""


@pytest.fixture(scope="module")
def calibrated_inprocess_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """One in-process run with calibration on and both hangs of CALIBRATED_HANGS; the two tests
    below read different things from it (one run instead of two: ~35 s on 2 cores)."""
    run_dir = tmp_path_factory.mktemp("calibrated-inprocess") / "run"
    proc = launch(
        run_dir,
        corpus,
        "--restart=inprocess",
        f"--faults={CALIBRATED_HANGS}",
        "--resilience.calibrate_timeouts_after=5",
        "--resilience.soft_timeout_s=30",
        "--resilience.hard_timeout_s=60",
    )
    assert proc.returncode == 0, tail(proc.log)
    fired = [e["fault"] for e in events(run_dir) if e["kind"] == "fault"]
    assert sorted(fired) == ["hang", "hang_kernel"], fired
    return run_dir


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_inprocess_hang_detection_calibrated_from_step_times(
    calibrated_inprocess_run: Path, reference: dict
) -> None:
    """With calibration on, a hang is detected within max(2 s, 5 x p99 step time) (the timeout
    at the floor is 1.9 s: the floor less twice the watchdog's poll), long before
    the configured 30 s soft timeout, and the run still ends bit-identical."""
    run_dir = calibrated_inprocess_run
    log = events(run_dir)
    (hang,) = [e for e in log if e["kind"] == "fault" and e["fault"] == "hang"]
    detected = [e for e in log if e["kind"] == "hang_detected" and e["time"] > hang["time"]]
    assert detected, "the calibrated watchdog must have fired"
    assert all(1.9 <= e["timeout_s"] < 30 for e in detected)
    resumed = [m for m in read_metrics(run_dir) if m["time"] - m["step_time_s"] > hang["time"]]
    assert resumed and min(m["time"] for m in resumed) - hang["time"] < 30
    assert_identical(final_state(run_dir), reference)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_inprocess_hang_in_native_code_releases_the_peer_before_the_call_returns(
    calibrated_inprocess_run: Path, reference: dict
) -> None:
    """Rank 1 held in native code for 15 s (``hang_kernel``: on a GPU a spinning kernel and a
    synchronize; here one C call), where no Python signal handler or asynchronous exception
    runs. Its watchdog reports the hang to NVRx from its own thread, so rank 0, blocked in the
    step's collective, is aborted and starts its restart about 2 s after the fault, not when
    rank 1's call returns (a report raised in rank 1's main thread would wait those 15 s); the
    run still ends bit-identical."""
    from training.faults import HANG_KERNEL_S

    run_dir = calibrated_inprocess_run
    log = events(run_dir)
    (fault,) = [e for e in log if e["kind"] == "fault" and e["fault"] == "hang_kernel"]
    detected = [
        e
        for e in log
        if e["kind"] == "hang_detected" and e["rank"] == 1 and e["time"] > fault["time"]
    ]
    assert detected and detected[0]["time"] - fault["time"] < 5
    released = [
        e
        for e in log
        if e["kind"] == "restart_begin" and e["rank"] == 0 and e["time"] > fault["time"]
    ]
    assert released, "rank 0 must have been interrupted"
    assert released[0]["time"] - fault["time"] < HANG_KERNEL_S - 5, (released[0], fault)
    assert all(1.9 <= e["timeout_s"] < 30 for e in detected)
    assert_identical(final_state(run_dir), reference)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_injob_hang_detection_calibrated_from_step_times(
    tmp_path: Path, corpus: Path, reference: dict
) -> None:
    """In-job, with calibration on: after 5 steps the step section's timeout becomes
    max(1.5 s, NVRx's 5 x the longest step), the rank monitor (checking every hang_floor_s / 4)
    catches the hang long before the configured 60 s, ft_launcher respawns the ranks and the
    run ends bit-identical. The heartbeat timeout stays as configured (120 s): the checkpoint
    saves after the calibration, longer than any step before it, kill no rank. The detection,
    which happens in NVRx's rank monitor, is in events.jsonl as the restart's ``detected``
    phase (written by the ranks' own witness thread), at the calibrated timeout after the
    hang, before the restarted processes exist."""
    run_dir = tmp_path / "run"
    proc = launch(
        run_dir,
        corpus,
        "--restart=injob",
        "--faults=hang@1:14",
        "--resilience.calibrate_timeouts_after=5",
        "--resilience.step_section_timeout_s=60",
        "--resilience.heartbeat_timeout_s=120",
    )
    assert proc.returncode == 0, tail(proc.log)
    log = events(run_dir)
    calibrated = [e for e in log if e["kind"] == "hang_timeout_calibrated"]
    assert calibrated, "the step section's timeout must have been calibrated"
    assert all(e["mode"] == "injob" and 1.5 <= e["timeout_s"] < 60 for e in calibrated)
    (hang,) = [e for e in log if e["kind"] == "fault"]
    assert hang["fault"] == "hang"
    resumed = [m for m in read_metrics(run_dir) if m["time"] - m["step_time_s"] > hang["time"]]
    assert resumed and min(m["time"] for m in resumed) - hang["time"] < 40
    assert len([e for e in log if e["kind"] == "restart_begin"]) <= 2  # the hang's one restart
    detected = [
        e for e in log if e.get("phase") == "detected" and e.get("by") == "step_section_timeout"
    ]
    assert detected, "the hang's detection must be in events.jsonl"
    respawned = min(
        e["time"] for e in log if e.get("phase") == "rendezvous_done" and e["attempt"] >= 1
    )
    timeout_s = max(e["timeout_s"] for e in calibrated if e["time"] < hang["time"])
    # Each rank's own step section: the healthy peer's may open a little after the hang.
    assert all(hang["time"] < e["time"] <= hang["time"] + timeout_s + 0.5 for e in detected), (
        detected,
        hang,
    )
    assert min(e["time"] for e in detected) < respawned
    assert_identical(final_state(run_dir), reference)
