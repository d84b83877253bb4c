"""After a restore of step S, no tier offers a state of the timeline that died (issue #43,
review "checkpoint-tiers" finding 2).

Run: ``.venv/bin/pytest tests/training/checkpoint/test_timelines.py -x -q`` (two real gloo
ranks, spawned once: ~20 s alone on 2 cores, a minute under load).

Two ranks, each its own "node" (``LOCAL_WORLD_SIZE=1``) with its own pod memory (a directory
under /dev/shm, a tmpfs as the pod's emptyDir is), through the real ``CheckpointManager`` of
the job's config (``for_job``). Each attempt is a new manager, as in a new process
(``PodMemorySnapshots._LIVE`` cleared: its only state a process keeps).

The fault the review found: rank 1 dies while it publishes its snapshot of step 20 (its meta
never written), so the ranks' common step is 10 and the restart restores 10, while rank 0
(and the peer copy of rank 0's shard on node 1) still hold timeline 1's step 20. On CPU a
replay is bit-identical to the timeline that died, so the test makes them differ: timeline 1's
weights are ``1000 + step``, timeline 2's ``2000 + step`` (on a GPU they differ by atomics,
split-K and NCCL's algorithm choice). The replay reaches step 20 again and a third attempt
must restore timeline 2's step 20 on every rank. The same for the process-memory tier
(in-process restarts; there no peer exchange, so rank 1 simply took no snapshot of 20).
NVRx's local NVMe tier needs CUDA tensors and is not run here.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(240)]

WORLD = 2


def _take_all(manager: Any, trainer: Any, *, step: int) -> None:
    """Every snapshot tier's take, off the schedule (``CheckpointManager.after_step``)."""
    for tier in manager.snapshot_tiers:
        tier.take(trainer, step=step)


class _Trainer:
    """The manager's ``StatefulTrainer``: one weight vector and the step."""

    def __init__(self) -> None:
        self.w = torch.zeros(256)
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["w"] is not self.w:
            self.w.copy_(state["w"])
        self.step = int(state["step"])


