"""NVRx's asynchronous checkpoint writer (its persistent worker process), made safe on CPU and
GPU. The other NVRx calls live beside their users: ``training.resilience.nvrx`` (fault tolerance
and in-process restart) and ``training.checkpoint.local`` (local checkpoints).
Pinned: nvidia-resiliency-ext==0.4.1 (the newest release with a wheel for glibc 2.36 / Python
3.11; 0.5+ are manylinux_2_39 and 0.7 needs Python >= 3.12).

CPU compatibility layer (active only when torch has no usable CUDA):
NVRx 0.4.1's async checkpointing assumes CUDA in two places we reach:
1. ``AsyncCaller.sync_all_async_calls`` and ``AsyncRequest.execute_finalize_fns`` build their
   agreement tensors on ``torch.cuda.current_device()``. :func:`cpu_collectives` makes that
   call return ``"cpu"`` for the duration of our own finalize call only, so the all-reduce runs
   on gloo. Nothing is patched outside that ``with`` block, and nothing when CUDA is available.
2. ``FileSystemWriterAsync.preload_tensors`` (run in the persistent worker) ends with
   ``torch.cuda.synchronize()``. We pass our own preload function instead (:func:`stage`), on
   CPU and GPU: CPU tensors reach the worker through shared memory (live, not copies), so the
   worker clones them while the trainer waits on NVRx's preload queue; CUDA tensors (IPC
   handles) are copied to pinned host memory and waited for on *their own* device.

GPU path (NVRx 0.4.1 ``core.py:PersistentAsyncCaller``): the worker is spawned with no CUDA
device set, and NVRx's preload ends with a bare ``torch.cuda.synchronize()``, i.e. on device 0:
on local ranks 1-7 the D2H copies were not waited for before the writer read them (a checkpoint
whose CRC certifies the wrong bytes), and seven extra CUDA contexts landed on GPU 0. The
worker's first request (:func:`_bind_worker`) now sets its device to the rank's GPU
(``LOCAL_RANK``) before any CUDA call, and :func:`stage` synchronizes each device it copied
from before the trainer's save returns (NVRx's preload queue is joined on that). The worker
drops its references to the request's tensors as soon as they are staged and written, so that
a worker reused across an in-process restart pins none of the previous iteration's memory
(NVRx async usage guide, PR #106: "dereference of GPU tensors should be done promptly inside
of preload_fn"; NVIDIA-NeMo/RL#3322: retained IPC handles kept ~19 GiB per rank alive).
Stopping a worker is graceful first (:func:`stop_worker`): SIGKILL only after a clean stop and
a stop signal have both timed out (torch's multiprocessing notes: a consumer that dies from a
fatal signal leaves shared CUDA tensors pinned in the producer; NVRx PR #373 sends SIGTERM
before SIGKILL for the same reason).

Process lifetime (CPU and GPU): NVRx's writer returns its results through a queue served by a
``multiprocessing`` Manager process that NVRx starts lazily, inside the first save's plan, and
never binds to its rank. :func:`start_write_results_queue` starts that server at start-up
instead, bound like the worker (:func:`die_with_parent`), and hands it to NVRx through
the module global NVRx 0.4.1 reads (``filesystem_async._results_queue``).

Stale completions and write results (issue #43): the worker, its queues and the write-results
queue outlive an in-process restart, and NVRx 0.4.1 matches neither a completion nor a write
result to its save (``core.py`` ``is_current_async_call_done`` takes any completion for the head
request's; ``filesystem_async.py`` ``retrieve_write_results`` takes the oldest results). Here:
every attempt numbers its requests from a base all ranks agree on, above any index this process
used before (:func:`_agree_first_index`), and a completion counts only for the request of its
own index (:class:`_MatchingCaller`); each save's write results carry a tag of their own and its
finalize takes only those (:class:`_OwnResultsWriter`); a worker is kept for the next attempt
only when it provably holds no request (:func:`_idle`), and whatever a previous attempt left in
either queue is dropped before the next one uses them.
Installed files of torch and NVRx are never edited.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from queue import Empty
from typing import Any

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
)
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from training.checkpoint.integrity import write_buckets
from training.checkpoint.layout import CheckpointError
from training.checkpoint.lifetime import die_with_parent, spawning_helper
from training.checkpoint.staging import HostStaging, unstage

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


def stage(write_buckets: list) -> list:
    """Preload function (runs in the persistent worker, while the trainer's save waits on NVRx's
    preload queue): a host copy of every tensor, complete when this returns.

    CPU tensors are cloned (they arrive live, through shared memory). CUDA tensors are copied
    to pinned host memory with ``non_blocking=True`` and then every device copied from is
    synchronized by index: a bare ``torch.cuda.synchronize()`` (NVRx 0.4.1
    ``filesystem_async.py:preload_tensors``) waits on the *current* device only, which in an
    unbound worker is GPU 0. The incoming list is emptied in place afterwards: it is the same
    object as the request's ``async_fn_args[1]``, which the worker's loop keeps referenced until
    its next request arrives; emptied, the worker holds no CUDA IPC handle past staging.
    """
    staged = []
    devices: set[torch.device] = set()
    for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
        tensors = []
        for item, tensor in tensor_data:
            if tensor.device.type == "cuda":
                devices.add(tensor.device)
                tensors.append((item, tensor.detach().to("cpu", non_blocking=True)))
            else:
                tensors.append((item, tensor.detach().clone()))
        staged.append((file_name, storage_key, (bytes_data, tensors)))
    for device in sorted(devices, key=lambda d: d.index or 0):
        torch.cuda.synchronize(device)
    write_buckets.clear()
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
    with spawning_helper():
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    # The proxy keeps ``manager`` (and so the server) alive for as long as NVRx holds the queue.
    filesystem_async._results_queue = manager.Queue()


def worker_device(env: dict[str, str] | None = None) -> int | None:
    """The CUDA device index the rank's checkpoint worker binds to: ``LOCAL_RANK`` (set by
    torchrun / ft_launcher; ``training.parallel.init_process_group`` binds the rank itself to
    the same index), or None without CUDA."""
    if not cuda_usable():
        return None
    env = os.environ if env is None else env
    return int(env.get("LOCAL_RANK", "0"))


def _stop_on_signal(signum: int, frame: Any) -> None:
    # Unwinds the worker's loop like a normal exit: its frames (and so any CUDA IPC tensor they
    # hold) are released, which a fatal signal would not do.
    sys.exit(0)


def _bind_worker(parent_pid: int, device: int | None = None) -> None:
    """The worker's first request. Defined here, not in ``training.checkpoint.lifetime``, on
    purpose: unpickling it makes the worker import this module (torch, DCP, NVRx) at start-up,
    which the first save would otherwise wait for (measured: 1.4 s instead of 0.3 s of blocking).

    Binds the worker to its rank's GPU before any CUDA call (nothing in NVRx's loop touches
    CUDA before the first request; unpickling a later request's IPC tensors does), and arms
    :data:`WORKER_STOP_SIGNAL` for a clean stop. SIGTERM stays ignored (``die_with_parent``):
    a launcher's ``killpg`` must not cut the rank's final save short."""
    die_with_parent(parent_pid)
    signal.signal(WORKER_STOP_SIGNAL, _stop_on_signal)
    if device is not None:
        torch.cuda.set_device(device)


def _write_then(
    write_fn: Callable, after_write: Callable, *args: Any, staging: torch.Tensor | None = None
) -> None:
    """Runs in the persistent worker: the write (files fsynced, CRCs taken on the way:
    :func:`training.checkpoint.integrity.write_buckets`), then our per-rank manifest from what
    it returns (``after_write(files)``). ``staging`` is the host staging buffer the buckets'
    slots point into (None when :func:`stage` already made host copies). The staged host
    copies are released right after (the worker's loop would keep them until its next
    request)."""
    buckets = args[1]
    try:
        if staging is not None:
            buckets[:] = unstage(buckets, staging)
        files = write_fn(*args)
    finally:
        buckets.clear()
        del staging
    after_write(files)


POLL_S = 0.05
"""The pause between two passes of a blocking wait for the worker."""

# The stop signal our worker handles by exiting cleanly (SIGTERM is ignored on purpose).
WORKER_STOP_SIGNAL = signal.SIGUSR2


def stop_worker(
    caller: Any, *, clean_timeout_s: float = 30.0, signal_timeout_s: float = 10.0
) -> str:
    """Stop NVRx's persistent worker of ``caller`` without leaving CUDA IPC memory pinned.

    In order: ask it to stop (NVRx's own ``'DONE'`` message, served after any write in
    flight), join with a timeout; send :data:`WORKER_STOP_SIGNAL` (a clean ``sys.exit`` in the
    worker), join again; only then SIGKILL. Never blocks without a bound (NVRx's
    ``PersistentAsyncCaller.close`` joins its queue and process with none). Returns how the
    worker ended: ``"none"``, ``"clean"``, ``"signal"`` or ``"killed"``.
    """
    process = getattr(caller, "process", None)
    if caller is not None:
        # Cleared first: the caller's __del__ (run by a later gc) would otherwise wait forever
        # on a queue that nobody serves any more.
        caller.process = None
    if process is None or not process.is_alive():
        return "none"
    # Remembered until it is gone: an in-process restart can raise into this function (NVRx
    # raises asynchronously into the main thread), and the next attempt must not start while
    # the old worker may still write into a checkpoint directory (``reap_stopping_workers``).
    _STOPPING.append(process)
    with contextlib.suppress(Exception):
        caller.queue.put("DONE")
    process.join(timeout=clean_timeout_s)
    outcome = "clean"
    if process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, WORKER_STOP_SIGNAL)
        process.join(timeout=signal_timeout_s)
        outcome = "signal"
    if process.is_alive():
        log.warning("checkpoint worker %s ignored a clean stop; killing it", process.pid)
        process.kill()
        process.join(timeout=10)
        outcome = "killed"
    with contextlib.suppress(ValueError):
        _STOPPING.remove(process)
    return outcome


_STOPPING: list = []


def reap_stopping_workers(*, timeout_s: float = 10.0) -> None:
    """Finish stopping the workers an interrupted :func:`stop_worker` left behind (signal, then
    SIGKILL after ``timeout_s``): a new attempt's saves never share a directory with them."""
    while _STOPPING:
        process = _STOPPING.pop()
        if not process.is_alive():
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, WORKER_STOP_SIGNAL)
        process.join(timeout=timeout_s)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)


