"""GPU-only resilience paths: NVRx local checkpoints on node-local storage, in-process restart
with NCCL abort and CUDA health checks, NVRx async checkpoints staged by the D2H copy.

Run: ``.venv/bin/pytest tests/training/resilience/test_gpu_resilience.py`` on a machine with CUDA
(all tests are marked ``gpu`` and skipped without one; this repository's CI has no GPU). The CPU
behaviour of the same code paths is covered by test_checkpoint.py and test_resilience.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support import TINY_MODEL, events, final_state, launch_local, run_torchrun

GPU_ARGS = ("--parallel.device=cuda", "--parallel.mixed_precision=bf16", *TINY_MODEL)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_local_checkpoint_is_preferred_when_newer(tmp_path: Path, corpus: Path) -> None:
    """Local (NVMe) checkpoints every 3 steps; with the shared ones gone, a restart resumes from
    the newest local one and ends where the uninterrupted run ended."""
    run_dir = tmp_path / "run"
    args = (
        *GPU_ARGS,
        f"--data.path={corpus}",
        "--train.steps=8",
        "--checkpoint.interval=0",
        f"--checkpoint.local_dir={tmp_path / 'nvme'}",
        "--checkpoint.local_interval=3",
    )
    first = run_torchrun(nproc=1, run_dir=run_dir, args=args, timeout=250)
    assert first.returncode == 0, first.output[-4000:]
    reference = final_state(run_dir)
    shutil.rmtree(run_dir / "checkpoints")  # only the local tier (steps 3 and 6) is left
    second = run_torchrun(nproc=1, run_dir=run_dir, args=args, timeout=250)
    assert second.returncode == 0, second.output[-4000:]
    loads = [e for e in events(run_dir) if e["kind"] == "checkpoint_load"]
    assert loads and loads[-1]["source"] == "local" and loads[-1]["step"] == 6
    resumed = final_state(run_dir)
    for key, value in reference.items():
        if isinstance(value, torch.Tensor) and key.startswith("trainer.model."):
            torch.testing.assert_close(resumed[key], value, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_inprocess_restart_on_nccl_with_cuda_health_check(tmp_path: Path, corpus: Path) -> None:
    """An exception and a hang on CUDA ranks: NCCL abort releases the peers, the CUDA health
    check passes, and the run completes in the same processes."""
    nproc = min(2, torch.cuda.device_count())
    run_dir = tmp_path / "run"
    proc = launch_local(
        run_dir,
        corpus,
        "--train.steps=20",
        "--checkpoint.interval=5",
        "--resilience.soft_timeout_s=10",
        "--resilience.hard_timeout_s=40",
        *GPU_ARGS,
        "--restart=inprocess",
        f"--train.micro_batch_size={8 // nproc}",
        f"--faults=exception@0:5;hang@{nproc - 1}:12",
        nproc=nproc,
        timeout=360,
    )
    assert proc.returncode == 0, proc.log.read_text()[-4000:]
    restarts = [e for e in events(run_dir) if e["kind"] == "restart_end"]
    assert len({e["attempt"] for e in restarts}) == 2


@pytest.mark.gpu
def test_nvrx_async_save_is_an_exact_snapshot_on_cuda(tmp_path: Path, corpus: Path) -> None:
    """On GPU the staging copy is NVRx's own device-to-host preload (no CPU clone)."""
    import subprocess

    from support import REPO_ROOT, VENV_BIN, subprocess_env

    result_dir = tmp_path / "probe"
    command = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node=1",
        str(REPO_ROOT / "tests/training/probes/snapshot_probe.py"),
        str(result_dir),
        "nvrx",
        "--",
        f"--data.path={corpus}",
        *GPU_ARGS,
    ]
    proc = subprocess.run(
        command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((result_dir / "probe_rank0.json").read_text())
    assert report["mismatched"] == []


def _report_device(path: str) -> None:
    """Runs in NVRx's persistent worker (imported there by name)."""
    Path(path).write_text(str(torch.cuda.current_device()))


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_checkpoint_worker_is_bound_to_the_ranks_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persistent worker's CUDA device is LOCAL_RANK's (the last GPU here), not GPU 0."""
    from functools import partial

    import torch.distributed as dist
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    from training.checkpoint import nvrx_async as nvrx

    last = torch.cuda.device_count() - 1
    monkeypatch.setenv("LOCAL_RANK", str(last))
    torch.cuda.set_device(last)
    dist.init_process_group(
        "nccl",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", last),
    )
    try:
        queue = nvrx.AsyncCheckpointQueue()
        queue.start_worker()
        out = tmp_path / "device.txt"
        queue.schedule_request(AsyncRequest(partial(_report_device, str(out)), (), []))
        queue.poll(blocking=True)
        assert out.read_text() == str(last)
        queue.close()
    finally:
        nvrx.stop_shared_worker()
        dist.destroy_process_group()


@pytest.mark.gpu
def test_stage_copies_cuda_tensors_completely_before_returning() -> None:
    from training.checkpoint import nvrx_async as nvrx

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    big = torch.randn(64 << 20, device=device)  # 256 MiB: the copy takes a while
    buckets = [("f", "k", ([], [("big", big)]))]
    staged = nvrx.stage(buckets)
    host = staged[0][2][1][0][1]
    assert host.device.type == "cpu"
    big.zero_()  # after stage returns, changes must not reach the staged copy
    torch.cuda.synchronize(device)
    assert host.abs().sum().item() > 0 and buckets == []


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_a_failed_attempt_aborts_nccl_before_ending_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a fault the attempt's NCCL group is aborted (torch's ``_abort_process_group``), not
    shut down gracefully (``destroy_process_group`` waits for collectives in flight), and the
    group is gone afterwards so the next attempt can create its own."""
    import torch.distributed as dist

    from training.run import release_process_group_after_fault

    calls: list[str] = []
    real_abort = dist.distributed_c10d._abort_process_group
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(
        dist.distributed_c10d,
        "_abort_process_group",
        lambda *a: calls.append("abort") or real_abort(*a),
    )
    monkeypatch.setattr(
        dist, "destroy_process_group", lambda *a: calls.append("destroy") or real_destroy(*a)
    )
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    dist.all_reduce(torch.ones(1, device=device))
    release_process_group_after_fault()
    assert calls[0] == "abort" and not dist.is_initialized()


@pytest.mark.gpu
def test_memory_snapshot_copies_on_a_side_stream_and_the_update_waits_for_them() -> None:
    """The device-to-host copies of a snapshot run on a side stream, not the compute stream,
    and ``before_update`` makes the compute stream wait for them: an in-place update enqueued
    right after cannot reach the snapshot (the compute stream is kept busy first, so a copy that
    did not wait would see the update)."""
    from training.checkpoint.memory import MemorySnapshots

    device = torch.device("cuda", 0)
    state = {"w": torch.arange(1 << 24, device=device, dtype=torch.float32)}
    expected = state["w"].cpu()
    snapshots = MemorySnapshots()
    snapshots.take(state, owner="t", step=1, rank=0, world_size=1)
    (slot,) = [s for s in snapshots._slots if s.step == 1]
    assert slot.ready is not None
    assert snapshots._streams[device] != torch.cuda.current_stream(device)
    snapshots.before_update()
    state["w"].add_(1.0)  # the optimizer's in-place update
    torch.cuda.synchronize()
    snapshots.restore(state, step=1)
    torch.testing.assert_close(state["w"].cpu(), expected)
