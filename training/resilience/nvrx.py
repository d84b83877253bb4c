"""NVRx's fault-tolerance client (in-job restart under ``ft_launcher``) and in-process restart
wrapper (nvidia-resiliency-ext==0.4.1, imported lazily: only the restart layers need it)."""

from __future__ import annotations

from collections.abc import Callable

# NVRx's monitor thread sleeps ``last_call_wait`` after the first interruption is recorded and
# before it locks the records and aborts the process group (0.4.1 ``monitor_thread.py``,
# ``MonitorThread.run``), so every in-process restart waits it out. The records it waits for
# only feed the restart's attribution message; ranks lost for good are recorded apart
# (``store.record_terminated_ranks``). A peer's concurrent record is one store append, so
# 0.1 s still collects it (NVRx's default is 1 s).
LAST_CALL_WAIT_S = 0.1
# How often NVRx's monitor process checks the soft and hard timeouts when no message arrives
# (``msg_queue.get(timeout=interval)``, 0.4.1 ``monitor_process.py``); a message (an
# interruption record, a ping) is handled at once.
MONITOR_PROCESS_INTERVAL_S = 0.5


def wrapper_heartbeat_timeout_s(soft_timeout_s: float) -> float:
    """The Wrapper's heartbeat timeout: how long a rank (its node) may go silent before the
    others count it lost. At least the soft timeout, so a rank that is only slow is not."""
    return max(10.0, soft_timeout_s)


# ---------------------------------------------------------------------------------------------
# fault tolerance (in-job restart under ft_launcher)
# ---------------------------------------------------------------------------------------------


def rank_monitor_client():
    """A connected ``RankMonitorClient`` (only valid under ``ft_launcher``)."""
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()
    return client


# ---------------------------------------------------------------------------------------------
# in-process restart
# ---------------------------------------------------------------------------------------------


def report_hang(call_wrapper, *, rank: int) -> None:
    """Record a soft-timeout interruption of ``rank`` in the wrapper's store, as NVRx's monitor
    process does when its own soft timeout expires (0.4.1 ``monitor_process.py``: a
    ``RECORD_INTERRUPTED`` message; the wrapper sends one the same way for an exception,
    ``wrap.py``). Safe from any thread: it puts one message on the monitor process's queue,
    so it works while the main thread is blocked in C++. Every rank's monitor thread then
    aborts its process groups and raises ``RankShouldRestart`` in its main thread."""
    from nvidia_resiliency_ext.inprocess.attribution import Interruption, InterruptionRecord

    call_wrapper.monitor_process.record_interrupted(
        [InterruptionRecord(rank, Interruption.SOFT_TIMEOUT)]
    )


def inprocess_wrapper(
    fn: Callable,
    *,
    max_restarts: int,
    world_size: int,
    soft_timeout_s: float,
    hard_timeout_s: float,
    keep_ports: set[int],
    wrapper_port: int,
    cuda: bool,
) -> Callable:
    """Wrap ``fn`` (which takes ``call_wrapper``) in NVRx's ``inprocess.Wrapper``.

    Health checks are chosen per device: CUDA's on GPU, none on CPU. Abort: NCCL's abort on GPU;
    on gloo, releasing the blocked sockets (training/resilience/gloo_abort.py)."""
    import datetime

    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess.abort import Abort, AbortTorchDistributed

    from training.resilience.gloo_abort import shutdown_peer_sockets

    class AbortGloo(Abort):
        def __call__(self, state):
            shutdown_peer_sockets(keep_ports=keep_ports)
            return state

    seconds = datetime.timedelta
    soft = seconds(seconds=soft_timeout_s)
    hard = seconds(seconds=hard_timeout_s)
    health_check = inprocess.health_check.CudaHealthCheck() if cuda else None
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": wrapper_port},
        initialize=inprocess.initialize.RetryController(
            max_iterations=max_restarts + 1, min_world_size=world_size
        ),
        abort=AbortTorchDistributed() if cuda else AbortGloo(),
        health_check=health_check,
        soft_timeout=soft,
        hard_timeout=hard,
        heartbeat_timeout=seconds(seconds=wrapper_heartbeat_timeout_s(soft_timeout_s)),
        barrier_timeout=seconds(seconds=hard_timeout_s + 60),
        completion_timeout=seconds(seconds=hard_timeout_s + 60),
        monitor_thread_interval=seconds(seconds=0.5),
        monitor_process_interval=seconds(seconds=MONITOR_PROCESS_INTERVAL_S),
        heartbeat_interval=seconds(seconds=1),
        progress_watchdog_interval=seconds(seconds=0.5),
        last_call_wait=seconds(seconds=LAST_CALL_WAIT_S),
    )
    # NVRx finds the parameter to fill by its annotation *object* (``Optional[CallWrapper]``);
    # with postponed annotations it would see a string, so set the real one explicitly.
    from typing import Optional

    fn.__annotations__ = {"call_wrapper": Optional[inprocess.CallWrapper]}  # noqa: UP045
    return wrapper(fn)