# The persistent worker outlives one ``AsyncCheckpointQueue``: an in-process restart creates a
# new queue and would otherwise pay the worker's start-up (seconds) again on every restart.
_SHARED_CALLER = None


def stop_shared_worker() -> None:
    """Stop a worker kept for reuse. Registered with atexit (after multiprocessing's own exit
    handler, so it runs first): otherwise the interpreter waits forever at exit for a
    non-daemon worker that nobody tells to stop."""
    global _SHARED_CALLER
    caller, _SHARED_CALLER = _SHARED_CALLER, None
    stop_worker(caller)


atexit.register(stop_shared_worker)


# --- matching completions and write results to their own save ---------------------------------

_next_index = 0
"""The lowest request index this process has not used yet (any queue, any attempt)."""


def _agree_first_index() -> int:
    """The first request index of a new attempt, the same on every rank: the highest of the
    ranks' next unused index (collective, one all-reduce). Above every index this process used
    before, so no completion of an earlier attempt matches a request of this one; the same on
    every rank, so NVRx's finalize still finds all ranks at the same index
    (``AsyncRequest.execute_finalize_fns``). A rank that is a fresh process (a spare) joins at
    its peers' base."""
    device = torch.cuda.current_device() if cuda_usable() else "cpu"
    agreed = torch.tensor([_next_index], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
    return int(agreed.item())


class _MatchingCaller(PersistentAsyncCaller):
    """NVRx's persistent caller whose completions count only for the request of their index.

    NVRx's worker puts each request's index on ``comp_q`` when the request is done. A completion
    below the head request's index is stale (a request of an earlier attempt, handed to the
    worker but never tracked: the fault landed between NVRx's ``queue.put`` and
    ``async_calls.append``) and is dropped; one above it means the head's own was lost, an error
    rather than a save finalized before it is written."""

    def __init__(self) -> None:
        super().__init__()
        # The owning queue's head request index (re-pointed by each queue that schedules here).
        self.head_index: Callable[[], int] = lambda: -1

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        # NVRx 0.4.1 ``PersistentAsyncCaller.is_current_async_call_done`` with the index check.
        expected = self.head_index()
        is_alive = False
        if self.process:
            while self.cur_item != expected:
                if self.cur_item is not None and self.cur_item > expected:
                    raise CheckpointError(
                        f"the NVRx checkpoint worker reported the completion of request "
                        f"{self.cur_item} while request {expected} was due: a request was lost "
                        "between the trainer and its worker; the restart layer starts a new one"
                    )
                if self.cur_item is not None:
                    log.info(
                        "dropped the completion of request %s of an earlier attempt", self.cur_item
                    )
                try:
                    self.cur_item = self.comp_q.get_nowait()
                except Empty:
                    self.cur_item = None
                    if not blocking:
                        is_alive = True
                        break
                    time.sleep(POLL_S)
        is_done = not is_alive if no_dist else self.sync_all_async_calls(is_alive)
        if is_done:
            self.cur_item = None
        return is_done


class _IndexedCallsQueue(AsyncCallsQueue):
    """NVRx's queue of requests with a :class:`_MatchingCaller` as its persistent caller, and
    this process's used indices recorded before each hand-over (a fault can land right after
    it)."""

    def __init__(self) -> None:
        super().__init__(persistent=True)

    def _get_async_caller(self) -> PersistentAsyncCaller:
        if self.persistent_caller is None:
            self.persistent_caller = _MatchingCaller()
        self.persistent_caller.head_index = self._head_index
        return self.persistent_caller

    def _head_index(self) -> int:
        return self.async_calls[0].idx

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        global _next_index
        index = self.call_idx + 1  # what NVRx numbers this request
        _next_index = max(_next_index, index + 1)
        # The tracked request carries its index too: NVRx 0.4.1 sends the worker a copy with
        # the index but tracks the caller's request, whose ``call_idx`` stays 0, so its
        # cross-rank check of the finalized index (``execute_finalize_fns``) compared 0 with 0.
        return super().schedule_async_request(async_request._replace(call_idx=index))


def _idle(caller: Any) -> bool:
    """The worker of ``caller`` is alive and provably holds no request: every request put on its
    queue was marked done (the worker does that only after putting the completion,
    ``core.py`` ``async_loop``) and no preload token waits for a request (one would be taken by
    the next request that preloads, which then never releases its trainer). CPython's own
    ``JoinableQueue.join`` reads the same semaphore."""
    process = getattr(caller, "process", None)
    if process is None or not process.is_alive():
        return False
    return all(q._unfinished_tasks._semlock._is_zero() for q in (caller.queue, caller.preload_q))


DRAIN_WAIT_S = 0.2
"""How long a drain waits for one more entry: the worker's queue feeder thread may still be
sending a completion that was put before the request was marked done."""


def _drop_stale_completions(caller: Any) -> None:
    """Empty the completion queue of an idle worker (every entry there is of an earlier
    attempt; :class:`_MatchingCaller` would drop them as well)."""
    caller.cur_item = None
    with contextlib.suppress(Empty, OSError, ValueError, EOFError):
        while True:
            caller.comp_q.get(timeout=DRAIN_WAIT_S)


def _drop_stale_results() -> None:
    """Empty NVRx's process-wide write-results queue (with no request in flight, every entry
    is of a save that will never be finalized) and forget results set aside."""
    _SET_ASIDE.clear()
    results = filesystem_async._results_queue
    if results is None:
        return
    with contextlib.suppress(Empty, OSError, EOFError, ConnectionError):
        while True:
            results.get_nowait()


@dataclass(frozen=True)
class _TaggedResults:
    """Handed to the writer in place of NVRx's results queue: every entry it puts carries the
    save's tag (``write_buckets`` puts one entry per save)."""

    queue: Any
    tag: str

    def put(self, results: Any) -> None:
        self.queue.put((self.tag, results))


_SET_ASIDE: dict[str, Any] = {}
"""Results read from the queue for a tag other than the one being finalized: a later save of
this attempt whose results were read first stays finalizable; stale ones are dropped with the
queue's next drain."""


class _OwnResultsWriter(FileSystemWriterAsync):
    """NVRx's writer whose finalize takes this save's own write results, never the oldest ones
    in the process-wide queue (NVRx 0.4.1 ``retrieve_write_results`` reads ``get_nowait()``
    without asking whose they are)."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.results_tag = f"{path}#{uuid.uuid4().hex}"

    def results_sink(self) -> _TaggedResults | None:
        """What the worker's write puts its results to (after ``prepare_write_data``)."""
        if self.results_queue is None:
            return None
        return _TaggedResults(queue=self.results_queue, tag=self.results_tag)

    def retrieve_write_results(self) -> list:
        shared = self.results_queue
        if shared is None:  # nothing written on this rank: NVRx's own answer
            return super().retrieve_write_results()
        own = _SET_ASIDE.pop(self.results_tag, None)
        with contextlib.suppress(Empty):
            while own is None:
                entry = shared.get_nowait()
                tag, results = entry if _is_tagged(entry) else (None, entry)
                if tag == self.results_tag:
                    own = (results,)
                elif tag is not None:
                    _SET_ASIDE[tag] = (results,)
                else:
                    log.warning("dropped write results that name no save")
        if own is None:
            raise CheckpointError(
                f"no write results for {self.path}: its write never reported; "
                "the checkpoint stays uncommitted"
            )
        self.results_queue = _OneEntry(own[0])
        try:
            return super().retrieve_write_results()  # NVRx's own checks of the results
        finally:
            self.results_queue = shared


def _is_tagged(entry: Any) -> bool:
    return isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)


