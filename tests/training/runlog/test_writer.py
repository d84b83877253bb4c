"""Per-step metrics and run events written off the training thread (training/runlog/writer.py).

The loop used to open, append to and close ``metrics.jsonl`` (rank 0) and ``events.jsonl`` (every
rank) on the training thread, every step, on FSx. Now one buffered writer per process appends
them every ``FLUSH_INTERVAL_S``; a crash that runs no code (SIGKILL) loses at most that much.
Run: .venv/bin/pytest tests/training/runlog/test_writer.py -q
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from support import REPO_ROOT, TINY_MODEL, VENV_BIN, processes_of_test, subprocess_env, tail

from training.runlog import writer
from training.runlog.files import EVENTS_FILE, METRICS_FILE, read_jsonl
from training.runlog.metrics import EventLog, StepLogger


def _log_step(logger: StepLogger, step: int) -> None:
    logger.log(
        step=step,
        loss=1.0,
        lr=1e-3,
        step_time_s=0.1,
        tokens=100,
        flops_per_token=1.0,
        peak_flops=None,
        world_size=1,
    )


def test_the_training_thread_never_touches_the_files(tmp_path: Path, monkeypatch) -> None:
    """No open/write on the caller's thread; the lines arrive within the flush interval, in
    order, from the writer's thread. (Failed before: ``append_jsonl`` ran on the caller.)"""
    opened_on: list[str] = []
    real_open = os.open

    def recording_open(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            opened_on.append(threading.current_thread().name)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    events = EventLog(run_dir=tmp_path, rank=3)
    logger = StepLogger(
        run_dir=tmp_path, total_steps=10, start_step=0, log_every=100, progress="plain", attempt=0
    )
    for step in range(1, 6):
        _log_step(logger, step)
        events.emit("memory_snapshot", step=step)
    assert threading.current_thread().name not in opened_on
    deadline = time.monotonic() + 5 * writer.FLUSH_INTERVAL_S
    while time.monotonic() < deadline:
        if len(read_jsonl(tmp_path / METRICS_FILE)[0]) == 5:
            break
        time.sleep(0.05)
    metrics, bad = read_jsonl(tmp_path / METRICS_FILE)
    assert bad == 0 and [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert opened_on and set(opened_on) == {"runlog-writer"}
    logger.close()  # flushes: the events are all there now
    rows, _ = read_jsonl(tmp_path / EVENTS_FILE)
    assert [(r["rank"], r["step"]) for r in rows] == [(3, s) for s in range(1, 6)]


def test_a_failed_write_is_a_warning_not_a_crash(tmp_path: Path, capsys) -> None:
    appender = writer.BufferedAppender(interval_s=60)
    appender.append(tmp_path / "gone" / METRICS_FILE, {"step": 1})
    appender.append(tmp_path / METRICS_FILE, {"step": 2})
    appender.flush()
    assert appender.dropped == 1 and "1 line(s)" in capsys.readouterr().err
    assert read_jsonl(tmp_path / METRICS_FILE)[0] == [{"step": 2}]


def test_a_forked_child_does_not_write_its_parents_lines(tmp_path: Path) -> None:
    """A checkpoint worker forked with lines queued must not append them again at its exit.
    In a fresh interpreter: the child runs every exit handler, and this pytest process's own
    (torch, multiprocessing, earlier tests') are not the writer's to answer for."""
    script = (
        "import atexit, os, sys\n"
        "from pathlib import Path\n"
        "from training.runlog import writer\n"
        "writer.appender().append(Path(sys.argv[1]), {'step': 1})\n"
        "pid = os.fork()\n"
        "if pid == 0:  # the child runs its exit handlers, as a worker's normal exit does\n"
        "    atexit._run_exitfuncs()\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "writer.flush()\n"
    )
    path = tmp_path / METRICS_FILE
    subprocess.run(
        [str(VENV_BIN / "python"), "-c", script, str(path)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        check=True,
        timeout=60,
    )
    assert read_jsonl(path)[0] == [{"step": 1}]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_loses_at_most_the_last_second_of_lines(tmp_path: Path, corpus: Path) -> None:
    """A real 2-rank training run (torchrun, gloo), SIGKILLed as a whole (the kernel's OOM kill
    or a lost node: no code runs). Rank 0 prints each step to stdout as it logs it (unbuffered,
    synchronous), so stdout says which steps were done; ``metrics.jsonl`` must hold every one
    of them up to the last ~second before the kill, in order, with no torn line."""
    run_dir = tmp_path / "run"
    log_path = tmp_path / "run.log"
    command = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "training",
        "train",
        "--run-dir",
        str(run_dir),
        *TINY_MODEL,
        f"--data.path={corpus}",
        "--train.steps=100000",
        "--train.log_every=1",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and proc.poll() is None:
                if len(read_jsonl(run_dir / METRICS_FILE)[0]) >= 40:
                    break
                time.sleep(0.1)
            assert proc.poll() is None, tail(log_path)
            time.sleep(0.37)  # mid-interval, not aligned with the writer's flushes
            killed_at = time.time()
            # As a whole: torchrun's group and the ranks, which torch elastic starts in
            # sessions of their own (its SubprocessHandler: start_new_session).
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in processes_of_test(os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    printed = [
        int(line.split()[1])
        for line in log_path.read_text(errors="replace").splitlines()
        if line.startswith("step ") and len(line.split()) > 1 and line.split()[1].isdigit()
    ]
    metrics, torn = read_jsonl(run_dir / METRICS_FILE)
    steps = [m["step"] for m in metrics]
    assert torn == 0, "a torn line: writes are whole lines"
    assert steps == list(range(1, len(steps) + 1)), "lines lost or out of order before the end"
    assert printed and steps, tail(log_path)
    lost = max(printed) - steps[-1]
    # The last flush before the kill ran at most FLUSH_INTERVAL_S (+ its write) before it and
    # wrote every step ended by then; the newest of those ended at most one step interval
    # earlier. So the newest line on disk is no older than that (the machine is loaded: the
    # interval is measured, not assumed).
    times = [m["time"] for m in metrics[-10:]]
    step_interval = max(b - a for a, b in itertools.pairwise(times))
    bound = writer.FLUSH_INTERVAL_S + step_interval + 0.25
    age = killed_at - metrics[-1]["time"]
    print(
        f"done {max(printed)} steps, written {steps[-1]} (lost {lost}); newest line {age:.2f} s "
        f"before the kill, bound {bound:.2f} s (step interval {step_interval:.2f} s)"
    )
    assert age <= bound, (
        f"the newest line on disk is {age:.2f} s older than the kill, over {bound:.2f} s "
        f"(steps done {max(printed)}, written {steps[-1]})"
    )
    rows, torn_events = read_jsonl(run_dir / EVENTS_FILE)
    assert torn_events == 0
    assert {r["rank"] for r in rows if r["kind"] == "attempt_start"} == {0, 1}
