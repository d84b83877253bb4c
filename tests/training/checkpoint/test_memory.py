"""``training.checkpoint.memory``: the in-memory snapshots an in-process restart restores, and
the manager's choice between them and the checkpoints on storage.

Real tensors, a real one-rank gloo group and the manager's real saves and loads; the
multi-rank, real-fault version is the in-process case of
tests/training/resilience/test_resilience.py's fault matrix (bit-identical to a run without
faults). The CUDA path (pinned buffers, the copy's event) needs a GPU: the ``gpu`` test."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpoint.layout import step_dir
from training.checkpoint.manager import CheckpointManager
from training.checkpoint.memory import MemorySnapshots, ProcessMemorySnapshotTier
from training.config import POD_MEMORY_DIR, CheckpointConfig, JobConfig, ResilienceConfig
from training.runlog import writer
from training.runlog.files import read_jsonl
from training.runlog.metrics import EventLog


def _take_all(manager: Any, trainer: Any, *, step: int) -> None:
    """Every snapshot tier's take, off the schedule (``CheckpointManager.after_step``)."""
    for tier in manager.snapshot_tiers:
        tier.take(trainer, step=step)


def _state(fill: float, *, step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64,), fill), "b": torch.full((3, 2), fill)},
        "optim": {
            "state": {"w": {"exp_avg": torch.full((64,), fill), "step": torch.tensor(fill)}},
            "param_groups": [{"lr": fill, "betas": (0.9, 0.95), "params": ["w"]}],
        },
        "sampler": {"epoch": step // 7, "position": step},
        "step": step,
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _take(snapshots: MemorySnapshots, state: dict, *, step: int, owner: str = "run") -> None:
    snapshots.take(state, owner=owner, step=step, rank=0, world_size=1)


def test_a_snapshot_restores_the_state_it_copied_into_the_same_tensors() -> None:
    snapshots = MemorySnapshots()
    live = _state(1.0, step=10)
    _take(snapshots, live, step=10)
    expected = copy.deepcopy(live)
    # The trainer goes on: every tensor changes in place, every value is replaced.
    for tensor in (live["model"]["w"], live["model"]["b"], live["optim"]["state"]["w"]["step"]):
        tensor.add_(5.0)
    live["optim"]["param_groups"][0]["lr"] = 9.0
    live["sampler"]["position"] = 99

    fresh = _state(0.0, step=0)  # the next attempt's trainer, built anew
    tensors_before = [fresh["model"]["w"], fresh["optim"]["state"]["w"]["exp_avg"]]
    snapshots.restore(fresh, step=10)

    assert _equal(fresh, expected)
    assert fresh["model"]["w"] is tensors_before[0], "tensors are restored in place"
    assert fresh["optim"]["state"]["w"]["exp_avg"] is tensors_before[1]
    assert fresh["sampler"] is not live["sampler"], "values are copies, not the live objects"


class _Interrupt:
    """A value whose copy raises, as an in-process restart's asynchronous exception would in
    the middle of a snapshot."""

    def __deepcopy__(self, memo: dict) -> Any:
        raise RuntimeError("interrupted mid-copy")


def test_a_copy_interrupted_midway_leaves_the_previous_snapshot_and_is_never_offered() -> None:
    snapshots = MemorySnapshots()
    _take(snapshots, _state(1.0, step=10), step=10)
    _take(snapshots, _state(2.0, step=20), step=20)
    torn = _state(3.0, step=30)
    torn["sampler"]["zz_interrupt"] = _Interrupt()  # sorted last: every tensor copied before
    with pytest.raises(RuntimeError, match="mid-copy"):
        _take(snapshots, torn, step=30)  # overwrites the slot of step 10

    assert snapshots.steps(owner="run", rank=0, world_size=1) == [20]
    restored = _state(0.0, step=0)
    snapshots.restore(restored, step=20)
    assert _equal(restored, _state(2.0, step=20))
    with pytest.raises(ValueError, match="step 30"):
        snapshots.restore(_state(0.0, step=0), step=30)


def test_snapshots_are_offered_only_to_their_own_run_rank_and_world_size() -> None:
    snapshots = MemorySnapshots()
    snapshots.take(_state(1.0, step=10), owner="run-a", step=10, rank=1, world_size=4)
    assert snapshots.steps(owner="run-a", rank=1, world_size=4) == [10]
    assert snapshots.steps(owner="run-b", rank=1, world_size=4) == []
    assert snapshots.steps(owner="run-a", rank=0, world_size=4) == []
    assert snapshots.steps(owner="run-a", rank=1, world_size=2) == []
    snapshots.clear()
    assert snapshots.steps(owner="run-a", rank=1, world_size=4) == []


def test_a_snapshot_of_another_structure_is_not_restored() -> None:
    snapshots = MemorySnapshots()
    _take(snapshots, _state(1.0, step=10), step=10)
    other = _state(0.0, step=0)
    other["model"]["w"] = torch.zeros(65)  # another shape
    assert not snapshots.matches(other, step=10)
    with pytest.raises(ValueError, match="no restorable"):
        snapshots.restore(other, step=10)
    assert torch.equal(other["model"]["w"], torch.zeros(65)), "nothing was changed"


# --- the manager: which state an in-process restart loads --------------------------------------


class _Trainer:
    """A stateful trainer for the manager (DCP and the snapshots see the same state_dict)."""

    def __init__(self, fill: float, *, step: int = 0) -> None:
        self.step = step
        self.w = torch.full((256,), fill)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w.copy_(state["w"])
        self.step = int(state["step"])


def _manager(root: Path, snapshots: MemorySnapshots | None) -> CheckpointManager:
    events = EventLog(run_dir=root.parent, rank=0)
    tier = ProcessMemorySnapshotTier(
        snapshots=snapshots, interval=5, owner=str(root), rank=0, world_size=1, events=events
    )
    manager = CheckpointManager(
        config=CheckpointConfig(engine="sync", memory_interval=5),
        root=root,
        rank=0,
        world_size=1,
        events=events,
        snapshot_tiers=[tier] if snapshots is not None else [],
    )
    manager.start()
    return manager


def _loads(root: Path) -> list[tuple[int, str]]:
    writer.flush()  # this process's queued event lines
    events, _ = read_jsonl(root.parent / "events.jsonl")
    return [(e["step"], e["source"]) for e in events if e["kind"] == "checkpoint_load"]


@pytest.mark.distributed
def test_an_in_process_restart_loads_the_newest_of_memory_and_storage(
    tmp_path: Path, one_rank_group: None
) -> None:
    """Memory when its snapshot is newer than every sound checkpoint on storage (also after
    the newest is found damaged), storage when that is newer."""
    root = tmp_path / "checkpoints"
    snapshots = MemorySnapshots()
    first = _manager(root, snapshots)
    first.save(_Trainer(1.0, step=10), step=10, blocking=True)
    _take_all(first, _Trainer(1.5, step=15), step=15)
    first.abandon()  # a fault: the attempt ends, the process stays

    restarted = _Trainer(0.0)
    second = _manager(root, snapshots)
    assert second.resume_expected()
    assert second.load_latest(restarted) == 15
    assert restarted.step == 15 and torch.equal(restarted.w, torch.full((256,), 1.5))
    assert second.latest_step() == 10, "the newest committed checkpoint is still step 10"
    second.save(_Trainer(2.0, step=20), step=20, blocking=True)
    second.abandon()

    third = _Trainer(0.0)
    assert _manager(root, snapshots).load_latest(third) == 20, "storage is newer"
    assert torch.equal(third.w, torch.full((256,), 2.0))

    # The newest on storage damaged: the snapshot of 15 is newer than the fallback, 10.
    shard = next(step_dir(root, 20).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    fourth = _Trainer(0.0)
    with pytest.warns(UserWarning, match="step_00000020 is damaged"):
        assert _manager(root, snapshots).load_latest(fourth) == 15
    assert torch.equal(fourth.w, torch.full((256,), 1.5))
    assert _loads(root) == [(15, "memory"), (20, "storage"), (15, "memory")]


@pytest.mark.distributed
def test_a_new_process_or_another_run_finds_no_snapshot(
    tmp_path: Path, one_rank_group: None
) -> None:
    root = tmp_path / "checkpoints"
    snapshots = MemorySnapshots()
    first = _manager(root, snapshots)
    first.save(_Trainer(1.0, step=10), step=10, blocking=True)
    _take_all(first, _Trainer(1.5, step=15), step=15)
    first.abandon()

    fresh_process = _Trainer(0.0)  # an in-job restart: new processes, empty snapshots
    assert _manager(root, MemorySnapshots()).load_latest(fresh_process) == 10
    other_run = _Trainer(0.0)
    other_root = tmp_path / "other" / "checkpoints"
    assert _manager(other_root, snapshots).load_latest(other_run) is None


@pytest.mark.parametrize(
    ("restart", "interval", "pod_memory_dir", "tier"),
    [
        ("inprocess", 10, POD_MEMORY_DIR, "pod_memory"),
        ("nested", 10, POD_MEMORY_DIR, "pod_memory"),
        ("injob", 10, POD_MEMORY_DIR, "pod_memory"),
        ("inprocess", 10, "", "memory"),
        ("nested", 10, "", "memory"),
        ("injob", 10, "", None),  # new processes: nothing in process memory outlives them
        ("none", 10, POD_MEMORY_DIR, None),
        ("inprocess", 0, POD_MEMORY_DIR, None),
    ],
)
def test_snapshots_are_taken_only_where_a_restart_can_restore_them(
    tmp_path: Path, restart: str, interval: int, pod_memory_dir: str, tier: str | None
) -> None:
    config = JobConfig(
        run_dir=str(tmp_path),
        checkpoint=CheckpointConfig(memory_interval=interval, pod_memory_dir=pod_memory_dir),
        resilience=ResilienceConfig(restart=restart),
    )
    manager = CheckpointManager.for_job(
        config=config, rank=0, world_size=1, events=EventLog(run_dir=tmp_path, rank=0)
    )
    assert [t.name for t in manager.snapshot_tiers] == ([tier] if tier else [])
    names = [t.name for t in manager.tiers]
    assert names == [*([tier] if tier else []), "storage"], names


@pytest.mark.gpu
def test_a_snapshot_of_cuda_tensors_is_the_state_at_its_step() -> None:
    """On a GPU the copy is asynchronous (pinned host buffers, ordered on the compute stream):
    the step after the snapshot changes the tensors, and the snapshot still holds the old
    values; restored into CUDA tensors of a new attempt."""
    snapshots = MemorySnapshots()
    live = {"w": torch.randn(1 << 20, device="cuda"), "step": 3}
    expected = live["w"].cpu()
    _take(snapshots, live, step=3)
    live["w"].mul_(2.0)  # queued after the copies on the same stream
    assert snapshots.steps(owner="run", rank=0, world_size=1) == [3]
    restored = {"w": torch.zeros(1 << 20, device="cuda"), "step": 0}
    snapshots.restore(restored, step=3)
    assert torch.equal(restored["w"].cpu(), expected) and restored["step"] == 3


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_save_step_takes_a_snapshot_too(tmp_path: Path, corpus: Path, one_rank_group) -> None:
    """The issue's run: ``--checkpoint.interval=10`` with the recipe's ``memory_interval`` of
    10. Every memory step was a save step, and a save step took no snapshot, so the pod-memory
    tier (and the peer copy riding on it) took nothing at all and a lost node restored from
    storage. A snapshot is now taken at save steps too: a restart shortly after a committed
    save restores it from memory (one host copy per interval) instead of reading the whole
    checkpoint back from storage. One real rank of the real trainer and manager."""
    import uuid

    from support import TINY_MODEL

    from training.overrides import build_config
    from training.run import run_training

    shm = Path("/dev/shm") / f"test-save-step-{uuid.uuid4().hex[:12]}"
    config, _ = build_config(
        [
            *TINY_MODEL,
            "--run-dir",
            str(tmp_path / "run"),
            f"--data.path={corpus}",
            "--restart=injob",
            "--train.steps=20",
            "--checkpoint.interval=10",
            "--checkpoint.engine=sync",
            f"--checkpoint.pod_memory_dir={shm}",
        ]
    )
    assert config.checkpoint.memory_interval == 10  # the recipe's
    try:
        run_training(config, rank=0, world_size=1)
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    events, _ = read_jsonl(tmp_path / "run" / "events.jsonl")
    snapshots = [e["step"] for e in events if e["kind"] == "memory_snapshot"]
    saves = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert snapshots == [10] and saves == [10, 20], (snapshots, saves)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_fault_during_close_after_the_runs_end_leaves_nothing_in_pod_memory(
    tmp_path: Path, one_rank_group, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run.py: ``checkpoints.close()`` after the last step; an in-process restart landing in it
    (here: its wait raises, as NVRx's Wrapper interrupts a rank) sends the manager to
    ``release_leftovers`` -> ``abandon``, which left the pod-memory and peer files in /dev/shm
    until the pod ended. The final checkpoint is committed by then (the trainer waited for it),
    so the abandon of a closing manager removes them as close would have."""
    import uuid

    shm = Path("/dev/shm") / f"test-close-{uuid.uuid4().hex[:12]}"
    config = JobConfig(
        run_dir=str(tmp_path),
        checkpoint=CheckpointConfig(
            engine="sync", interval=0, memory_interval=1, pod_memory_dir=str(shm)
        ),
        resilience=ResilienceConfig(restart="injob"),
    )
    manager = CheckpointManager.for_job(
        config=config, rank=0, world_size=1, events=EventLog(run_dir=tmp_path, rank=0)
    )
    try:
        manager.start()
        _take_all(manager, _Trainer(1.0, step=3), step=3)
        [pod_memory] = manager.snapshot_tiers
        pod_memory.snapshots.wait()
        assert [p for p in shm.rglob("*") if p.is_file() and p.name != "meta"]

        def interrupted() -> None:
            raise RuntimeError("in-process restart")

        monkeypatch.setattr(manager, "wait", interrupted)
        with pytest.raises(RuntimeError, match="in-process restart"):
            manager.close()
        manager.abandon()  # run.release_leftovers
        left = [str(p.relative_to(shm)) for p in shm.rglob("*") if p.is_file()]
        assert left == [], left
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def test_an_own_snapshot_gets_a_crc32_only_when_a_peer_copy_carries_it(tmp_path: Path) -> None:
    """The CRC32 of an own snapshot is checked only where it crosses the network (the peer copy:
    on arrival and before a restore); without a peer copy nothing reads it, so none is taken
    (it was taken every interval: a read of the shard per interval for nothing)."""
    from training.checkpoint import snapshot_files as sf
    from training.checkpoint.pod_memory import PodMemorySnapshots

    state = _state(1.0, step=4)
    for checksum in (False, True):
        root = tmp_path / str(checksum)
        snapshots = PodMemorySnapshots(root=root, owner="run", rank=0, world_size=1)
        snapshots.checksum = checksum
        snapshots.take(state, step=4)
        [(directory, meta)] = snapshots.held()
        assert (meta.crc32 != sf.NO_CHECKSUM) is checksum
        assert (sf.verify(directory, meta) is None) is checksum
        snapshots.close(remove=True)