@dataclass
class _OneEntry:
    """A queue holding one entry, in the shape ``retrieve_write_results`` reads."""

    entry: Any

    def get_nowait(self) -> Any:
        return self.entry


@dataclass(frozen=True, kw_only=True)
class _CachedPlan:
    """The finished central plan of this rank and (coordinator) the global metadata."""

    plan: Any
    metadata: Any


class AsyncCheckpointQueue:
    """NVRx async checkpointing with a persistent background worker per rank."""

    def __init__(self, *, keepalive: Callable[[], None] = lambda: None) -> None:
        """``keepalive``: called between the passes of every blocking wait (the restart layer's
        liveness report, ``StepHooks.keepalive``)."""
        self._queue = _IndexedCallsQueue()
        self._keepalive = keepalive
        # Per queue, so per CheckpointManager, so per attempt: a restart (new world size, new
        # shards) never reuses a plan or a staging layout made for another state.
        self._plan: _CachedPlan | None = None
        self._staging = HostStaging()
        self._binding = False  # the binding request of start_worker is not finalized yet
        self._queue.persistent_caller = _adopt_shared_caller()

    def start_worker(self) -> None:
        """Start the persistent worker without waiting for it: a fresh worker imports torch
        (seconds) while the trainer trains (the manager starts it after the first step), and
        each step's poll (:meth:`await_worker` with ``blocking=False``) finds it ready; only a
        save scheduled before that waits. The first request binds the worker's life to this process.
        Collective with :meth:`await_worker`: every rank calls both, at the same points."""
        global _SHARED_CALLER
        reap_stopping_workers()
        start_write_results_queue()
        if not self._queue.async_calls:
            # Nothing of this queue in flight: every request before this index is another
            # attempt's (collective, like the binding below).
            self._queue.call_idx = _agree_first_index() - 1
        # NVRx's worker waits on a queue whose pipe it holds both ends of: without this binding,
        # a SIGKILLed rank would leave it orphaned, holding its host memory, for good. Every rank
        # sends it, also to a worker kept from the previous attempt (binding again is harmless):
        # the wait for it is collective and NVRx numbers each queue's requests, so a rank that
        # skipped it would meet its peers' all-reduce in another collective and number its saves
        # one lower than theirs (a rank whose save was in flight at the fault gets a new worker,
        # its peers keep theirs: in-process restart then looped to its cap).
        first = AsyncRequest(partial(_bind_worker, os.getpid(), worker_device()), (), [])
        # Spawns the worker if needed (no wait), deaf to a launcher's SIGTERM from its start:
        # a drain in the first seconds of an attempt killed it before its binding request had
        # it ignore SIGTERM, and the final save then waited for a dead worker.
        with spawning_helper():
            self._queue.schedule_async_request(first)
        self._binding = True
        _SHARED_CALLER = self._queue.persistent_caller

    @property
    def binding(self) -> bool:
        """The binding request of :meth:`start_worker` is not finalized yet."""
        return self._binding

    def await_worker(self, *, blocking: bool = True) -> bool:
        """Finalize the binding request once every rank's worker has run it (collective: NVRx's
        all-reduce of the ranks' states, so every rank sees the worker ready at the same call).
        ``blocking``: wait for it (polling in Python, with ``keepalive`` between the passes: a
        fresh worker imports torch for seconds, longer than a heartbeat timeout on a busy
        node); otherwise one check. Returns whether the worker is ready; a no-op once it is. A
        worker that died first is a :class:`CheckpointError` either way."""
        while self._binding:
            # One check per pass (NVRx's blocking wait would spin on a dead worker for good):
            # every rank takes part in each pass's all-reduce, and all see it done at once.
            self._finalize_done()
            if not self._binding:
                break
            self._raise_if_worker_died("before it was ready")
            if not blocking:
                break
            self._keepalive()
            time.sleep(POLL_S)
        return not self._binding

    def _raise_if_worker_died(self, when: str) -> None:
        if not self.worker_alive():
            process = getattr(self._queue.persistent_caller, "process", None)
            code = getattr(process, "exitcode", None)
            raise CheckpointError(
                f"the NVRx checkpoint worker died {when} (exit code {code}): "
                "see this rank's log; the restart layer starts a new one"
            )

    def schedule_save(
        self,
        *,
        state_dict: dict[str, Any],
        checkpoint_dir: str,
        after_write: Callable[[Any], None],
        finalize: Callable[[], None],
        reuse_plan: bool = False,
        phases: Callable[[str], None] = lambda name: None,
    ) -> None:
        """Plan the DCP save (or reuse the last plan), stage the tensors, hand the write to the
        worker.

        ``reuse_plan``: every rank agreed that the state's structure is the one the cached plan
        was made for (collective decision, :meth:`CheckpointManager.save`). ``after_write(files)``
        runs in the worker after this rank's files are written and fsynced (it must be
        picklable); ``finalize`` runs on every rank once all ranks' writes are done.
        ``phases(name)`` marks the end of each phase (plan, stage, schedule) for the caller.
        """
        self.await_worker()  # normally done already (the steps' polls, CheckpointManager.poll)
        writer = _OwnResultsWriter(checkpoint_dir, thread_count=1)
        if reuse_plan and self._plan is not None:
            writer, metadata, dist_wrapper = self._prepare_with_cached_plan(state_dict, writer)
        else:
            self._plan = None
            self._staging.reset()
            planner = DefaultSavePlanner()
            with cpu_collectives():
                writer, metadata, dist_wrapper = save_state_dict_async_plan(
                    state_dict, writer, planner=planner
                )
            self._plan = _CachedPlan(plan=planner.plan, metadata=metadata)
        phases("plan")
        buckets = writer.write_buckets or []
        staging = None
        preload_fn = None
        if any(t.device.type != "cpu" for _, _, (_, data) in buckets for _, t in data):
            # GPU: the worker copies to host (:func:`stage`) while the trainer waits.
            preload_fn = partial(stage, writer.write_buckets)
            # The worker's copies run on its own stream in its own context: the kernels that
            # produced these tensors (the optimizer step) must be complete first. CUDA IPC's
            # event covers the stream current at pickling only, so wait for the whole device.
            torch.cuda.synchronize()
            args = [torch.distributed.get_rank(), writer.write_buckets, writer.results_sink()]
        else:
            # CPU: the trainer copies into the persistent staging buffer (the snapshot itself);
            # the worker then needs no preload and the trainer does not wait for it.
            staged = self._staging.stage(buckets)
            args = [torch.distributed.get_rank(), staged, writer.results_sink()]
            staging = self._staging.buffer
        phases("stage")
        # With nothing to write on this rank (tiny models on many ranks) the worker still runs
        # ``after_write`` so that the rank takes part in ordering and finalize collectives.
        async_fn = (
            partial(_write_then, write_buckets, after_write, staging=staging)
            if buckets
            else partial(after_write, {})
        )
        request = AsyncRequest(
            async_fn=async_fn,
            async_fn_args=tuple(args) if buckets else (),
            finalize_fns=[
                partial(save_state_dict_async_finalize, writer, metadata, dist_wrapper),
                finalize,
            ],
            preload_fn=preload_fn,
        )
        self._queue.schedule_async_request(request)
        phases("schedule")  # GPU: includes the worker's host copies (preload)

    def plan_ahead(self, *, state_dict: dict[str, Any], checkpoint_root: str) -> None:
        """Make and cache the save plan of ``state_dict`` now, as the first save would (NVRx's
        ``save_state_dict_async_plan``: DCP's local plans, their gather, the central plan), so
        that the first save of the attempt reuses it like every later one. Nothing is written:
        the writer only checks ``checkpoint_root`` for a DCP ``.metadata`` (there is none; each
        checkpoint is a step directory below it) and resolves the write items. Collective."""
        self._plan = None
        writer = FileSystemWriterAsync(checkpoint_root, thread_count=1)
        planner = DefaultSavePlanner()
        with cpu_collectives():
            _, metadata, _ = save_state_dict_async_plan(state_dict, writer, planner=planner)
        self._plan = _CachedPlan(plan=planner.plan, metadata=metadata)

    def _prepare_with_cached_plan(
        self, state_dict: dict[str, Any], writer: _OwnResultsWriter
    ) -> tuple[_OwnResultsWriter, Any, _DistWrapper]:
        """NVRx's ``save_state_dict_async_plan`` with a validated cache (its "Passed cache
        reusable" branch, NVRx 0.4.1 ``state_dict_saver.py``), minus its validation: set up
        the planner and writer, reuse the central plan, resolve the write data. No collective:
        the plan's validity was agreed before (``reuse_plan``). Only the coordinator holds the
        global metadata (NVRx's cache does the same)."""
        assert self._plan is not None
        dist_wrapper = _DistWrapper(None, True, 0)
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, is_coordinator=dist_wrapper.is_coordinator)
        writer.set_up_storage_writer(dist_wrapper.is_coordinator)
        plan = planner.finish_plan(writer.prepare_local_plan(self._plan.plan))
        writer.prepare_write_data(plan, planner)
        metadata = self._plan.metadata if dist_wrapper.is_coordinator else None
        return writer, metadata, dist_wrapper

    def reserve_staging(self, nbytes: int) -> None:
        """Have the first save's staging buffer ready (background; see ``HostStaging.reserve``)."""
        self._staging.reserve(nbytes)

    def has_plan(self) -> bool:
        """A plan from an earlier save of this queue is cached."""
        return self._plan is not None

    def worker_alive(self) -> bool:
        """The persistent worker is running (a dead one never finishes a write)."""
        caller = self._queue.persistent_caller
        process = getattr(caller, "process", None)
        return process is not None and process.is_alive()

    def schedule_request(self, request: AsyncRequest) -> None:
        """Schedule a ready-made NVRx request (the local checkpoint tier builds its own)."""
        self.await_worker()
        self._queue.schedule_async_request(request)

    def poll(self, *, blocking: bool) -> list[int]:
        """Finalize the saves that every rank has finished (collective: call on all ranks).
        ``blocking``: until every scheduled request is finalized, one check per pass with
        ``keepalive`` between the passes. NVRx's own blocking wait sleeps in a loop of its own
        (``PersistentAsyncCaller.is_current_async_call_done``) where no liveness report can
        run, and spins for good on a dead worker; here a dead one is a
        :class:`CheckpointError`. Every rank sees each pass's all-reduced verdict, so all make
        the same passes."""
        finalized = self._finalize_done()
        while blocking and self._queue.async_calls:
            self._raise_if_worker_died("with a save in flight")
            self._keepalive()
            time.sleep(POLL_S)
            finalized += self._finalize_done()
        return finalized

    def _finalize_done(self) -> list[int]:
        """One non-blocking pass of NVRx's finalization (one all-reduce per request checked)."""
        with cpu_collectives():
            finalized = self._queue.maybe_finalize_async_calls(blocking=False)
        # Nothing is scheduled behind the binding before it is finalized (every request waits
        # for it first, :meth:`await_worker`): an empty queue means the binding is done.
        self._binding = self._binding and bool(self._queue.async_calls)
        return finalized

    def pending(self) -> int:
        return self._queue.get_num_unfinalized_calls()

    def close(self) -> None:
        """Finish pending saves and stop the worker (collective)."""
        global _SHARED_CALLER
        self.poll(blocking=True)
        self._binding = False
        # Every write is finalized: the worker is idle and stops at once on 'DONE'. Bounded,
        # unlike NVRx's ``PersistentAsyncCaller.close`` (queue and process joins without limit).
        stop_worker(self._queue.persistent_caller)
        self._queue.persistent_caller = None
        _SHARED_CALLER = None

    def abandon(self, *, stop_timeout_s: float = 2.0) -> None:
        """After a fault, without any collective (peers may be gone). A worker that provably
        holds no request (:func:`_idle`) is kept for the next attempt (it holds no tensor of this
        attempt: :func:`stage`, :func:`_write_then`); any other is stopped
        (:func:`stop_worker`; killed only if it will not stop): its write is cut off, its
        checkpoint stays uncommitted and is never loaded. Either way the completions and write
        results this attempt left are dropped: none of its saves will be finalized."""
        global _SHARED_CALLER
        caller = self._queue.persistent_caller
        # A request NVRx tracks is in flight (the binding counts: its completion is stale for
        # the next attempt too); one it does not track is caught by ``_idle``.
        in_flight = bool(self._queue.async_calls)
        self._queue.async_calls.clear()
        self._binding = False
        if caller is None:
            _drop_stale_results()
            return
        if not in_flight and _idle(caller):
            _drop_stale_completions(caller)
            _drop_stale_results()
            _SHARED_CALLER = caller
            return
        _SHARED_CALLER = None
        # The write in flight is discarded anyway (never committed): no long wait for 'DONE';
        # the stop signal still unwinds the worker cleanly (its IPC references released).
        stop_worker(caller, clean_timeout_s=0.5, signal_timeout_s=stop_timeout_s)
        _drop_stale_results()  # after the stop: the worker puts results until it is gone


def _adopt_shared_caller() -> _MatchingCaller | None:
    """The worker kept from an earlier queue, if it may serve a new one, after the stops an
    interrupted clean-up left are finished (:func:`reap_stopping_workers`: no old writer is
    still writing when the new attempt sweeps torn checkpoints). Checked again here, not only in
    :meth:`AsyncCheckpointQueue.abandon`: a fault can interrupt that, leaving the attempt's busy
    worker shared. A worker that is not provably idle is stopped, and with no worker busy
    anything queued is stale."""
    global _SHARED_CALLER
    reap_stopping_workers()
    caller = _SHARED_CALLER
    if caller is None or getattr(caller, "process", None) is None:
        return None
    if not _idle(caller):
        _SHARED_CALLER = None
        stop_worker(caller, clean_timeout_s=0.5, signal_timeout_s=2.0)
        _drop_stale_results()
        return None
    _drop_stale_completions(caller)
    _drop_stale_results()
    return caller
