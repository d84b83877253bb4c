"""Unit tests of the resilience building blocks (no training processes).

Run: ``.venv/bin/pytest tests/training/resilience/test_resilience_units.py`` (a few seconds).
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from pathlib import Path

import pytest

from training.exits import ConfigError
from training.faults import InjectedFault, parse_faults
from training.resilience.gloo_abort import shutdown_peer_sockets
from training.resilience.inject import FaultInjector
from training.resilience.injob import best_step_so_far, stuck


def test_fault_spec_parses_every_form() -> None:
    faults = parse_faults("exception@1:40; always:sigkill@0:5 ;ckpt_crash@0:50:commit")
    assert [(f.kind, f.rank, f.step, f.point, f.always) for f in faults] == [
        ("exception", 1, 40, "", False),
        ("sigkill", 0, 5, "", True),
        ("ckpt_crash", 0, 50, "commit", False),
    ]
    randoms = parse_faults("random:seed=3:every=20:kinds=exception|hang:ranks=4")
    assert randoms[0].kind in ("exception", "hang") and 0 <= randoms[0].rank < 4
    gaps = [b.step - a.step for a, b in itertools.pairwise(randoms)][:50]
    assert all(10 <= gap <= 30 for gap in gaps)
    assert parse_faults("random:seed=3:every=20") == parse_faults("random:seed=3:every=20")
    timed = parse_faults("hang@1:90s;exception@0:1.5s")
    assert [(f.kind, f.rank, f.step, f.after_s) for f in timed] == [
        ("hang", 1, 0, 90.0),
        ("exception", 0, 0, 1.5),
    ]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("explode@1:4", "unknown fault kind 'explode'"),
        ("exception@1", "needs RANK:STEP"),
        ("exception@a:4", "RANK must be an integer"),
        ("exception@1:4.5", "STEP an integer or SECONDSs"),
        ("exception@1:-3s", "SECONDS >= 0"),
        ("ckpt_crash@0:30s", "not ckpt_crash"),
        ("always:exception@0:30s", "or always:"),
        ("exception@1:0", "STEP >= 1"),
        ("ckpt_crash@0:8:later", "ckpt_crash point must be one of"),
        ("sigkill@0:8:staged", "only ckpt_crash takes a POINT"),
        ("random:seed=1", "needs every=N"),
        ("exception", "has no '@'"),
    ],
)
def test_bad_fault_specs_name_the_field(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_faults(spec)
    assert info.value.field_path == "faults"
    assert needle in str(info.value)


def test_a_fault_fires_once_per_run_across_processes(tmp_path: Path) -> None:
    faults = parse_faults("exception@0:3")
    first = FaultInjector(faults=faults, rank=0, run_dir=tmp_path)
    with pytest.raises(InjectedFault):
        first.before_step(3)
    # A restarted process (new injector, same run directory) replays step 3 without the fault.
    FaultInjector(faults=faults, rank=0, run_dir=tmp_path).before_step(3)
    # Another rank's fault is not this rank's.
    FaultInjector(faults=parse_faults("exception@1:3"), rank=0, run_dir=tmp_path).before_step(3)


def test_timed_faults_keep_the_run_clock_across_processes(tmp_path: Path) -> None:
    """The clock starts at the run's first step and is shared by every later process: a
    restarted rank fires the fault due at its time, once, and not the later one."""
    faults = parse_faults("exception@0:0.3s;sigkill@0:3600s")
    first = FaultInjector(faults=faults, rank=0, run_dir=tmp_path)
    first.before_step(1)  # starts the clock; nothing is due yet
    origin = first.clock_origin()
    assert (tmp_path / ".faults" / "clock_origin").is_file()
    while time.time() - origin < 0.3:
        time.sleep(0.05)
    restarted = FaultInjector(faults=faults, rank=0, run_dir=tmp_path)  # a new process
    assert restarted.clock_origin() == origin
    with pytest.raises(InjectedFault, match="rank 0 step 7"):
        restarted.before_step(7)
    FaultInjector(faults=faults, rank=0, run_dir=tmp_path).before_step(7)  # fired already
    assert sorted(p.name for p in (tmp_path / ".faults").iterdir()) == [
        "00000.fired",
        "clock_origin",
    ]


def test_always_faults_fire_on_every_attempt(tmp_path: Path) -> None:
    faults = parse_faults("always:exception@0:2")
    for _ in range(3):
        with pytest.raises(InjectedFault):
            FaultInjector(faults=faults, rank=0, run_dir=tmp_path).before_step(2)


def test_no_progress_needs_consecutive_restarts_without_a_new_best_step() -> None:
    def history(*bests: int) -> list[dict]:
        return [{"attempt": i, "best_step": b} for i, b in enumerate(bests)]

    assert not stuck(history(0, 4, 10, 15), limit=3)  # every restart got further
    assert not stuck(history(0, 4, 4, 4), limit=3)  # only two restarts without progress
    assert stuck(history(0, 4, 4, 4, 4), limit=3)
    assert stuck(history(4, 4, 4, 4), limit=3)


def test_best_step_reads_the_metrics_tail(tmp_path: Path) -> None:
    assert best_step_so_far(tmp_path) == 0
    lines = [json.dumps({"step": s}) for s in [*range(1, 30), *range(17, 25)]]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3')  # torn last line
    assert best_step_so_far(tmp_path) == 29


def test_socket_shutdown_releases_peers_but_spares_the_store() -> None:
    """The gloo abort: established connections are shut down (a blocked recv returns at once),
    except those on the store's port; listening sockets keep accepting."""
    store_listener = socket.create_server(("127.0.0.1", 0))
    peer_listener = socket.create_server(("127.0.0.1", 0))
    store_port = store_listener.getsockname()[1]
    to_store = socket.create_connection(("127.0.0.1", store_port))
    store_side, _ = store_listener.accept()
    to_peer = socket.create_connection(("127.0.0.1", peer_listener.getsockname()[1]))
    peer_side, _ = peer_listener.accept()
    try:
        count = shutdown_peer_sockets(keep_ports={store_port})
        assert count >= 2  # both ends of the peer connection live in this process
        to_peer.settimeout(2)
        assert to_peer.recv(1) == b""  # released at once, not after a timeout
        to_store.sendall(b"x")
        assert store_side.recv(1) == b"x"  # the store connection still works
        late = socket.create_connection(("127.0.0.1", peer_listener.getsockname()[1]))
        late.close()
    finally:
        for sock in (store_listener, peer_listener, to_store, store_side, to_peer, peer_side):
            sock.close()


