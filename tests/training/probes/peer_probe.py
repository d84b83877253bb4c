"""Probe for the peer copy on the device (run by ``make gpu-check``'s ``peer_exchange``).

Two ranks on two "nodes" of one rank each (``LOCAL_WORLD_SIZE=1``), over gloo: one GPU cannot
host two NCCL ranks ("Duplicate GPU detected"), and the exchange runs on its own gloo group in
the product anyway (``peer.PeerCopies._exchange_group``). Each rank's state lives on its GPU
(``rank % device_count``; on a one-GPU machine both share GPU 0), and each pod's memory is a
directory of its own under ``/dev/shm``.

1. ``PodMemorySnapshots.prepare`` (slots mapped, ``cudaHostRegister`` started on a thread bound
   to the rank's GPU), then ``take`` at step 1 (side stream, publish thread bound to the GPU),
   then the exchange started (``exchange(step=1)``): the training thread's time in it is
   reported as ``blocked_s``.
2. "Training" goes on while it is in flight: five in-place updates of the CUDA state (the
   optimizer's ``before_update`` first) and an all-reduce each; ``in_flight_after_steps``.
3. The exchange is waited for; its seconds and bytes come from its ``peer_copy`` event.
4. Node 1 is lost: its pod's directory removed; rank 1's state replaced by other values; the
   ``peer`` tier restores step 1 on both ranks: rank 1's shard from rank 0's pod, checked by
   CRC32; the restored CUDA state must equal the state at step 1, bit for bit.

Writes ``rank<R>.json`` per rank into RESULT_DIR. Usage: ``python peer_probe.py RESULT_DIR
NUMEL`` (``GPU_CHECK_FAKE_CUDA=1``: CPU tensors).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

WORLD = 2
OWNER = "gpu-check-peer"


def _state(device: torch.device, numel: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(numel, generator=g).to(device),
            "b": torch.randn(4096).to(device),
        },
        "optim": {"exp_avg": torch.randn(numel // 4, generator=g).to(device)},
        "step": 1,
    }


def _cpu(state: dict) -> dict:
    return {
        k: _cpu(v) if isinstance(v, dict) else (v.cpu().clone() if torch.is_tensor(v) else v)
        for k, v in state.items()
    }


def _equal(a: dict, b: dict) -> bool:
    for key, value in a.items():
        other = b[key]
        if isinstance(value, dict):
            if not _equal(value, other):
                return False
        elif torch.is_tensor(value):
            if not torch.equal(value.cpu(), other.cpu()):
                return False
        elif value != other:
            return False
    return True


def _rank(rank: int, out: str, shm: str, port: int, numel: int, fake: bool) -> None:
    from training.checkpoint import peer
    from training.checkpoint.pod_memory import PodMemorySnapshots
    from training.checkpoint.tiers import Rejected
    from training.runlog.metrics import EventLog

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    device = torch.device("cpu")
    if not fake:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    root = Path(shm) / f"node-{rank}"
    events = EventLog(run_dir=Path(out) / "run", rank=rank)
    report: dict = {"rank": rank, "device": str(device)}

    snapshots = PodMemorySnapshots(root=root, owner=OWNER, rank=rank, world_size=WORLD)
    snapshots.checksum = (
        True  # its copies travel: the CRC32 is checked on arrival (for_job sets it)
    )
    copies = peer.PeerCopies(
        root=root,
        owner=OWNER,
        rank=rank,
        world_size=WORLD,
        local_world_size=1,
        events=events,
        published=snapshots.publication,
    )
    state = _state(device, numel, seed=rank)
    expected = _cpu(state)

    started = time.perf_counter()
    snapshots.prepare(state)
    report["prepare_s"] = time.perf_counter() - started
    started = time.perf_counter()
    snapshots.take(state, step=1)
    report["first_take_s"] = time.perf_counter() - started
    report["exchange_started"] = copies.exchange(step=1)
    report["blocked_s"] = copies.last_blocked_s

    steps_started = time.perf_counter()
    for _ in range(5):
        snapshots.before_update()
        for value in (state["model"]["w"], state["optim"]["exp_avg"]):
            value.mul_(-2.0).add_(1.0)
        dist.all_reduce(torch.ones(1))
    if not fake:
        torch.cuda.synchronize(device)
    report["steps_s"] = time.perf_counter() - steps_started
    report["in_flight_after_steps"] = copies.in_flight()
    copies.wait()
    snapshots.wait()
    report["exchange_s"] = copies.last_exchange_s
    report["pinned"] = [f.wait_pinned() for f in snapshots._files.values()]
    dist.barrier()

    # Node 1 lost and replaced.
    if rank == 1:
        snapshots.close(remove=False)
        shutil.rmtree(root, ignore_errors=True)
        state = _state(device, numel, seed=99)
        state["step"] = 0
    dist.barrier()
    tier = peer.PeerTier(
        peer.PeerCopies(
            root=root,
            owner=OWNER,
            rank=rank,
            world_size=WORLD,
            local_world_size=1,
            events=events,
            staging=None,
        )
    )

    class Trainer:
        def state_dict(self) -> dict:
            return state

        def load_state_dict(self, loaded: dict) -> None:
            assert loaded is state

    steps = tier.steps()
    report["peer_steps"] = steps
    outcome = tier.load(Trainer(), step=steps[0]) if steps else None
    report["restored"] = None if outcome is None or isinstance(outcome, Rejected) else outcome.path
    report["problem"] = outcome.problem if isinstance(outcome, Rejected) else None
    report["restored_equal"] = _equal(state, expected)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    copies.close()
    snapshots.close(remove=True)
    dist.destroy_process_group()


def main() -> None:
    out, numel = Path(sys.argv[1]), int(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    fake = os.environ.get("GPU_CHECK_FAKE_CUDA", "") == "1"
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    shm = base / f"gpu-check-peer-{uuid.uuid4().hex[:12]}"
    shm.mkdir()
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from support import free_port

    try:
        mp.start_processes(
            _rank,
            args=(str(out), str(shm), free_port(), numel, fake),
            nprocs=WORLD,
            start_method="spawn",
            join=True,
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
