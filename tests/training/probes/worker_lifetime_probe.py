"""Probe for the lifetime of NVRx's helper processes (run by
tests/training/checkpoint/test_checkpoint.py).

One rank (gloo, world size 1): start the NVRx checkpoint queue as a run does at start-up,
record whether NVRx's write-results queue already exists, save one small checkpoint through
NVRx and wait for it, then write the pids of every child process this rank started (its
multiprocessing resource tracker too) and sleep until the test SIGKILLs it.
Usage: python worker_lifetime_probe.py RESULT_DIR
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from functools import partial
from multiprocessing import resource_tracker
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    from training.checkpoint.nvrx_async import AsyncCheckpointQueue

    result_dir = Path(sys.argv[1])
    dist.init_process_group(
        "gloo", init_method=f"file://{result_dir / 'store'}", rank=0, world_size=1
    )
    queue = AsyncCheckpointQueue()
    queue.start_worker()
    ready_at_start = filesystem_async._results_queue is not None
    queue.schedule_save(
        state_dict={"weight": torch.arange(1024.0)},
        checkpoint_dir=str(result_dir / "ckpt"),
        after_write=partial(print, "written", flush=True),
        finalize=partial(print, "finalized", flush=True),
    )
    while queue.pending():
        queue.poll(blocking=False)
        time.sleep(0.05)
    children = [child.pid for child in multiprocessing.active_children()]
    # The resource tracker is no Process (multiprocessing/resource_tracker.py starts it with
    # spawnv_passfds): it exits once every process holding its pipe (this rank and the helpers
    # it spawned) is gone.
    tracker = resource_tracker._resource_tracker._pid
    report = {
        "pid": os.getpid(),
        "children": children,
        "tracker": tracker,
        "queue_ready_at_start": ready_at_start,
    }
    partial_path = result_dir / "children.json.tmp"
    partial_path.write_text(json.dumps(report))
    partial_path.rename(result_dir / "children.json")  # the test never reads half a file
    time.sleep(600)  # until the test kills this rank


if __name__ == "__main__":
    main()