class _CountingWrapper:
    """Stands in for NVRx's CallWrapper: only ``ping`` is used by PingHooks."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def ping(self) -> None:
        import time

        self.times.append(time.monotonic())


def test_long_checkpoint_io_keeps_pinging_within_its_budget() -> None:
    """A slow checkpoint load must not look like a hang to the soft timeout; a stuck one must."""
    import time

    from training.resilience.inprocess import PingHooks

    wrapper = _CountingWrapper()
    hooks = PingHooks(wrapper, io_budget_s=60, interval_s=0.2)
    with hooks.section("checkpoint_load"):
        time.sleep(1.5)  # slow I/O
    gaps = [b - a for a, b in itertools.pairwise(wrapper.times)]
    assert len(wrapper.times) >= 6 and max(gaps) < 0.6, gaps

    stuck_io = _CountingWrapper()
    hooks = PingHooks(stuck_io, io_budget_s=0.5, interval_s=0.1)
    with hooks.section("checkpoint_load"):
        time.sleep(1.5)  # past the budget: the pings stop, so the watchdog can fire
    inside = stuck_io.times[1:-1]
    assert inside and inside[-1] - stuck_io.times[0] < 0.8


def test_step_boundaries_report_progress_at_most_once_per_interval() -> None:
    """Every report is a message to another process; fast steps report once per interval, the
    first step of an attempt at once (NVRx starts its manual progress timeout there)."""
    import time

    from training.hooks import liveness_report_interval_s
    from training.resilience.inprocess import PingHooks

    wrapper = _CountingWrapper()
    hooks = PingHooks(wrapper, io_budget_s=60, interval_s=0.2)
    started = time.monotonic()
    for step in range(1, 51):  # 50 steps of ~10 ms: 0.5 s
        hooks.before_step(step)
        time.sleep(0.01)
        hooks.after_step(step)
    assert wrapper.times[0] - started < 0.01
    assert 2 <= len(wrapper.times) <= 4, len(wrapper.times)
    assert liveness_report_interval_s(8.0) == pytest.approx(0.8)
    assert liveness_report_interval_s(120.0) == 1.0


class _CountingClient:
    """Stands in for NVRx's RankMonitorClient: heartbeats and sections, recorded."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, float]] = []

    def send_heartbeat(self) -> None:
        self.messages.append(("heartbeat", time.monotonic()))

    def start_section(self, name: str) -> None:
        self.messages.append((f"open {name}", time.monotonic()))

    def end_section(self, name: str) -> None:
        self.messages.append((f"close {name}", time.monotonic()))

    def heartbeats(self) -> list[float]:
        return [at for kind, at in self.messages if kind == "heartbeat"]


