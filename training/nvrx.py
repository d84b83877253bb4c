"""Every call into nvidia-resiliency-ext (NVRx) goes through this module, so that an upgrade
touches one place. Pinned: nvidia-resiliency-ext==0.4.1 (the newest release with a wheel for
glibc 2.36 / Python 3.11; 0.5+ are manylinux_2_39 and 0.7 needs Python >= 3.12).

CPU compatibility layer (active only when torch has no usable CUDA):
NVRx 0.4.1's async checkpointing assumes CUDA in two places we reach:
1. ``AsyncCaller.sync_all_async_calls`` and ``AsyncRequest.execute_finalize_fns`` build their
   agreement tensors on ``torch.cuda.current_device()``. :func:`cpu_collectives` makes that
   call return ``"cpu"`` for the duration of our own finalize call only, so the all-reduce runs
   on gloo. Nothing is patched outside that ``with`` block, and nothing when CUDA is available.
2. ``FileSystemWriterAsync.preload_tensors`` (run in the persistent worker) ends with
   ``torch.cuda.synchronize()``. On CPU we pass our own preload function instead
   (:func:`stage_by_clone`): the request's CPU tensors reach the worker through shared memory
   (live, not copies), so the worker clones them while the trainer waits on NVRx's preload
   queue. That clone is the staging copy that the D2H copy is on GPU, and it makes the
   checkpoint an exact snapshot of the step it was taken at.

Process lifetime (CPU and GPU): NVRx's writer returns its results through a queue served by a
``multiprocessing`` Manager process that NVRx starts lazily, inside the first save's plan, and
never binds to its rank. :func:`start_write_results_queue` starts that server at start-up
instead, bound like the worker (:func:`die_with_parent`), and hands it to NVRx through
the module global NVRx 0.4.1 reads (``filesystem_async._results_queue``).
Installed files of torch and NVRx are never edited.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)

from training.lifetime import die_with_parent

NVRX_VERSION = "0.4.1"
log = logging.getLogger(__name__)


def cuda_usable() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def cpu_collectives() -> Iterator[None]:
    """Within this block, NVRx's ``torch.cuda.current_device()`` answers ``"cpu"`` when there is
    no CUDA, so its agreement all-reduces run on the gloo process group."""
    if cuda_usable():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


def stage_by_clone(write_buckets: list) -> list:
    """Preload function for CPU tensors (runs in the persistent worker): copy every tensor so
    the write sees the state at the save step, not what training does afterwards."""
    staged = []
    for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
        tensors = [(item, tensor.detach().clone()) for item, tensor in tensor_data]
        staged.append((file_name, storage_key, (bytes_data, tensors)))
    return staged


def start_write_results_queue() -> None:
    """Start the Manager process behind NVRx's write-results queue now, bound to this process.

    Left to NVRx, the first save starts it and nothing binds it to the rank: a SIGKILLed rank
    leaves it running (~275 MB once it has imported torch) for the rest of the pod's life, one
    more for every in-job restart. The queue is per process and outlives in-process restarts,
    like NVRx's own.
    """
    if filesystem_async._results_queue is not None:
        return
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    # Started light (0.13 s): it imports torch only when it unpickles the first save's write
    # results, in the background. Importing it at start-up (even in a thread) made every start-up,
    # so every restart, ~4 s slower on 2 CPU ranks; it only took the first commit from 8-10 s
    # (contended 2-core machine) to 0.8 s after staging.
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    # The proxy keeps ``manager`` (and so the server) alive for as long as NVRx holds the queue.
    filesystem_async._results_queue = manager.Queue()


def _bind_worker(parent_pid: int) -> None:
    """The worker's first request. Defined here, not in ``training.lifetime``, on purpose:
    unpickling it makes the worker import this module (torch, DCP, NVRx) at start-up, which the
    first save would otherwise wait for (measured: 1.4 s instead of 0.3 s of blocking)."""
    die_with_parent(parent_pid)


def _write_then(write_fn: Callable, after_write: Callable, *args: Any) -> None:
    """Runs in the persistent worker: NVRx's write (files fsynced), then our per-rank manifest."""
    write_fn(*args)
    after_write()


# The persistent worker outlives one ``AsyncCheckpointQueue``: an in-process restart creates a
# new queue and would otherwise pay the worker's start-up (seconds) again on every restart.
_SHARED_CALLER = None


def stop_shared_worker() -> None:
    """Stop a worker kept for reuse. Registered with atexit (after multiprocessing's own exit
    handler, so it runs first): otherwise the interpreter waits forever at exit for a
    non-daemon worker that nobody tells to stop."""
    global _SHARED_CALLER
    caller, _SHARED_CALLER = _SHARED_CALLER, None
    process = getattr(caller, "process", None)
    if caller is not None:
        caller.process = None
    if process is not None and process.is_alive():
        process.kill()
        process.join(timeout=10)


atexit.register(stop_shared_worker)


