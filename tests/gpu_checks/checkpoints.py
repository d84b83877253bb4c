"""The checkpoint checks: memory and pod-memory snapshots, the peer exchange, the asynchronous
engines (NVRx, torch) through the snapshot probe, and NVRx local checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from gpu_checks.core import (
    REPO_ROOT,
    Context,
    read_events,
    run_child,
    tail,
    tiny_model_args,
    torchrun,
)


def check_memory_snapshot(ctx: Context) -> dict[str, Any]:
    import torch

    from training.checkpoint.memory import MemorySnapshots

    boundary = ctx.boundary
    device = boundary.device()
    numel = (256 << 20) // 4 if not boundary.fake else 1 << 20  # 1 GiB of fp32 on the GPU
    state = {
        "model": {"w": torch.randn(numel, device=device), "b": torch.randn(4096, device=device)},
        "step": 7,
    }
    expected = {k: v.cpu().clone() for k, v in state["model"].items()}
    snapshots = MemorySnapshots()
    snapshots.take(state, owner="gpu_check", step=7, rank=0, world_size=1)  # allocates buffers
    boundary.synchronize()
    started = time.perf_counter()
    snapshots.take(state, owner="gpu_check", step=7, rank=0, world_size=1)
    take_s = time.perf_counter() - started
    snapshots.before_update()
    for value in state["model"].values():
        value.mul_(-2.0)  # the optimizer's in-place update, right after the snapshot
    state["step"] = 99
    boundary.synchronize()
    complete_s = time.perf_counter() - started
    snapshots.restore(state, step=7)
    equal = all(torch.equal(state["model"][k].cpu(), v) for k, v in expected.items())
    nbytes = sum(v.numel() * v.element_size() for v in expected.values())
    return {
        "ok": equal and state["step"] == 7,
        "restored_equal": equal,
        "bytes": nbytes,
        "take_s": round(take_s, 4),
        "copy_complete_s": round(complete_s, 4),
        "gb_per_s": round(nbytes / complete_s / 1e9, 2),
        "side_stream": bool(snapshots._streams),
    }


def _shm_dir(ctx: Context, name: str) -> Path:
    """A directory on tmpfs (``/dev/shm``, as the pods' ``pod_memory_dir``): cudaHostRegister
    pins file mappings with FOLL_LONGTERM, which kernels >= 6.5 allow on shmem only."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else ctx.work
    path = base / f"gpu-check-{name}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def check_pod_memory_snapshot(ctx: Context) -> dict[str, Any]:
    import torch

    from training.checkpoint.pod_memory import PodMemorySnapshots

    boundary = ctx.boundary
    device = boundary.device()
    numel = (256 << 20) // 4 if not boundary.fake else 1 << 20  # 1 GiB of fp32 on the GPU
    state = {
        "model": {"w": torch.randn(numel, device=device), "b": torch.randn(4096, device=device)},
        "step": 7,
    }
    expected = {k: v.cpu().clone() for k, v in state["model"].items()}
    root = _shm_dir(ctx, "pod-memory")
    snapshots = PodMemorySnapshots(root=root, owner="gpu_check", rank=0, world_size=1)
    try:
        started = time.perf_counter()
        snapshots.prepare(state)
        prepare_s = time.perf_counter() - started
        boundary.synchronize()
        started = time.perf_counter()
        snapshots.take(state, step=7)  # waits for its slot's registration
        first_take_s = time.perf_counter() - started
        snapshots.before_update()
        for value in state["model"].values():
            value.mul_(-2.0)  # the optimizer's in-place update, right after the snapshot
        state["step"] = 99
        snapshots.wait()
        first_complete_s = time.perf_counter() - started
        pinned = [f.wait_pinned() for f in snapshots._files.values()]
        path, problem = snapshots.check(state, step=7)
        restored_equal = False
        if problem is None and path is not None:
            snapshots.restore(state, path=path)
            restored_equal = all(
                torch.equal(state["model"][k].cpu(), v) for k, v in expected.items()
            )
        boundary.synchronize()
        started = time.perf_counter()
        snapshots.take(state, step=8)  # the other slot, registered by prepare meanwhile
        second_take_s = time.perf_counter() - started
        snapshots.wait()
        second_complete_s = time.perf_counter() - started
    finally:
        snapshots.close(remove=True)
        shutil.rmtree(root, ignore_errors=True)
    nbytes = sum(v.numel() * v.element_size() for v in expected.values())
    return {
        "ok": restored_equal and state["step"] == 7 and problem is None,
        "restored_equal": restored_equal,
        "problem": problem,
        "bytes": nbytes,
        "pinned": pinned,
        "prepare_s": round(prepare_s, 4),
        "first_take_s": round(first_take_s, 4),
        "first_complete_s": round(first_complete_s, 4),
        "second_take_s": round(second_take_s, 4),
        "second_complete_s": round(second_complete_s, 4),
        "stray_context_check": "needs 2 GPUs (a rank on GPU 1, no context of it on GPU 0); "
        "tests/training/checkpoint/test_device_threads.py pins the binding on CPU",
    }


def check_peer_exchange(ctx: Context) -> dict[str, Any]:
    numel = (128 << 20) // 4 if not ctx.boundary.fake else 1 << 16  # 512 MiB of fp32 per rank
    result_dir = ctx.work / "peer_probe"
    command = [
        sys.executable,
        str(REPO_ROOT / "tests/training/probes/peer_probe.py"),
        str(result_dir),
        str(numel),
    ]
    log = ctx.work / "peer_probe.log"
    proc = run_child(ctx, command, log=log, cap_s=180)
    if proc.returncode != 0:
        return {"ok": False, "returncode": proc.returncode, "tail": tail(log)}
    reports = [json.loads((result_dir / f"rank{rank}.json").read_text()) for rank in range(2)]
    problems = []
    for report in reports:
        rank = report["rank"]
        if not report["exchange_started"]:
            problems.append(f"rank {rank}: the exchange did not start")
        if report["problem"] or not report["restored"]:
            problems.append(f"rank {rank}: not restored ({report['problem']})")
        if not report["restored_equal"]:
            problems.append(f"rank {rank}: the restored state differs")
    if reports[1]["restored"] is not None and not reports[1]["restored"].startswith("peer"):
        problems.append(f"rank 1 restored from {reports[1]['restored']}, not its peer")
    keys = ("device", "pinned", "first_take_s", "blocked_s", "steps_s", "in_flight_after_steps")
    return {
        "ok": not problems,
        "problems": problems,
        "bytes_per_rank": numel * 4 * 5 // 4 + 4096 * 4,
        "exchange_s": [round(r["exchange_s"], 4) for r in reports],
        **{key: [r[key] for r in reports] for key in keys},
    }


def _snapshot_probe(ctx: Context, *, engine: str) -> dict[str, Any]:
    nproc = min(2, ctx.boundary.gpus())
    result_dir = ctx.work / f"probe_{engine}"
    command = [
        *torchrun(nproc),
        str(REPO_ROOT / "tests/training/probes/snapshot_probe.py"),
        str(result_dir),
        engine,
        "--",
        f"--data.path={ctx.corpus}",
        *tiny_model_args(),
        *ctx.boundary.trainer_args(),
    ]
    log = ctx.work / f"probe_{engine}.log"
    proc = run_child(ctx, command, log=log, cap_s=150)
    if proc.returncode != 0:
        return {"ok": False, "returncode": proc.returncode, "tail": tail(log)}
    reports = [
        json.loads((result_dir / f"probe_rank{rank}.json").read_text()) for rank in range(nproc)
    ]
    problems = []
    for rank, report in enumerate(reports):
        for key in ("mismatched", "touched_by_rejected_load", "fallback_mismatched"):
            if report[key]:
                problems.append(f"rank {rank}: {key} {report[key][:3]}")
        if not report["damaged_load_raised"]:
            problems.append(f"rank {rank}: the damaged checkpoint loaded")
        if report["fallback_step"] != 3:
            problems.append(f"rank {rank}: fallback loaded step {report['fallback_step']}")
    rank0 = reports[0]
    for key in ("crc_problems", "cached_differs", "prepared_differs"):
        if rank0[key]:
            problems.append(f"{key}: {rank0[key][:3]}")
    return {
        "ok": not problems,
        "ranks": nproc,
        "problems": problems,
        "tensors": rank0["tensors"],
        "damaged_shard": rank0["damaged_shard"],
        "damaged_load_problem": rank0["damaged_load_problem"],
    }


def check_nvrx_snapshot(ctx: Context) -> dict[str, Any]:
    return _snapshot_probe(ctx, engine="nvrx")


def check_torch_async(ctx: Context) -> dict[str, Any]:
    detail = _snapshot_probe(ctx, engine="torch_async")
    from training.checkpoint.manager import needs_cpu_collectives
    from training.config import CheckpointConfig
    from training.parallel import process_group_backend

    detail["process_group_backend"] = process_group_backend(
        ctx.boundary.device(),
        cpu_collectives=needs_cpu_collectives(CheckpointConfig(engine="torch_async")),
    )
    return detail


def _train(ctx: Context, run_dir: Path, *args: str, name: str, cap_s: float):
    command = [
        *torchrun(1),
        "-m",
        "training",
        "train",
        "--run-dir",
        str(run_dir),
        f"--data.path={ctx.corpus}",
        *tiny_model_args(),
        *ctx.boundary.trainer_args(),
        *args,
    ]
    log = ctx.work / f"{name}.log"
    return run_child(ctx, command, log=log, cap_s=cap_s), log


def check_local_checkpoint(ctx: Context) -> dict[str, Any]:
    import torch
    from support import final_state

    run_dir = ctx.work / "local_run"
    args = (
        "--train.steps=8",
        "--checkpoint.interval=0",
        f"--checkpoint.local_dir={ctx.work / 'nvme'}",
        "--checkpoint.local_interval=3",
    )
    first, log = _train(ctx, run_dir, *args, name="local_first", cap_s=120)
    if first.returncode != 0:
        return {"ok": False, "run": "first", "tail": tail(log)}
    reference = final_state(run_dir)
    shutil.rmtree(run_dir / "checkpoints")  # only the local tier (steps 3 and 6) is left
    second, log = _train(ctx, run_dir, *args, name="local_second", cap_s=120)
    if second.returncode != 0:
        return {"ok": False, "run": "second", "tail": tail(log)}
    loads = [e for e in read_events(run_dir) if e["kind"] == "checkpoint_load"]
    resumed = final_state(run_dir)
    differ = []
    for key, value in reference.items():
        if not (isinstance(value, torch.Tensor) and key.startswith("trainer.model.")):
            continue
        if not torch.allclose(resumed[key].float(), value.float(), rtol=2e-2, atol=2e-3):
            differ.append(key)
    source = (loads[-1]["source"], loads[-1]["step"]) if loads else None
    return {
        "ok": source == ("local", 6) and not differ,
        "loaded": source,
        "load_s": round(loads[-1]["seconds"], 3) if loads else None,
        "model_tensors_differ": differ[:5],
    }