def test_checkpoint_waits_send_heartbeats_once_the_steps_have_begun(tmp_path: Path) -> None:
    """In-job: the checkpoint manager's waits (``keepalive``) beat like the steps, throttled;
    before the first step's heartbeat they send none, so the checkpoint load keeps the
    initial heartbeat timeout (NVRx's monitor switches to the shorter one at the first)."""
    from training.resilience.injob import MonitorHooks
    from training.runlog.metrics import EventLog

    client = _CountingClient()
    hooks = MonitorHooks(
        client,
        calibrate_after=0,
        floor_s=1.0,
        events=EventLog(run_dir=tmp_path, rank=0),
        attempt=0,
        mode="injob",
        heartbeat_every_s=0.2,
    )
    try:
        with hooks.section("checkpoint_load"):
            for _ in range(10):
                hooks.keepalive()
                time.sleep(0.05)
        assert client.heartbeats() == [], "a heartbeat during the load ends its initial timeout"
        hooks.before_step(1)
        hooks.after_step(1)
        with hooks.section("checkpoint_save"):
            started = time.monotonic()
            while time.monotonic() - started < 1.0:  # a save waiting on its worker
                hooks.keepalive()
                time.sleep(0.02)
    finally:
        hooks.close()
    beats = client.heartbeats()
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    # Throttled (no two closer than the interval), and kept coming through the 1 s wait.
    assert len(beats) >= 4 and min(gaps) >= 0.19 and max(gaps) < 0.5, gaps


def test_checkpoint_waits_report_progress_to_the_inprocess_wrapper() -> None:
    """In-process: a wait outside a section (a snapshot's publish, the final commit) pings
    NVRx's wrapper, throttled, for at most the I/O budget; inside a section the pinger thread
    and the waits share one lock (the monitor's client is one socket)."""
    from training.resilience.inprocess import PingHooks

    wrapper = _CountingWrapper()
    hooks = PingHooks(wrapper, monitor=_CountingClient(), io_budget_s=60, interval_s=0.2)
    started = time.monotonic()
    while time.monotonic() - started < 1.0:
        hooks.keepalive()
        time.sleep(0.02)
    gaps = [b - a for a, b in itertools.pairwise(wrapper.times)]
    assert len(wrapper.times) >= 4 and min(gaps) >= 0.19 and max(gaps) < 0.5, gaps
    assert len(hooks.monitor.heartbeats()) == len(wrapper.times)

    # A wait that outlasts the I/O budget (a worker stuck on a dead file system) stops
    # reporting, so the watchdog still fires; the next step boundary starts a new budget.
    stuck = _CountingWrapper()
    hooks = PingHooks(stuck, io_budget_s=0.4, interval_s=0.1)
    hooks.after_step(1)
    started = time.monotonic()
    while time.monotonic() - started < 1.2:
        hooks.keepalive()
        time.sleep(0.02)
    assert stuck.times and stuck.times[-1] - started < 0.5, [t - started for t in stuck.times]
    hooks.after_step(2)
    hooks.keepalive()
    assert time.monotonic() - stuck.times[-1] < 0.1


def test_calibrated_timeout_is_five_p99_with_a_floor() -> None:
    from training.resilience.hang import calibrated_timeout

    times = [0.1] * 99 + [0.9]
    assert calibrated_timeout(times, floor_s=2.0, factor=5.0) == 2.0  # 5 x p99 (0.1) < floor
    assert calibrated_timeout([1.0] * 100, floor_s=2.0, factor=5.0) == 5.0
    assert calibrated_timeout([0.1] * 98 + [1.2, 1.2], floor_s=0.1, factor=5.0) == 6.0


