"""``training.checkpoint.snapshot_files``: the on-file format of pod-memory snapshots.

Run: ``.venv/bin/pytest tests/training/checkpoint/test_snapshot_files.py -x -q``.

Real files in a private directory under ``/dev/shm`` (the tmpfs a pod's memory emptyDir is),
real processes killed with SIGKILL in the middle of a copy. The CUDA registration of the
mapping (``cudaHostRegister``) needs a GPU and is not exercised here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpoint import snapshot_files as sf


def _state(fill: float, *, step: int, rows: int = 64) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((rows, 8), fill), "b": torch.full((3,), fill).half()},
        "optim": {
            "state": {"w": {"exp_avg": torch.full((rows, 8), fill), "step": torch.tensor(fill)}},
            "param_groups": [{"lr": fill, "betas": (0.9, 0.95), "params": ["w"]}],
        },
        "sampler": {"epoch": step // 7, "position": step},
        "step": step,
        "rng": torch.arange(5, dtype=torch.uint8),
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.fixture
def root(tmp_path: Path):
    """A unique directory in /dev/shm (a tmpfs, as in the pod), removed afterwards."""
    import shutil
    import uuid

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = base / f"test-snapshot-files-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _write_own(root: Path, state: dict, *, step: int, slot: int, owner: str = "run") -> Path:
    meta = sf.meta_for(state, owner=owner, rank=0, world_size=1, step=step)
    target = sf.SlotFile(sf.slot_dir(root, kind="own", rank=0, slot=slot), nbytes=meta.nbytes)
    sf.pack(state, target.data, meta)
    sf.publish(target.directory, sf.with_checksum(meta, target.data))
    target.close()
    return target.directory


def test_a_snapshot_round_trips_through_its_files(root: Path) -> None:
    state = _state(1.5, step=10)
    directory = _write_own(root, state, step=10, slot=0)
    [(found, meta)] = sf.list_snapshots(root, kind="own", rank=0)
    assert found == directory and meta.step == 10
    assert sf.verify(found, meta) is None
    into = _state(0.0, step=0)
    sf.unpack(into, sf.map_data(found, meta), meta)
    assert _equal(into, state)
    # Read from the file (what a restore does), also into a strided leaf, which is copied from
    # the mapping instead.
    into = _state(0.0, step=0)
    strided = torch.zeros(8, 64).t()
    into["model"]["w"] = strided
    sf.load(into, found, meta)
    assert into["model"]["w"] is strided and _equal(into, state)
    # Each tensor leaf starts aligned, and the data holds exactly what the plan says.
    assert all(t.offset % sf.ALIGN == 0 for t in meta.tensors)
    assert meta.nbytes == sf.snapshot_bytes(state)
    # The meta travels as bytes (the peer tier sends it) and comes back equal.
    assert sf.SnapshotMeta.from_bytes(meta.to_bytes()) == meta


def test_slots_are_written_in_turn_and_the_newest_comes_first(root: Path) -> None:
    assert sf.next_slot(root, kind="own", rank=0, step=5) == 0
    _write_own(root, _state(1.0, step=5), step=5, slot=0)
    assert sf.next_slot(root, kind="own", rank=0, step=10) == 1
    _write_own(root, _state(2.0, step=10), step=10, slot=1)
    assert sf.next_slot(root, kind="own", rank=0, step=15) == 0  # the older one is overwritten
    assert [m.step for _, m in sf.list_snapshots(root, kind="own")] == [10, 5]


def test_refusals_name_owner_rank_world_and_structure(root: Path) -> None:
    state = _state(1.0, step=3)
    _write_own(root, state, step=3, slot=0, owner="run-a")
    [(_, meta)] = sf.list_snapshots(root, kind="own", rank=0)
    key = sf.walk(state)[1]
    assert meta.refusal(owner="run-a", rank=0, world_size=1, key=key) is None
    assert "another run" in meta.refusal(owner="run-b", rank=0, world_size=1, key=key)
    assert "rank 0's, not rank 1's" in meta.refusal(owner="run-a", rank=1, world_size=1)
    assert "world size 1, not 2" in meta.refusal(owner="run-a", rank=0, world_size=2)
    other = sf.walk(_state(1.0, step=3, rows=65))[1]
    assert "structure" in meta.refusal(owner="run-a", rank=0, world_size=1, key=other)
    with pytest.raises(ValueError, match="structure"):
        sf.unpack(
            _state(0.0, step=0, rows=65),
            sf.map_data(sf.slot_dir(root, kind="own", rank=0, slot=0), meta),
            meta,
        )


def test_a_file_shorter_than_its_meta_is_not_loaded_quietly(root: Path) -> None:
    directory = _write_own(root, _state(1.0, step=3), step=3, slot=0)
    [(_, meta)] = sf.list_snapshots(root, kind="own", rank=0)
    os.truncate(directory / sf.DATA, meta.tensors[-1].offset)
    with pytest.raises(OSError, match="short"):
        sf.load(_state(0.0, step=0), directory, meta)


def test_damaged_data_fails_its_checksum(root: Path) -> None:
    directory = _write_own(root, _state(1.0, step=3), step=3, slot=0)
    [(_, meta)] = sf.list_snapshots(root, kind="own", rank=0)
    with open(directory / sf.DATA, "r+b") as handle:
        handle.seek(meta.tensors[1].offset + 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    assert "fails its checksum" in sf.verify(directory, meta)


def test_the_pod_memory_tier_checks_an_own_snapshot_without_a_crc_pass(root: Path) -> None:
    """``PodMemorySnapshots.check``: owner, rank, world size, structure and size are checked;
    the data of an own snapshot gets no CRC32 pass (its docstring says why), so a restore does
    not read the shard twice. A peer's copy is CRC-checked (tests/.../test_peer.py)."""
    from training.checkpoint.pod_memory import PodMemorySnapshots

    state = _state(1.0, step=3)
    directory = _write_own(root, state, step=3, slot=0, owner="run-a")
    mine = PodMemorySnapshots(root=root, owner="run-a", rank=0, world_size=1)
    assert mine.check(_state(0.0, step=0), step=3) == (directory, None)
    # Its data is not read: a flipped byte passes the check (it would fail ``verify``).
    [(_, meta)] = sf.list_snapshots(root, kind="own", rank=0)
    with open(directory / sf.DATA, "r+b") as handle:
        handle.seek(meta.tensors[0].offset)
        handle.write(bytes([0x7F]))
    assert "fails its checksum" in sf.verify(directory, meta)
    assert mine.check(_state(0.0, step=0), step=3) == (directory, None)
    # Every other check stays.
    assert "another structure" in mine.check(_state(0.0, step=0, rows=65), step=3)[1]
    assert "no complete snapshot of step 4" in mine.check(state, step=4)[1]
    for other in (
        PodMemorySnapshots(root=root, owner="run-b", rank=0, world_size=1),
        PodMemorySnapshots(root=root, owner="run-a", rank=0, world_size=2),
    ):
        assert other.check(state, step=3) == (None, "no complete snapshot of step 3")
    with open(directory / sf.DATA, "r+b") as handle:  # shorter than its meta says
        handle.truncate(meta.nbytes - 1)
    assert mine.check(state, step=3) == (None, "no complete snapshot of step 3")


