"""``training.checkpoint.peer``: each node's snapshot copied into the next node's memory, and a
replaced node's shards restored from there.

Run: ``.venv/bin/pytest tests/training/checkpoint/test_peer.py -x -q`` (one group of 4 real
gloo ranks, spawned once for the module: ~15 s on 2 cores).

Four ranks as two "nodes" of two (LOCAL_WORLD_SIZE=2): each node's memory is a directory of its
own under /dev/shm (a tmpfs, as a pod's memory emptyDir is), a lost node's memory is that
directory removed, a replacement rank's state is a fresh one of other values. The ranks run
every scenario in order, in one process group (their start-up is most of the time), and write
what they saw; each test reads one scenario. NCCL's device staging cannot run without GPUs: the
same code runs with a CPU staging buffer (``staging=cpu``) and with none, in buckets much
smaller than the shards, so both paths and the bucket edges are exercised.
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

from training.checkpoint import peer
from training.checkpoint import snapshot_files as sf

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

WORLD = 4
OWNER = "run-peer-test"


def _take_all(manager: Any, trainer: Any, *, step: int) -> None:
    """Every snapshot tier's take, off the schedule (``CheckpointManager.after_step``)."""
    for tier in manager.snapshot_tiers:
        tier.take(trainer, step=step)


def test_the_ring_puts_each_copy_on_the_same_local_rank_of_the_next_node() -> None:
    assert [peer.holder_of(r, world_size=8, local_world_size=2) for r in range(8)] == [
        2,
        3,
        4,
        5,
        6,
        7,
        0,
        1,
    ]
    assert [peer.source_of(r, world_size=8, local_world_size=2) for r in range(8)] == [
        6,
        7,
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    assert peer.holder_of(0, world_size=2, local_world_size=1) == 1


@pytest.mark.parametrize(("world", "local"), [(2, 2), (8, 8), (6, 4), (1, 1)])
def test_one_node_or_uneven_nodes_turn_the_copy_off_with_a_reason(world: int, local: int) -> None:
    problem = peer.ring_problem(world_size=world, local_world_size=local)
    assert problem is not None and ("one node" in problem or "whole nodes" in problem)
    assert peer.holder_of(0, world_size=world, local_world_size=local) is None


def test_a_peer_copy_without_pod_memory_snapshots_is_a_config_error() -> None:
    from training.config import CheckpointConfig
    from training.exits import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint\.peer_copy: .*memory_interval > 0"):
        CheckpointConfig(peer_copy=True)
    assert CheckpointConfig(peer_copy=True, memory_interval=5).peer_copy


def test_on_one_node_the_copy_is_off_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from training.config import CheckpointConfig
    from training.runlog import writer
    from training.runlog.metrics import EventLog

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    events = EventLog(run_dir=tmp_path, rank=0)
    made = peer.for_job(
        config=CheckpointConfig(peer_copy=True, memory_interval=5),
        root=tmp_path / "shm",
        owner=OWNER,
        rank=0,
        world_size=2,
        events=events,
        published=lambda: None,
    )
    assert made is None
    assert (
        "peer copy of pod-memory snapshots off: the job runs on one node" in capsys.readouterr().out
    )
    writer.flush()  # events are written off the caller's thread (training/runlog/writer.py)
    (event,) = [json.loads(line) for line in events.path.read_text().splitlines()]
    assert event["kind"] == "peer_copy_off" and "one node" in event["reason"]


# --- the ranks ---------------------------------------------------------------------------------


def _state(rank: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: shards of uneven sizes (as FSDP's last shard), a
    bf16 leaf, non-tensor leaves."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "model": {
            "w": torch.randn(300 + 7 * rank, generator=g),
            "h": torch.randn(33, generator=g).to(torch.bfloat16),
        },
        "optim": {"exp_avg": torch.randn(300 + 7 * rank, generator=g), "lr": 0.1 * step},
        "step": step,
    }


def _fresh(rank: int) -> dict[str, Any]:
    """A replacement rank's state before it restores: the same structure, other values."""
    return _state(rank, 999)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _take(root: Path, *, rank: int, step: int) -> None:
    """Rank ``rank``'s own pod-memory snapshot of step ``step`` (snapshot_files' protocol)."""
    state = _state(rank, step)
    meta = sf.meta_for(state, owner=OWNER, rank=rank, world_size=WORLD, step=step)
    slot = sf.next_slot(root, kind="own", rank=rank, step=step)
    target = sf.SlotFile(sf.slot_dir(root, kind="own", rank=rank, slot=slot), nbytes=meta.nbytes)
    sf.pack(state, target.data, meta)
    sf.publish(target.directory, sf.with_checksum(meta, target.data))
    target.close()


def _flip(directory: Path, meta: sf.SnapshotMeta, *, at: int) -> None:
    """Flip the lowest bit of the byte at ``nbytes // at`` of a snapshot's data."""
    with open(directory / sf.DATA, "r+b") as handle:
        handle.seek(meta.nbytes // at)
        byte = handle.read(1)
        handle.seek(meta.nbytes // at)
        handle.write(bytes([byte[0] ^ 0x01]))


def _held(root: Path, kind: str) -> list[list[int]]:
    return sorted([m.rank, m.step] for _, m in sf.list_snapshots(root, kind=kind))  # type: ignore[arg-type]


def _ranks(rank: int, base: str, out: str, port: int) -> None:
    import torch.distributed as dist

    from training.checkpoint.tiers import Rejected
    from training.runlog.metrics import EventLog

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    results: dict[str, Any] = {}
    base_dir = Path(base)
    events = EventLog(run_dir=Path(out) / "run", rank=rank)

    def node_root(node: int) -> Path:
        return base_dir / f"node-{node}"

    def copies(root: Path, *, local: int, staging: Any = None) -> peer.PeerCopies:
        return peer.PeerCopies(
            root=root,
            owner=OWNER,
            rank=rank,
            world_size=WORLD,
            local_world_size=local,
            events=events,
            staging=staging,
            bucket_bytes=512,  # a shard is ~2.5 KB: several buckets, a short last one
        )

    class Trainer:  # the manager's StatefulTrainer: its state_dict is restored in place
        def __init__(self, state: dict) -> None:
            self.state = state

        def state_dict(self) -> dict:
            return self.state

        def load_state_dict(self, state: dict) -> None:
            assert state is self.state

    def restore(root: Path, state: dict, *, local: int, at_least: int, staging: Any = None):
        """What the manager does with the tier: its newest step not older than the floor."""
        tier = peer.PeerTier(copies(root, local=local, staging=staging))
        steps = [s for s in tier.steps() if s >= at_least]
        if not steps:
            return None
        outcome = tier.load(Trainer(state), step=steps[0])
        if isinstance(outcome, Rejected):
            return {"problem": outcome.problem, "path": outcome.path}
        return [steps[0], outcome.path, outcome.nbytes]

    def wipe(*nodes: int) -> None:
        dist.barrier()
        if rank == 0:
            for node in nodes:
                shutil.rmtree(node_root(node), ignore_errors=True)
        dist.barrier()

    def restored(state: dict, got: Any, step: int) -> dict:
        return {
            "got": got,
            "equal": _equal(state, _state(rank, step)),
        }

    # 1. The exchange: two intervals, the first without staging, the second staged.
    own = node_root(rank // 2)
    _take(own, rank=rank, step=5)
    copies(own, local=2).exchange(blocking=True)
    _take(own, rank=rank, step=6)
    copies(own, local=2, staging=torch.device("cpu")).exchange(blocking=True)
    dist.barrier()
    if rank == 0:
        results["ring"] = {
            f"node-{n}": {"own": _held(node_root(n), "own"), "peer": _held(node_root(n), "peer")}
            for n in (0, 1)
        }
        results["ring"]["bytes_equal"] = all(
            sf.verify(d, m) is None
            and torch.equal(
                sf.map_data(d, m),
                sf.map_data(*sf.list_snapshots(node_root(1 - n), kind="own", rank=m.rank)[0])
                if m.step == 6
                else sf.map_data(*sf.list_snapshots(node_root(1 - n), kind="own", rank=m.rank)[1]),
            )
            for n in (0, 1)
            for d, m in sf.list_snapshots(node_root(n), kind="peer")
        )

    # 2. Node 1 is lost and replaced: ranks 2 and 3 start with nothing and fresh state.
    wipe(1)
    state = _state(rank, 6) if rank < 2 else _fresh(rank)
    got = restore(own, state, local=2, at_least=4, staging=torch.device("cpu"))
    results[f"replaced-{rank}"] = restored(state, got, 6)
    results[f"replaced-{rank}"]["own_after"] = _held(own, "own")

    # 3. Lost and replaced again, and the rendezvous swaps the nodes: ranks 0-1 now run on
    # the new node, ranks 2-3 on the old node 0 (which holds own 0-1 and the copies of 2-3).
    wipe(1)
    swapped = node_root(1 - rank // 2)
    state = _fresh(rank)
    got = restore(swapped, state, local=2, at_least=4)
    results[f"permuted-{rank}"] = restored(state, got, 6)

    # 3b. The same layout, but one byte of the peer copy that rank 2 finds in its pod (node 0's
    # copy of rank 2) flipped: a copy that crossed the network is checked again on restore.
    wipe(1)
    if rank == 0:
        _flip(*sf.list_snapshots(node_root(0), kind="peer", rank=2)[0], at=3)
    dist.barrier()
    state = _fresh(rank)
    got = restore(swapped, state, local=2, at_least=4)
    results[f"damaged-in-place-{rank}"] = {"got": got, "unchanged": _equal(state, _fresh(rank))}
    dist.barrier()
    if rank == 0:
        _flip(*sf.list_snapshots(node_root(0), kind="peer", rank=2)[0], at=3)  # whole again
    dist.barrier()

    # 4. A damaged copy: node 1 lost again, one byte of node 0's copy of rank 2 flipped.
    wipe(1)
    if rank == 0:
        directory, meta = sf.list_snapshots(node_root(0), kind="peer", rank=2)[0]
        with open(directory / sf.DATA, "r+b") as handle:
            handle.seek(meta.nbytes // 2)
            byte = handle.read(1)
            handle.seek(meta.nbytes // 2)
            handle.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    state = _fresh(rank) if rank >= 2 else _state(rank, 6)
    before = {k: v for k, v in state.items()}
    got = restore(own, state, local=2, at_least=4)
    results[f"damaged-{rank}"] = {
        "got": got,
        "unchanged": _equal(state, _fresh(rank) if rank >= 2 else _state(rank, 6)),
        "same_keys": state.keys() == before.keys(),
    }

    # 5. Four nodes of one rank (ring 0->1->2->3->0). One lost node restores from its holder;
    # then a node and its holder lost together: the first one's shard is gone from memory.
    alone = base_dir / f"single-{rank}"
    _take(alone, rank=rank, step=7)
    copies(alone, local=1).exchange(blocking=True)
    dist.barrier()
    if rank == 1:
        shutil.rmtree(alone, ignore_errors=True)
    dist.barrier()
    state = _fresh(rank) if rank == 1 else _state(rank, 7)
    got = restore(alone, state, local=1, at_least=0)
    results[f"one-lost-{rank}"] = restored(state, got, 7)
    copies(alone, local=1).exchange(blocking=True)  # the copies are whole again
    dist.barrier()
    if rank in (1, 2):  # node 1 and node 2, which holds node 1's copy
        shutil.rmtree(alone, ignore_errors=True)
    dist.barrier()
    state = _fresh(rank) if rank in (1, 2) else _state(rank, 7)
    got = restore(alone, state, local=1, at_least=0)
    results[f"two-lost-{rank}"] = {"got": got}

    # 6. Training goes on while an exchange is in flight. The exchange thread is held where it
    # waits for the snapshot's publish (a long CRC32, a slow network) until the training
    # thread has run three steps (all-reduces on the default group). Then every rank but one
    # releases its exchange; rank 1's is released half a second later, from a timer: the next
    # snapshot's settle must wait on every rank until rank 1's copy is in too (else its pod
    # would overwrite an own slot while a copy of the newest step is still on its way).
    import threading

    overlap = base_dir / f"overlap-node-{rank // 2}"
    gate = threading.Event()
    seen_steps: list[int] = []
    trained = [0]

    def held_publish() -> Any:
        def wait() -> None:
            gate.wait(60)
            seen_steps.append(trained[0])

        return wait

    ring = peer.PeerCopies(
        root=overlap,
        owner=OWNER,
        rank=rank,
        world_size=WORLD,
        local_world_size=2,
        events=events,
        staging=None,
        bucket_bytes=512,
        published=held_publish,
    )
    _take(overlap, rank=rank, step=8)
    first = ring.exchange(step=8)
    for _ in range(3):  # the next steps' collectives
        dist.all_reduce(torch.ones(1))
        trained[0] += 1
    in_flight = ring.in_flight()
    if rank == 1:
        threading.Timer(0.5, gate.set).start()
    else:
        gate.set()
    ring.settle()  # before the next snapshot
    after_settle = _held(overlap, "peer")
    _take(overlap, rank=rank, step=9)
    second = ring.exchange(step=9, blocking=True)
    dist.barrier()
    results[f"overlap-{rank}"] = {
        "started": [first, second],
        "in_flight_after_steps": in_flight,
        "steps_before_publish_waited": seen_steps[0],
        "peer_after_settle": after_settle,
        "peer_after_next": _held(overlap, "peer"),
        "verified": [
            sf.verify(d, m) for d, m in sf.list_snapshots(overlap, kind="peer", rank=ring.source)
        ],
        "blocked_s": ring.last_blocked_s,
    }
    ring.close()

    # 7. A receiver that cannot keep a message (``into`` gives None: no room for its slot)
    # still receives it, into scratch buckets: its sender is never left blocked, and the next
    # transfer between the same ranks is in step.
    from training.checkpoint.transfer import Incoming, Outgoing, transfer

    landed: list[int] = []
    rounds = []
    for attempt in range(2):
        payload = torch.arange(3000, dtype=torch.int64).add_(rank + 10 * attempt)
        payload = payload.to(torch.uint8)
        (got,) = transfer(
            outgoing=[Outgoing(dst=(rank + 1) % WORLD, meta=b"m", data=payload)],
            incoming=[
                Incoming(
                    src=(rank - 1) % WORLD,
                    into=lambda _m, n, a=attempt: (
                        None if (rank % 2 == 0 and a == 0) else torch.empty(n, dtype=torch.uint8)
                    ),
                    landed=lambda part: landed.append(part.numel()),
                )
            ],
            bucket_bytes=512,
        )
        expected = torch.arange(3000, dtype=torch.int64).add_((rank - 1) % WORLD + 10 * attempt)
        rounds.append([got.data.numel(), torch.equal(got.data, expected.to(torch.uint8))])
    results[f"dropped-{rank}"] = {"rounds": rounds, "landed": landed}

    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _manager_ranks(rank: int, base: str, out: str, port: int) -> None:
    """The manager's own wiring (``CheckpointManager.for_job``: settle, snapshot, exchange on
    its thread; ``prepare``; ``abandon``) on 2 ranks as 2 nodes of one rank: snapshots every
    step, a fault right after the fourth (its exchange may still be in flight), node 1's pod
    memory lost, and both ranks restarted with new managers."""
    import datetime

    import torch.distributed as dist

    from training.checkpoint.manager import CheckpointManager
    from training.config import CheckpointConfig, JobConfig, ResilienceConfig
    from training.runlog.metrics import EventLog

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["TORCHELASTIC_RUN_ID"] = "peer-manager-test"  # one run: one owner on both
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    node = Path(base) / f"node-{rank}"
    config = JobConfig(
        run_dir=str(Path(out) / "run"),
        checkpoint=CheckpointConfig(
            engine="sync",
            interval=1000,
            save_final=False,
            memory_interval=1,
            pod_memory_dir=str(node),
            peer_copy=True,
        ),
        resilience=ResilienceConfig(restart="injob"),
    )
    events = EventLog(run_dir=Path(out) / "run", rank=rank)

    class Trainer:
        def __init__(self, value: float) -> None:
            self.w = torch.full((5000 + 13 * rank,), value)
            self.step = int(value)

        def state_dict(self) -> dict:
            return {"model": {"w": self.w}, "step": self.step}

        def load_state_dict(self, state: dict) -> None:
            assert state["model"]["w"] is self.w
            self.step = state["step"]

    manager = CheckpointManager.for_job(config=config, rank=rank, world_size=2, events=events)
    manager.start()
    trainer = Trainer(0.0)
    manager.prepare(trainer)
    for step in range(1, 5):
        trainer.w.add_(1.0)
        trainer.step = step
        manager.before_update()
        _take_all(manager, trainer, step=step)
    manager.abandon()  # the fault
    dist.barrier()
    if rank == 1:  # node 1 lost: its replacement's pod memory is empty
        shutil.rmtree(node, ignore_errors=True)
    dist.barrier()
    restarted = Trainer(-1.0)
    second = CheckpointManager.for_job(config=config, rank=rank, world_size=2, events=events)
    second.start()
    step = second.load_latest(restarted)
    (Path(out) / f"manager{rank}.json").write_text(
        json.dumps(
            {
                "step": step,
                "w_equal_step": bool(torch.equal(restarted.w, torch.full_like(restarted.w, step)))
                if step is not None
                else False,
                "trainer_step": restarted.step,
            }
        )
    )
    dist.barrier()
    second.close()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_through_the_manager_a_lost_node_restores_a_whole_step_from_its_peer(
    tmp_path: Path,
) -> None:
    """Whatever the exchange in flight at the fault, the surviving pod holds a step that is
    whole (settle before every snapshot): both ranks restore the same step, 3 or 4, from the
    peer tier, and rank 1's state, whose own memory was lost, equals that step's."""
    import torch.multiprocessing as mp
    from support import free_port

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    base = shm / f"test-peer-manager-{uuid.uuid4().hex[:12]}"
    base.mkdir()
    try:
        mp.start_processes(
            _manager_ranks,
            args=(str(base), str(tmp_path), free_port()),
            nprocs=2,
            start_method="spawn",
            join=True,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    got = [json.loads((tmp_path / f"manager{r}.json").read_text()) for r in range(2)]
    assert got[0]["step"] == got[1]["step"] and got[0]["step"] in (3, 4), got
    assert all(g["w_equal_step"] and g["trainer_step"] == g["step"] for g in got), got
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    loads = [e for e in events if e["kind"] == "checkpoint_load"]
    assert {e["source"] for e in loads} == {"peer"} and len(loads) == 2, loads
    copies = [e for e in events if e["kind"] == "peer_copy" and e["problem"] is None]
    assert {e["step"] for e in copies} >= {1, 2, 3}, copies


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch.multiprocessing as mp
    from support import free_port

    out = tmp_path_factory.mktemp("peer")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    base = shm / f"test-peer-{uuid.uuid4().hex[:12]}"
    base.mkdir()
    try:
        mp.start_processes(
            _ranks,
            args=(str(base), str(out), free_port()),
            nprocs=WORLD,
            start_method="spawn",
            join=True,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    merged: dict[str, Any] = {}
    for rank in range(WORLD):
        merged.update(json.loads((out / f"rank{rank}.json").read_text()))
    merged["events"] = [
        json.loads(line) for line in (out / "run" / "events.jsonl").read_text().splitlines()
    ]
    return merged


def test_each_copy_lands_on_its_holder_and_equals_the_snapshot(seen: dict) -> None:
    ring = seen["ring"]
    # Node 0 (ranks 0, 1) holds the copies of node 1's ranks (2, 3) and the other way round,
    # both intervals (two slots), bit for bit.
    assert ring["node-0"]["own"] == [[0, 5], [0, 6], [1, 5], [1, 6]]
    assert ring["node-0"]["peer"] == [[2, 5], [2, 6], [3, 5], [3, 6]]
    assert ring["node-1"]["peer"] == [[0, 5], [0, 6], [1, 5], [1, 6]]
    assert ring["bytes_equal"]
    exchanges = [e for e in seen["events"] if e["kind"] == "peer_copy" and e["step"] in (5, 6)]
    assert len(exchanges) == 2 * WORLD and all(e["problem"] is None for e in exchanges)
    assert all(e["sent_bytes"] > 512 for e in exchanges)  # several buckets each


def test_a_replacement_node_restores_its_shards_from_the_peer_bit_identically(seen: dict) -> None:
    for rank in range(WORLD):
        result = seen[f"replaced-{rank}"]
        assert result["got"] is not None and result["got"][0] == 6, result
        assert result["equal"], f"rank {rank} differs from its step-6 state"
    # The new node's ranks received their shards from the ranks holding the copies (the same
    # local rank on node 0); what they received is now their own snapshot in their pod.
    assert seen["replaced-2"]["got"][1] == "peer: rank 0", seen["replaced-2"]
    assert seen["replaced-3"]["got"][1] == "peer: rank 1", seen["replaced-3"]
    assert seen["replaced-0"]["got"][1].endswith("/own/rank-00000/slot-1")
    assert seen["replaced-2"]["got"][2] > 512
    assert [2, 6] in seen["replaced-2"]["own_after"]


def test_ranks_permuted_across_nodes_restore_by_saved_rank(seen: dict) -> None:
    for rank in range(WORLD):
        result = seen[f"permuted-{rank}"]
        assert result["got"] is not None and result["got"][0] == 6, result
        assert result["equal"], f"rank {rank} restored another rank's shard"
    # Ranks 0 and 1 (new node) get theirs from the old node's ranks of their local rank, 2
    # and 3; ranks 2 and 3 find theirs in their pod, among the copies it held for node 1.
    assert seen["permuted-0"]["got"][1] == "peer: rank 2"
    assert seen["permuted-1"]["got"][1] == "peer: rank 3"
    assert "/peer/rank-00002/" in seen["permuted-2"]["got"][1]


def test_a_damaged_peer_copy_in_the_restoring_pod_is_refused_on_every_rank(seen: dict) -> None:
    problems = set()
    for rank in range(WORLD):
        assert seen[f"damaged-in-place-{rank}"]["unchanged"]
        problems.add(seen[f"damaged-in-place-{rank}"]["got"]["problem"])
    (problem,) = problems
    assert problem.startswith("rank 2: data fails its checksum"), problem


def test_a_damaged_copy_is_refused_on_every_rank_and_nothing_changes(seen: dict) -> None:
    problems = set()
    for rank in range(WORLD):
        assert seen[f"damaged-{rank}"]["unchanged"]
        problems.add(seen[f"damaged-{rank}"]["got"]["problem"])
    # Every rank has the same verdict: rank 2's copy (from rank 0) fails its checksum.
    (problem,) = problems
    assert problem.startswith("rank 2: the copy from rank 0 fails its checksum"), problem


def test_a_node_and_its_holder_lost_together_leave_no_step_in_memory(seen: dict) -> None:
    for rank in range(WORLD):
        assert seen[f"one-lost-{rank}"]["got"][0] == 7 and seen[f"one-lost-{rank}"]["equal"]
        assert seen[f"two-lost-{rank}"]["got"] is None


def test_training_goes_on_while_an_exchange_is_in_flight_and_the_copy_still_arrives_whole(
    seen: dict,
) -> None:
    """The exchange runs on its own thread and group: the training thread ran three steps of
    collectives while every rank's exchange was held before sending; the next snapshot's
    settle waited, on every rank, until the last held copy (rank 1's, released later) was in,
    so each pod holds its sources' copies of step 8 before any own slot is reused; the copies
    are complete and CRC-verified, and the next exchange brings step 9."""
    for rank in range(WORLD):
        got = seen[f"overlap-{rank}"]
        assert got["started"] == [True, True], got
        assert got["in_flight_after_steps"] is True
        assert got["steps_before_publish_waited"] == 3
        source = (rank - 2) % WORLD
        node_peer = sorted([[(r - 2) % WORLD, 8] for r in range(WORLD) if r // 2 == rank // 2])
        assert got["peer_after_settle"] == node_peer, got
        assert [s for q, s in got["peer_after_next"] if q == source] == [8, 9]
        assert got["verified"] == [None, None]
    waited = [e for e in seen["events"] if e.get("kind") == "peer_copy_waited"]
    assert 1 in {e["rank"] for e in waited}, waited


def test_a_message_the_receiver_cannot_keep_is_received_and_dropped_keeping_ranks_in_step(
    seen: dict,
) -> None:
    """Even ranks drop their first message (no slot for it); every sender still completes,
    the data of the kept messages arrive whole in 512-byte buckets (``landed`` sees each
    bucket of a kept message, none of a dropped one), and the second transfer is in step."""
    for rank in range(WORLD):
        got = seen[f"dropped-{rank}"]
        if rank % 2 == 0:
            assert got["rounds"] == [[0, False], [3000, True]], got
            assert got["landed"] == [512] * 5 + [440], got
        else:
            assert got["rounds"] == [[3000, True], [3000, True]], got
            assert got["landed"] == ([512] * 5 + [440]) * 2, got


def test_data_that_is_not_flat_bytes_is_refused_before_anything_is_sent() -> None:
    from training.checkpoint.transfer import Outgoing, transfer

    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        transfer(outgoing=[Outgoing(dst=1, meta=b"", data=torch.zeros(4))], incoming=[])


os.environ.setdefault("OMP_NUM_THREADS", "1")