def test_hang_watchdog_reports_once_only_after_calibration_and_not_during_io() -> None:
    """The main thread stuck past the calibrated timeout is reported once (the watchdog's
    ``interrupt``); checkpoint I/O pauses it. At the floor the timeout is the floor less twice
    the watchdog's poll interval, so the report lands within the floor."""
    import time

    from training.resilience.hang import CalibratedHangWatchdog

    detections: list = []
    reports: list[float] = []
    watchdog = CalibratedHangWatchdog(
        calibrate_after=5,
        floor_s=0.5,
        interrupt=lambda: reports.append(time.monotonic()),
        on_detect=lambda timeout, waited: detections.append((timeout, waited)),
    )
    try:
        for _ in range(5):  # calibration: five quick steps
            watchdog.step_started()
            time.sleep(0.01)
            watchdog.step_finished()
        watchdog.step_started()
        watchdog.pause()
        time.sleep(0.8)  # slow checkpoint I/O: not a hang
        watchdog.resume()
        assert reports == []
        started = time.monotonic()
        time.sleep(1.5)  # the hang
    finally:
        watchdog.close()
    assert len(reports) == 1, "one report per hung step"
    assert 0.4 < reports[0] - started < 1.0, reports[0] - started
    assert len(detections) == 1 and detections[0][0] == pytest.approx(0.5 - 2 * watchdog.poll_s)


def test_hang_watchdog_reports_while_the_main_thread_is_held_in_native_code() -> None:
    """On a GPU a hung rank sits in C++ (a synchronize behind a stuck kernel or collective),
    where no signal handler or asynchronous exception runs until the call returns. The report
    comes from the watchdog's own thread, while the main thread is still inside the call (the
    hang_kernel fault's native block: here one C call of ~3 s; a CUDA kernel on a GPU)."""
    import time

    from training.resilience.hang import CalibratedHangWatchdog
    from training.resilience.inject import block_in_native_code

    reports: list[float] = []
    watchdog = CalibratedHangWatchdog(
        calibrate_after=1, floor_s=0.5, interrupt=lambda: reports.append(time.monotonic())
    )
    try:
        watchdog.step_started()
        watchdog.step_finished()
        watchdog.step_started()
        started = time.monotonic()
        block_in_native_code(seconds=3.0)
        returned = time.monotonic()
    finally:
        watchdog.close()
    assert returned - started > 1.5, "the native call must outlast the detection"
    assert len(reports) == 1 and reports[0] < returned - 0.5, (reports, started, returned)
    assert reports[0] - started < 1.2


def test_hang_watchdog_recalibrates_at_once_for_a_slow_step_and_every_16_otherwise() -> None:
    """The p99 is not recomputed after every step (it sorts the window), but a step slow
    enough to need a longer timeout raises it at once: the throttle may only delay a shrink."""
    import time

    from training.resilience.hang import RECALIBRATE_EVERY, CalibratedHangWatchdog

    def step(watchdog: CalibratedHangWatchdog, seconds: float) -> None:
        watchdog.step_started()
        watchdog._started = time.monotonic() - seconds  # a step that lasted `seconds`
        watchdog.step_finished()

    # floor 0.1 s less twice the 0.05 s poll: the timeout is 5 x p99 alone
    watchdog = CalibratedHangWatchdog(calibrate_after=1, floor_s=0.1, interrupt=lambda: None)
    try:
        for _ in range(200):
            step(watchdog, 0.01)
        assert watchdog.timeout_s == pytest.approx(0.05, rel=0.2)
        assert watchdog.steps % RECALIBRATE_EVERY == 200 % 16 == 8
        for _ in range(5):  # slow steps, 2.5% of the window: the p99 now; no periodic turn
            step(watchdog, 0.4)
        grown = watchdog.timeout_s
        assert grown == pytest.approx(5 * 0.4, rel=0.05), "raised by the slow steps at once"
        watchdog.step_times.extend([0.01] * 1000)  # the slow steps have left the window
        while watchdog.steps % RECALIBRATE_EVERY != RECALIBRATE_EVERY - 1:
            step(watchdog, 0.01)
            assert watchdog.timeout_s == grown, "no shrink between two recalibrations"
        step(watchdog, 0.01)
        assert watchdog.timeout_s == pytest.approx(0.05, rel=0.2), "the periodic one shrinks it"
    finally:
        watchdog.close()