def test_write_snapshot_checks_the_copy_and_publishes_nothing_damaged(root: Path) -> None:
    """The peer tier's path: (meta, flat data) received from elsewhere."""
    state = _state(2.0, step=7)
    source = _write_own(root, state, step=7, slot=0)
    [(_, meta)] = sf.list_snapshots(root, kind="own", rank=0)
    data = sf.map_data(source, meta).clone()
    written = sf.write_snapshot(root, kind="peer", slot=1, meta=meta, data=data)
    assert written == sf.slot_dir(root, kind="peer", rank=0, slot=1)
    [(found, copied)] = sf.list_snapshots(root, kind="peer")
    assert copied == meta and sf.verify(found, copied) is None
    data[5] ^= 0xFF
    with pytest.raises(ValueError, match="fails its checksum"):
        sf.write_snapshot(root, kind="peer", slot=1, meta=meta, data=data)
    assert sf.list_snapshots(root, kind="peer") == []  # the slot was unpublished first


def test_remove_rank_leaves_nothing_behind(root: Path) -> None:
    _write_own(root, _state(1.0, step=1), step=1, slot=0)
    _write_own(root, _state(1.0, step=2), step=2, slot=1)
    sf.remove_rank(root, kind="own", rank=0)
    assert sf.list_snapshots(root, kind="own") == []
    assert list(root.iterdir()) == []  # root itself stays: other kinds may live there


_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from training.checkpoint import snapshot_files as sf
    root, stage = Path(sys.argv[1]), sys.argv[2]
    state = {"w": torch.full((8 << 20,), 3.0), "step": 20}  # 32 MiB
    meta = sf.meta_for(state, owner="run", rank=0, world_size=1, step=20)
    target = sf.SlotFile(sf.slot_dir(root, kind="own", rank=0, slot=1), nbytes=meta.nbytes)
    data = target.data
    if stage == "copy":
        view = meta.tensors[0].view(data)
        chunk = view.numel() // 64
        for i in range(64):  # the copy, slowly, until SIGKILL
            view[i * chunk : (i + 1) * chunk].copy_(state["w"][i * chunk : (i + 1) * chunk])
            if i == 8:
                print("copying", flush=True)
            time.sleep(0.05)
    else:  # every byte in place, meta not yet written
        sf.pack(state, data, meta)
        print("copied", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", ["copy", "before_meta"])
def test_a_writer_killed_mid_copy_never_leaves_a_snapshot_offered(root: Path, stage: str) -> None:
    """A complete snapshot in slot 1 is overwritten by a process SIGKILLed in the middle:
    the slot is no longer offered, the other slot's snapshot still is, and it verifies."""
    _write_own(root, _state(1.0, step=10), step=10, slot=0)
    _write_own(root, {"w": torch.full((8 << 20,), 1.0), "step": 15}, step=15, slot=1)
    assert [m.step for _, m in sf.list_snapshots(root, kind="own", rank=0)] == [15, 10]
    repo = Path(__file__).resolve().parents[3]
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), stage],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = writer.stdout.readline()
        assert line.strip() in ("copying", "copied"), line
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == -signal.SIGKILL
    offered = sf.list_snapshots(root, kind="own", rank=0)
    assert [m.step for _, m in offered] == [10]
    assert sf.verify(*offered[0]) is None
    assert sf.next_slot(root, kind="own", rank=0, step=20) == 1  # the torn slot is written next
