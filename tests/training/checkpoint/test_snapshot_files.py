"""``training.checkpoint.snapshot_files``: the on-file format of pod-memory snapshots.

Run: ``.venv/bin/pytest tests/training/checkpoint/test_snapshot_files.py -x -q``.

Real files in a private directory under ``/dev/shm`` (the tmpfs a pod's memory emptyDir is),
real processes killed with SIGKILL in the middle of a copy. The CUDA registration of the
mapping (``cudaHostRegister``) needs a GPU and is not exercised here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from support import missing_tools, root_reason, skip_or_fail

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


# --- a full tmpfs --------------------------------------------------------------------------------


def _in_small_tmpfs(script: str, *, size: str = "16m") -> subprocess.CompletedProcess:
    """Run ``script`` (Python; ``sys.argv[1]`` is the mount point) with a fresh tmpfs of
    ``size`` mounted in a private mount namespace (``unshare -m``: the mount is gone with the
    process, nothing to clean up). Needs root, as this machine's tests run."""
    reason = root_reason("mounting a tmpfs in a private mount namespace") or missing_tools(
        "unshare"
    )
    if reason:
        skip_or_fail(reason)
    mount_point = Path(f"/tmp/small-tmpfs-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    mount_point.mkdir()
    try:
        return subprocess.run(
            [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                f'mount -t tmpfs -o size={size} tmpfs "$1" && exec "$2" -c "$3" "$1"',
                "sh",
                str(mount_point),
                sys.executable,
                textwrap.dedent(script),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parents[3],
        )
    finally:
        mount_point.rmdir()


@pytest.mark.timeout(150)
def test_a_slot_too_big_for_the_tmpfs_is_an_error_not_a_sigbus() -> None:
    """A 24 MiB slot on a 16 MiB tmpfs: the reservation fails with ENOSPC when the slot is
    opened, and nothing of it stays (a sparse file's first write through the mapping was a
    SIGBUS, exit 135, before). A slot that fits is reserved whole: writing it cannot fault."""
    found = _in_small_tmpfs(
        """
        import errno, os, sys
        from pathlib import Path
        from training.checkpoint import snapshot_files as sf
        root = Path(sys.argv[1])
        try:
            target = sf.SlotFile(root / "own" / "rank-00000" / "slot-0", nbytes=24 << 20)
            target.data.fill_(1)  # the write that faulted
            print("written")
        except OSError as err:
            print("refused", errno.errorcode[err.errno], err)
        print("left", sorted(p.name for p in root.rglob("*") if p.is_file()))
        fits = sf.SlotFile(root / "own" / "rank-00000" / "slot-1", nbytes=8 << 20)
        print("reserved", os.stat(fits.directory / sf.DATA).st_blocks * 512 >= 8 << 20)
        """
    )
    assert found.returncode == 0, (found.returncode, found.stdout, found.stderr)
    assert "refused ENOSPC" in found.stdout, found.stdout
    assert "no room for a 24.0 MiB snapshot" in found.stdout, found.stdout
    assert "left []" in found.stdout and "reserved True" in found.stdout, found.stdout


@pytest.mark.timeout(150)
def test_a_full_tmpfs_turns_pod_memory_off_and_the_run_goes_on_from_storage() -> None:
    """The manager of a real run (one gloo rank, in-process restarts, pod memory on a 16 MiB
    tmpfs that other files have filled): the first snapshot finds no room, so the tier goes
    off on this rank with a warning and a ``memory_snapshot_off`` event, training and saving
    go on, and the next attempt restores from storage."""
    found = _in_small_tmpfs(
        """
        import json, os, socket, sys, warnings
        from pathlib import Path
        import torch, torch.distributed as dist
        from training.checkpoint.manager import CheckpointManager
        from training.config import CheckpointConfig, JobConfig, ResilienceConfig
        from training.runlog.metrics import EventLog

        shm = Path(sys.argv[1])
        (shm / "filler").write_bytes(b"x" * (14 << 20))  # NCCL segments, another run...
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        run = Path(f"/tmp/full-tmpfs-run-{os.getpid()}")
        config = JobConfig(
            run_dir=str(run),
            checkpoint=CheckpointConfig(engine="sync", interval=0, memory_interval=1,
                                        pod_memory_dir=str(shm / "snapshots")),
            resilience=ResilienceConfig(restart="inprocess"),
        )

        class Trainer:
            def __init__(self):
                self.w, self.step = torch.zeros(1 << 20), 0  # 4 MiB: more than is free
            def state_dict(self):
                return {"w": self.w, "step": self.step}
            def load_state_dict(self, state):
                self.step = int(state["step"])

        def manager():
            m = CheckpointManager.for_job(config=config, rank=0, world_size=1,
                                          events=EventLog(run_dir=run, rank=0))
            m.start()
            return m

        trainer, m = Trainer(), manager()
        m.load_latest(trainer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in (1, 2, 3):
                trainer.step = step
                trainer.w.fill_(step)
                m.after_step(trainer, step=step)  # the schedule: every step
        m.save(trainer, step=3, blocking=True)
        print("warned", [str(w.message)[:40] for w in caught])
        m.abandon()
        trainer, m = Trainer(), manager()
        print("restored", m.load_latest(trainer), float(trainer.w[0]))
        from training.runlog import writer
        writer.flush()  # events are written off the caller's thread
        events = [json.loads(l) for l in (run / "events.jsonl").read_text().splitlines()]
        print("events", [(e["kind"], e["step"]) for e in events
                         if e["kind"] in ("memory_snapshot", "memory_snapshot_off")])
        print("load", [e["source"] for e in events if e["kind"] == "checkpoint_load"])
        m.close()
        import shutil; shutil.rmtree(run)
        dist.destroy_process_group()
        """
    )
    assert found.returncode == 0, (found.returncode, found.stdout, found.stderr)
    assert "warned ['pod-memory snapshots off on rank 0 from " in found.stdout, found.stdout
    assert "restored 3 3.0" in found.stdout, found.stdout
    assert "events [('memory_snapshot_off', 1)]" in found.stdout, found.stdout
    assert "load ['storage']" in found.stdout, found.stdout


def test_start_up_prunes_what_no_restore_of_this_run_can_use(root: Path) -> None:
    """``PodMemorySnapshots.prune`` (the manager's start): snapshots of another world size go
    (an elastic restart: never offered, and every shard grows), and other runs' directories
    go once no process holds their lock and they stopped changing; this run's own files, and
    a live run's directory, stay."""
    import fcntl
    import time

    from training.checkpoint import pod_memory as pm

    mine = pm.run_root(root, "run-a")
    dead, live = pm.run_root(root, "run-dead"), pm.run_root(root, "run-live")
    state = _state(1.0, step=3)
    for run in (dead, live):
        _write_own(run, state, step=3, slot=0)
    held = pm._hold_run_lock(live)  # a live process of the other run
    for path in [*dead.rglob("*"), *live.rglob("*")]:  # neither changed for an hour
        os.utime(path, (time.time() - 3600,) * 2)
    snapshots = pm.PodMemorySnapshots(root=mine, owner="run-a", rank=0, world_size=1)
    _write_own(mine, state, step=3, slot=0, owner="run-a")
    old_world = sf.meta_for(state, owner="run-a", rank=1, world_size=2, step=2)
    target = sf.SlotFile(sf.slot_dir(mine, kind="own", rank=1, slot=0), nbytes=old_world.nbytes)
    sf.pack(state, target.data, old_world)
    sf.publish(target.directory, old_world)
    target.close()
    stale = target.directory
    removed = snapshots.prune()
    assert str(dead) in removed and not dead.exists()
    assert live.exists() and (mine / "own" / "rank-00000" / "slot-0" / sf.META).exists()
    assert str(stale) in removed and sf.read_meta(stale) is None
    # A run whose lock is free but which changed a moment ago (between an in-job restart's
    # ranks) stays too; once it is stale, it goes.
    fcntl.flock(held, fcntl.LOCK_UN)
    os.close(held)
    for path in live.rglob("*"):
        os.utime(path)
    assert str(live) not in snapshots.prune() and live.exists()
    assert pm.prune_other_runs(root, keep=mine, stale_after_s=0) == [str(live)]
    snapshots.close(remove=True)
    pm.remove_run_dir_if_empty(mine)
    assert sorted(p.name for p in root.iterdir()) == []


def test_after_a_restore_own_snapshots_of_ranks_on_other_nodes_go(root: Path) -> None:
    """``prune_other_nodes``: the rendezvous placed ranks 2-3 on another node; this node (ranks
    0-1) keeps its own ranks' snapshots only."""
    from training.checkpoint.pod_memory import PodMemorySnapshots

    state = _state(1.0, step=3)
    for rank in range(4):
        meta = sf.meta_for(state, owner="run", rank=rank, world_size=4, step=3)
        target = sf.SlotFile(sf.slot_dir(root, kind="own", rank=rank, slot=0), nbytes=meta.nbytes)
        sf.pack(state, target.data, meta)
        sf.publish(target.directory, meta)
        target.close()
    snapshots = PodMemorySnapshots(root=root, owner="run", rank=1, world_size=4)
    assert snapshots.prune_other_nodes(local_world_size=2) == [
        "own/rank-00002",
        "own/rank-00003",
    ]
    assert sf.held_ranks(root, kind="own") == [0, 1]


def test_a_replayed_step_overwrites_the_slot_of_that_step_or_a_later_one(root: Path) -> None:
    """``next_slot`` after a restore of 10 with a dead timeline's 20 still there (a restart
    that could not remove it): 12 goes over 20, never over 10; a second 20 never sits beside
    another 20."""
    _write_own(root, _state(1.0, step=20), step=20, slot=0)
    _write_own(root, _state(1.0, step=10), step=10, slot=1)
    assert sf.next_slot(root, kind="own", rank=0, step=12) == 0
    assert sf.next_slot(root, kind="own", rank=0, step=20) == 0
    _write_own(root, _state(2.0, step=20), step=20, slot=0)  # the replay's 20
    assert [m.step for _, m in sf.list_snapshots(root, kind="own")] == [20, 10]
    # Both slots of step 20 (written by hand): the one of that step is the next target.
    _write_own(root, _state(2.0, step=20), step=20, slot=1)
    assert sf.next_slot(root, kind="own", rank=0, step=15) == 0  # both later than 15
    assert sf.discard_newer(root, kind="own", rank=0, step=10) == [20, 20]
    assert sf.list_snapshots(root, kind="own") == []