def test_hang_watchdog_close_stops_its_thread_at_once_and_a_failing_report_is_logged() -> None:
    """``close`` runs in the attempt's ``finally``, on the restart's critical path: the thread
    stops at once. A report that raises (NVRx's monitor process gone) is logged, not fatal: the
    wrapper's soft timeout stays the backstop."""
    import time

    from training.resilience.hang import CalibratedHangWatchdog

    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("monitor process gone")

    watchdog = CalibratedHangWatchdog(calibrate_after=1, floor_s=0.2, interrupt=broken)
    try:
        watchdog.step_started()
        watchdog.step_finished()
        watchdog.step_started()
        time.sleep(0.6)
        assert calls == [1] and watchdog._thread.is_alive()
        started = time.monotonic()
    finally:
        watchdog.close()
    assert not watchdog._thread.is_alive() and time.monotonic() - started < 0.5


@pytest.mark.parametrize(
    ("make_error", "code", "needle"),
    [
        (
            lambda exc: exc.RestartAbort(
                "state.iteration=4 self.max_iterations=4 state.world_size=2 "
                "self.min_world_size=2 state.active_world_size=2 self.min_active_world_size=1"
            ),
            "RESTARTS_EXHAUSTED",
            "resilience.max_restarts",
        ),
        (
            lambda exc: exc.RestartAbort(
                "state.iteration=1 self.max_iterations=4 state.world_size=1 "
                "self.min_world_size=2 state.active_world_size=1 self.min_active_world_size=1"
            ),
            "FAILED",
            "1 of 2 rank(s) died",
        ),
        (lambda exc: exc.InternalError("State(rank=1, ...)"), "FAILED", "InternalError"),
        (lambda exc: exc.TimeoutError(), "FAILED", "TimeoutError"),
    ],
)
def test_only_the_restart_cap_is_a_non_retryable_inprocess_exit(make_error, code, needle) -> None:
    """NVRx's own exception types (0.4.1); the RestartAbort messages are RetryController's
    format. Only the cap may fail the Job (pod failure policy); every other end is retryable."""
    from nvidia_resiliency_ext.inprocess import exception

    from training import exits
    from training.resilience.inprocess import give_up_cause

    got, cause = give_up_cause(make_error(exception), attempts=1, max_restarts=3, world_size=2)
    assert got == getattr(exits, code)
    assert needle in cause


def test_a_discarded_rank_words_its_verdict_like_the_survivors() -> None:
    """Every rank writes the verdict and the last one wins: the frozen rank, once NVRx resumes
    and discards it, may be that one (its exit makes the launcher stop the survivors). Its cause
    must name the same count and fix as theirs. NVRx 0.4.1's message format
    (``rank_assignment.py``)."""
    from nvidia_resiliency_ext.inprocess.rank_assignment import RankDiscarded

    from training import exits
    from training.resilience.inprocess import give_up_cause

    err = RankDiscarded("state.rank=1 terminated_ranks={1}")
    got, cause = give_up_cause(err, attempts=1, max_restarts=3, world_size=2)
    assert got == exits.FAILED
    assert "1 of 2 rank(s) died or stopped responding" in cause and "discarded" in cause
    _, cause = give_up_cause(
        RankDiscarded("rank=3 terminated_ranks={1, 3}"), attempts=1, max_restarts=3, world_size=4
    )
    assert "2 of 4 rank(s)" in cause


def test_an_ended_run_keeps_its_outcome_for_a_restart_during_its_clean_up() -> None:
    """The run's end (here an eviction) reaches every hook of the chain before the clean-up,
    and the in-process layer's recorder keeps it: ``run_inprocess``'s next attempt returns it
    instead of training on (a restart that strikes while the evicted rank shuts down would
    otherwise lose the eviction)."""
    from training.hooks import HookChain, NodeEviction, StepHooks
    from training.resilience.inprocess import EndRecorder
    from training.trainer import TrainResult

    seen: list[object] = []

    class Witness(StepHooks):
        def finished(self, result: object) -> None:
            seen.append(result)

    recorder = EndRecorder()
    assert recorder.result is None
    eviction = NodeEviction(node="node-1", cause="slow", this_node=True)
    result = TrainResult(final_step=9, final_loss=1.0, preempted=True, eviction=eviction)
    HookChain([Witness(), recorder]).finished(result)
    assert seen == [result] and recorder.result is result
    assert recorder.result.exit_code == result.exit_code != 0