def _ranks(rank: int, base: str, out: str, port: int) -> None:
    import torch.distributed as dist

    from training.checkpoint import snapshot_files as sf
    from training.checkpoint.manager import CheckpointManager
    from training.checkpoint.memory import SNAPSHOTS
    from training.checkpoint.pod_memory import PodMemorySnapshots
    from training.config import CheckpointConfig, JobConfig, ResilienceConfig
    from training.runlog.metrics import EventLog

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["TORCHELASTIC_RUN_ID"] = "timelines"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    results: dict[str, Any] = {}

    def manager(case: str, *, restart: str, pod_memory_dir: str, peer_copy: bool):
        config = JobConfig(
            run_dir=f"{out}/{case}",
            checkpoint=CheckpointConfig(
                engine="sync",
                interval=0,
                memory_interval=1,
                pod_memory_dir=pod_memory_dir,
                peer_copy=peer_copy,
            ),
            resilience=ResilienceConfig(restart=restart),
        )
        PodMemorySnapshots._LIVE.clear()  # a new process: nothing but the pod's files remains
        m = CheckpointManager.for_job(
            config=config,
            rank=rank,
            world_size=WORLD,
            events=EventLog(run_dir=Path(out) / case, rank=rank),
        )
        m.start()
        return m

    def at(trainer: _Trainer, step: int, timeline: int) -> None:
        trainer.step = step
        trainer.w.fill_(1000.0 * timeline + step)

    def newer_held(pods: list[Path], step: int) -> list[str]:
        return sorted(
            f"{pod.name}/{kind}/rank-{meta.rank}/step-{meta.step}"
            for pod in pods
            for kind in sf.KINDS
            for run in pod.glob("run-*")
            for _, meta in sf.list_snapshots(run, kind=kind)
            if meta.step > step
        )

    def duplicates(pods: list[Path]) -> list[str]:
        seen, twice = set(), []
        for pod in pods:
            for kind in sf.KINDS:
                for run in pod.glob("run-*"):
                    for _, meta in sf.list_snapshots(run, kind=kind):
                        key = (pod.name, kind, meta.rank, meta.step)
                        if key in seen:
                            twice.append("/".join(map(str, key)))
                        seen.add(key)
        return twice

    # --- pod memory with the peer copy ------------------------------------------------------
    pods = [Path(base) / f"node-{n}" for n in range(WORLD)]
    mine = str(pods[rank])
    trainer = _Trainer()
    m = manager("pod", restart="injob", pod_memory_dir=mine, peer_copy=True)
    assert m.load_latest(trainer) is None
    for step in (8, 10, 20):
        at(trainer, step, timeline=1)
        if rank == 1 and step == 20:
            # Killed in the middle of the publish: the slot is written, its meta never is.
            [tier] = m.snapshot_tiers  # the peer tier over the pod-memory one
            tier.copies.settle()  # collective, as in PeerSnapshotTier.take
            tier.pod_memory.snapshots.take(trainer.state_dict(), step=step)
            tier.pod_memory.snapshots.wait()
            [torn] = [d for d, meta in tier.pod_memory.snapshots.held() if meta.step == 20]
            sf.unpublish(torn)
            tier.copies.exchange(step=step)
        else:
            _take_all(m, trainer, step=step)
    dist.barrier()

    trainer = _Trainer()
    m = manager("pod", restart="injob", pod_memory_dir=mine, peer_copy=True)
    results[f"pod-first-{rank}"] = m.load_latest(trainer)
    dist.barrier()
    if rank == 0:
        results["pod-newer-after-restore"] = newer_held(pods, 10)
    dist.barrier()
    for step in (12, 14, 16, 18, 20):
        at(trainer, step, timeline=2)
        _take_all(m, trainer, step=step)
    dist.barrier()
    if rank == 0:
        results["pod-duplicates"] = duplicates(pods)
    dist.barrier()

    trainer = _Trainer()
    m = manager("pod", restart="injob", pod_memory_dir=mine, peer_copy=True)
    results[f"pod-second-{rank}"] = [m.load_latest(trainer), float(trainer.w[0])]
    m.close()

    # --- process memory (in-process restarts) -----------------------------------------------
    trainer = _Trainer()
    m = manager("process", restart="inprocess", pod_memory_dir="", peer_copy=False)
    assert m.load_latest(trainer) is None
    for step in (10, 20):
        at(trainer, step, timeline=1)
        if not (rank == 1 and step == 20):  # rank 1 faulted before its copy of 20
            _take_all(m, trainer, step=step)
    m.abandon()
    trainer = _Trainer()
    m = manager("process", restart="inprocess", pod_memory_dir="", peer_copy=False)
    results[f"process-first-{rank}"] = m.load_latest(trainer)
    results[f"process-newer-after-restore-{rank}"] = SNAPSHOTS.steps(
        owner=str(m.root), rank=rank, world_size=WORLD
    )
    at(trainer, 20, timeline=2)
    _take_all(m, trainer, step=20)
    m.abandon()
    trainer = _Trainer()
    m = manager("process", restart="inprocess", pod_memory_dir="", peer_copy=False)
    results[f"process-second-{rank}"] = [m.load_latest(trainer), float(trainer.w[0])]
    m.close()

    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch.multiprocessing as mp
    from support import free_port

    out = tmp_path_factory.mktemp("timelines")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    base = shm / f"test-timelines-{uuid.uuid4().hex[:12]}"
    base.mkdir()
    try:
        mp.start_processes(
            _ranks, args=(str(base), str(out), free_port()), nprocs=WORLD, start_method="spawn"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)  # the run directories and their locks
    merged: dict[str, Any] = {}
    for rank in range(WORLD):
        merged.update(json.loads((out / f"rank{rank}.json").read_text()))
    return merged


def test_a_restore_removes_every_newer_snapshot_in_every_pod(seen: dict) -> None:
    assert seen["pod-first-0"] == seen["pod-first-1"] == 10
    # Rank 0's own 20 and node 1's peer copy of it: the timeline that died.
    assert seen["pod-newer-after-restore"] == []


def test_a_replayed_step_never_sits_beside_the_dead_timelines(seen: dict) -> None:
    assert seen["pod-duplicates"] == []


def test_every_rank_restores_the_live_timeline_from_pod_memory(seen: dict) -> None:
    assert seen["pod-second-0"] == seen["pod-second-1"] == [20, 2020.0]


def test_every_rank_restores_the_live_timeline_from_process_memory(seen: dict) -> None:
    assert seen["process-first-0"] == seen["process-first-1"] == 10
    assert seen["process-newer-after-restore-0"] == [10]
    assert seen["process-second-0"] == seen["process-second-1"] == [20, 2020.0]