class AsyncCheckpointQueue:
    """NVRx async checkpointing with a persistent background worker per rank."""

    def __init__(self) -> None:
        self._queue = AsyncCallsQueue(persistent=True)
        if _SHARED_CALLER is not None and _SHARED_CALLER.process is not None:
            self._queue.persistent_caller = _SHARED_CALLER

    def start_worker(self) -> None:
        """Have the persistent worker running before the first save (which would otherwise pay
        its start-up of several seconds). The first request (binding the worker's life to this
        process) goes through the public API and is finalized at once; the wait polls in
        Python, so watchdogs see progress meanwhile. Collective: call on every rank."""
        global _SHARED_CALLER
        start_write_results_queue()
        caller = self._queue.persistent_caller
        if caller is None or caller.process is None:
            # NVRx's worker waits on a queue whose pipe it holds both ends of: without this
            # binding, a SIGKILLed rank would leave it orphaned, holding its host memory, for good.
            first = AsyncRequest(partial(_bind_worker, os.getpid()), (), [])
            self._queue.schedule_async_request(first)
        self.poll(blocking=True)
        _SHARED_CALLER = self._queue.persistent_caller

    def schedule_save(
        self,
        *,
        state_dict: dict[str, Any],
        checkpoint_dir: str,
        after_write: Callable[[], None],
        finalize: Callable[[], None],
    ) -> None:
        """Plan the DCP save, stage the tensors and hand the write to the worker.

        ``after_write`` runs in the worker after this rank's files are written and fsynced (it
        must be picklable); ``finalize`` runs on every rank once all ranks' writes are done.
        """
        writer = FileSystemWriterAsync(checkpoint_dir, thread_count=1)
        with cpu_collectives():
            writer, metadata, dist_wrapper = save_state_dict_async_plan(state_dict, writer)
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        if not cuda_usable() and preload_fn is not None:
            preload_fn = partial(stage_by_clone, writer.write_buckets)
        # With nothing to write on this rank (tiny models on many ranks) the worker still runs
        # ``after_write`` so that the rank takes part in ordering and finalize collectives.
        async_fn = partial(_write_then, save_fn, after_write) if save_fn else after_write
        request = AsyncRequest(
            async_fn=async_fn,
            async_fn_args=tuple(save_args) if save_fn else (),
            finalize_fns=[
                partial(save_state_dict_async_finalize, writer, metadata, dist_wrapper),
                finalize,
            ],
            preload_fn=preload_fn,
        )
        self._queue.schedule_async_request(request)

    def schedule_request(self, request: AsyncRequest) -> None:
        """Schedule a ready-made NVRx request (the local checkpoint tier builds its own)."""
        self._queue.schedule_async_request(request)

    def poll(self, *, blocking: bool) -> list[int]:
        """Finalize the saves that every rank has finished (collective: call on all ranks)."""
        with cpu_collectives():
            return self._queue.maybe_finalize_async_calls(blocking=blocking)

    def pending(self) -> int:
        return self._queue.get_num_unfinalized_calls()

    def close(self) -> None:
        """Finish pending saves and stop the worker (collective)."""
        global _SHARED_CALLER
        with cpu_collectives():
            self._queue.close()
        _SHARED_CALLER = None

    def abandon(self) -> None:
        """After a fault, without any collective (peers may be gone). An idle worker is kept for
        the next attempt; one with a request in flight is killed: that write is cut off, its
        checkpoint stays uncommitted and is never loaded."""
        global _SHARED_CALLER
        caller = self._queue.persistent_caller
        in_flight = bool(self._queue.async_calls)
        self._queue.async_calls.clear()
        if caller is None:
            return
        if not in_flight and caller.process is not None and caller.process.is_alive():
            caller.cur_item = None
            _SHARED_CALLER = caller
            return
        process = caller.process
        # Cleared first: the caller's __del__ (run by a later gc) would otherwise wait forever
        # on a queue that nobody serves any more.
        caller.process = None
        _SHARED_CALLER = None
        if process is not None and process.is_alive():
            process.kill()
            process.join(timeout=10)


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
        heartbeat_timeout=seconds(seconds=max(10.0, soft_timeout_s)),
        barrier_timeout=seconds(seconds=hard_timeout_s + 60),
        completion_timeout=seconds(seconds=hard_timeout_s + 60),
        monitor_thread_interval=seconds(seconds=0.5),
        monitor_process_interval=seconds(seconds=0.5),
        heartbeat_interval=seconds(seconds=1),
        progress_watchdog_interval=seconds(seconds=0.5),
        last_call_wait=seconds(seconds=0.5),
    )
    # NVRx finds the parameter to fill by its annotation *object* (``Optional[CallWrapper]``);
    # with postponed annotations it would see a string, so set the real one explicitly.
    from typing import Optional

    fn.__annotations__ = {"call_wrapper": Optional[inprocess.CallWrapper]}  # noqa: UP045
    return wrapper(fn)
