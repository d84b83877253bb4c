"""A rank that gets SIGTERM while blocked in a gloo all-reduce (its peer is frozen), or while
healthy. Run by tests/training/resilience/test_stop.py: ``stop_probe.py ROLE PORT``.

ROLE: blocked (rank 0: all-reduce with a frozen peer), frozen (rank 1: joins, then SIGSTOPs
itself), healthy (no process group: reaches a boundary, "saves" for 4 s, exits 0), progressing
(no process group: after the SIGTERM, reports progress for 5 s, past its 2 s grace, then
blocks without any: the grace runs from its last progress).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from training.stop import StopRequest

role, port = sys.argv[1], int(sys.argv[2])
if role == "healthy":
    with StopRequest(grace_s=lambda: 2.0) as stop:
        print("ready", flush=True)
        while not stop.requested:
            time.sleep(0.05)  # one "step"
        stop.saving()
        time.sleep(4.0)  # the final checkpoint, longer than the grace: must not be cut short
    sys.exit(0)
if role == "progressing":
    with StopRequest(grace_s=lambda: 2.0) as stop:
        print("ready", flush=True)
        while not stop.requested:
            time.sleep(0.05)
        until = time.monotonic() + 5.0
        while time.monotonic() < until:  # a checkpoint wait, pass by pass
            stop.progress()
            time.sleep(0.05)
        print("blocked", flush=True)
        time.sleep(60)  # no progress, no boundary: the watcher ends it
    sys.exit(0)

rank = 0 if role == "blocked" else 1
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
dist.init_process_group(
    "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
)
if role == "frozen":
    dist.barrier()
    os.kill(os.getpid(), signal.SIGSTOP)
    sys.exit(0)
with StopRequest(grace_s=lambda: 2.0):
    dist.barrier()
    print("ready", flush=True)
    dist.all_reduce(torch.ones(4))  # blocks in C++: the peer is frozen
print("all-reduce returned", flush=True)
sys.exit(0)
