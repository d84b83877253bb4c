"""Probe: the attempt after a fault, where one rank keeps its idle NVRx worker and the other
needs a new one (its save was in flight, so ``abandon`` stopped its worker). Run by
tests/training/checkpoint/test_nvrx_worker.py under torchrun, 2 ranks (gloo).

Attempt 0: both ranks start the worker. Rank 1 then has a (non-collective) request in flight
and abandons; rank 0 abandons idle. Attempt 1: new queues on both ranks, ``start_worker``, one
save, finalized on every rank (NVRx checks that the ranks finalize matching request numbers).
Writes ``rank<R>.json`` with what happened. Usage: worker_reuse_probe.py RESULT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    from training.checkpoint.nvrx_async import AsyncCheckpointQueue, stop_shared_worker

    result_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first = AsyncCheckpointQueue()
    first.start_worker()
    first.await_worker()  # as CheckpointManager.prepare does after step 1, on every rank
    if rank == 1:  # a write in flight at the fault, on this rank only
        first.schedule_request(AsyncRequest(partial(time.sleep, 3.0), (), []))
    first.abandon()
    first_pid = _worker_pid(first)
    finalized: list[int] = []
    second = AsyncCheckpointQueue()
    second.start_worker()
    second.schedule_save(
        state_dict={"weight": torch.arange(256.0) + rank},
        checkpoint_dir=str(result_dir / "ckpt"),
        after_write=partial(print, "written", flush=True),
        finalize=partial(finalized.append, rank),
    )
    while second.pending():
        second.poll(blocking=False)
        time.sleep(0.05)
    report = {"rank": rank, "finalized": finalized, "kept_worker": first_pid is not None}
    (result_dir / f"rank{rank}.json").write_text(json.dumps(report))
    second.close()
    stop_shared_worker()
    dist.destroy_process_group()


def _worker_pid(queue) -> int | None:
    caller = queue._queue.persistent_caller
    process = getattr(caller, "process", None)
    return process.pid if process is not None and process.is_alive() else None


if __name__ == "__main__":
    main()
