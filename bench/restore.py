"""Restore benchmark: the same step restored from pod memory, from a peer, and from storage.

Measures, in ONE torchrun job of 2 CPU ranks (gloo) as two "nodes" of one rank (each node's
memory a directory of its own under /dev/shm, as a pod's memory emptyDir is), on the same FSDP2
state (the checkpoint benchmark's widened debug model, AdamW state included):

- ``storage``: the verified load of the committed checkpoint of that step (``VerifyingReader``,
  the manager's one-pass load with CRC32 checks), the floor every tier is measured against;
- ``pod_memory``: the rank's own snapshot in its pod's memory, through the tier itself
  (``PodMemoryTier.load``: meta checked, the ranks agree, copied into the state; no CRC32 pass
  over an own snapshot, ``PodMemorySnapshots.check`` says why);
- ``peer``: node 1 lost (its memory emptied): the peer tier finds every shard in some pod,
  node 0 sends rank 1's copy over the process group, rank 1 checks its CRC32 and restores it
  (rank 0 restores its own); the slowest rank's time counts;
- the exchange after a snapshot (``PeerCopies.exchange``): seconds and bytes sent and received
  per node per interval.

The ways take turns within each round (the order rotates), every timed restore is followed by a
check that the state equals the saved one bit for bit, and the figures are the median over
rounds of the slowest rank. The checkpoint files sit in this machine's page cache, so
``storage`` here is a floor far below FSx's (no network, no Lustre).

    python -m bench.restore           # ~420 MB of state, 5 rounds
    python -m bench.restore --quick   # ~20 MB, 2 rounds

Writes bench/results/restore.json (``pod_memory_vs_storage``, ``peer_vs_storage``, targets).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import (
    RUNS_DIR,
    add_worker_options,
    fmt,
    machine,
    median,
    ratio,
    run_workers,
    table,
    target,
    targets_table,
    write_result,
)

WAYS = ("storage", "pod_memory", "peer")
FULL = {"dim": 1024, "layers": 3, "rounds": 5}
QUICK = {"dim": 256, "layers": 2, "rounds": 2}
OWNER = "bench-restore"


def worker(*, dim: int, layers: int, rounds: int, root: Path, shm: Path, out: Path) -> None:
    """Build the trainer, save and snapshot one step, then restore it each way in turn."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from training.checkpoint import snapshot_files as sf
    from training.checkpoint.integrity import VerifyingReader, gc_paused
    from training.checkpoint.layout import step_dir
    from training.checkpoint.manager import CheckpointManager
    from training.checkpoint.peer import PeerCopies, PeerTier
    from training.checkpoint.pod_memory import PodMemorySnapshots, PodMemoryTier
    from training.checkpoint.tiers import Restored
    from training.config import apply_overrides
    from training.parallel import dist_env_from_environment, init_process_group
    from training.recipes import recipe_config
    from training.runlog.metrics import EventLog
    from training.trainer import Trainer

    config = apply_overrides(
        recipe_config("debug_cpu", run_dir=str(root)),
        {
            "model.dim": str(dim),
            "model.n_layers": str(layers),
            "data.seq_len": "32",
            "model.max_seq_len": "64",
            "train.micro_batch_size": "1",
            "checkpoint.engine": "sync",
            "checkpoint.dir": str(root / "storage"),
        },
    )
    env = dist_env_from_environment(config.parallel, cpu_collectives=False)
    init_process_group(env, timeout_s=config.parallel.pg_timeout_s)
    rank, world = env.rank, env.world_size
    events = EventLog(run_dir=root, rank=rank)
    trainer = Trainer(config=config, env=env, events=events)
    trainer.train_step()  # AdamW's state exists from the first step on
    trainer.step = 1
    step = trainer.step

    def snapshot() -> dict[str, Any]:
        """Every local tensor's bytes, to compare a restored state with."""
        leaves, _ = sf.walk(trainer.state_dict())
        return {i: v.clone() for i, (_, _, v) in enumerate(leaves) if isinstance(v, torch.Tensor)}

    def equal(saved: dict[str, Any]) -> bool:
        leaves, _ = sf.walk(trainer.state_dict())
        return all(torch.equal(saved[i], leaves[i][2]) for i in saved)

    def scramble() -> None:
        """Overwrite the state (a restore that did nothing then fails the check)."""
        with torch.no_grad():
            for _, _, value in sf.walk(trainer.state_dict())[0]:
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.fill_(0.5)

    # The committed checkpoint of `step` on storage.
    manager = CheckpointManager.for_job(config=config, rank=rank, world_size=world, events=events)
    manager.start()
    manager.save(trainer, step=step, blocking=True)
    path = step_dir(root / "storage", step)
    saved = snapshot()

    # The pod-memory snapshot of `step`: rank r's node memory is shm/node-r.
    node = shm / f"node-{rank}"
    state = trainer.state_dict()
    meta = sf.meta_for(state, owner=OWNER, rank=rank, world_size=world, step=step)
    target_file = sf.SlotFile(sf.slot_dir(node, kind="own", rank=rank, slot=0), nbytes=meta.nbytes)
    sf.pack(state, target_file.data, meta)
    meta = sf.with_checksum(meta, target_file.data)
    sf.publish(target_file.directory, meta)
    target_file.close()

    def copies() -> PeerCopies:
        return PeerCopies(
            root=node,
            owner=OWNER,
            rank=rank,
            world_size=world,
            local_world_size=1,  # each rank its own node here
            events=events,
        )

    exchange_s = []
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        copies().exchange(step=step, blocking=True)  # bench/peer.py: in the background
        exchange_s.append(time.perf_counter() - started)

    def storage() -> None:
        dcp.load({"trainer": trainer}, storage_reader=VerifyingReader(path))

    def pod_memory() -> None:
        tier = PodMemoryTier(
            PodMemorySnapshots.for_rank(root=node, owner=OWNER, rank=rank, world_size=world)
        )
        outcome = tier.load(trainer, step=step)
        assert isinstance(outcome, Restored), outcome

    def lose_node_1() -> None:
        """Node 1's memory is gone (its own snapshots); node 0 keeps its copy of rank 1."""
        dist.barrier()
        if rank == 1:
            shutil.rmtree(node / "own", ignore_errors=True)
        dist.barrier()

    def peer() -> None:
        tier = PeerTier(copies())
        steps = tier.steps()
        assert steps and steps[0] == step, steps
        outcome = tier.load(trainer, step=step)
        assert isinstance(outcome, Restored), outcome

    ways = {"storage": storage, "pod_memory": pod_memory, "peer": peer}
    storage()  # warm-up: the files in the page cache, as for every later round
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for k in range(rounds):
        for way in WAYS[k % len(WAYS) :] + WAYS[: k % len(WAYS)]:
            if way == "peer":
                lose_node_1()
            scramble()
            gc.collect()
            dist.barrier()
            with gc_paused():
                started = time.perf_counter()
                ways[way]()
                times[way].append(time.perf_counter() - started)
            assert equal(saved), f"{way} restored another state"
    manager.close()
    report = {
        "rank": rank,
        "shard_bytes": meta.nbytes,
        "times": times,
        "exchange_s": exchange_s,
        "peer_copies_held": [
            [m.rank, m.step, m.nbytes] for _, m in sf.list_snapshots(node, kind="peer")
        ],
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        out.write_text(json.dumps({"ranks": gathered}))
    dist.barrier()
    dist.destroy_process_group()


def analyse(raw: dict[str, Any], *, dim: int, layers: int, rounds: int) -> dict[str, Any]:
    """Per round the slowest rank, then the median over rounds."""
    ranks = raw["ranks"]
    slowest = {way: [max(r["times"][way][k] for r in ranks) for k in range(rounds)] for way in WAYS}
    seconds = {way: median(values) for way, values in slowest.items()}
    exchange = [max(r["exchange_s"][k] for r in ranks) for k in range(rounds)]
    node_bytes = max(r["shard_bytes"] for r in ranks)  # one rank per node here
    result: dict[str, Any] = {
        "dim": dim,
        "layers": layers,
        "rounds": rounds,
        "ranks": len(ranks),
        "ranks_per_node": 1,
        "shard_bytes": [r["shard_bytes"] for r in ranks],
        "state_bytes": sum(r["shard_bytes"] for r in ranks),
        "seconds": seconds,
        "per_round_slowest_s": slowest,
        "storage_verified_s": seconds["storage"],
        "pod_memory_s": seconds["pod_memory"],
        "peer_s": seconds["peer"],
        "pod_memory_vs_storage": ratio(seconds["pod_memory"], seconds["storage"]),
        "peer_vs_storage": ratio(seconds["peer"], seconds["storage"]),
        "exchange_s": median(exchange),
        "exchange_bytes_per_node": {"sent": node_bytes, "received": node_bytes},
        "exchange_gb_per_s": (node_bytes / median(exchange) / 1e9 if median(exchange) else None),
        "peer_copies_held": {r["rank"]: r["peer_copies_held"] for r in ranks},
    }
    floor = fmt(seconds["storage"])
    result["targets"] = [
        target(
            f"pod memory restore / verified storage load {floor} s",
            result["pod_memory_vs_storage"],
            goal=0.5,
            higher_is_better=False,
        ),
        target(
            f"peer restore / verified storage load {floor} s",
            result["peer_vs_storage"],
            goal=1.0,
            higher_is_better=False,
        ),
    ]
    return result


def report(result: dict[str, Any]) -> str:
    rows = [
        [way, result["seconds"][way], ratio(result["seconds"][way], result["seconds"]["storage"])]
        for way in WAYS
    ]
    lines = [
        f"restore of one step, {result['ranks']} CPU ranks as nodes of 1, "
        f"{result['state_bytes'] / 2**20:.0f} MiB of state (median of {result['rounds']} "
        "rounds, slowest rank)",
        table(["from", "seconds", "vs storage"], rows),
        f"exchange after a snapshot: {fmt(result['exchange_s'])} s, "
        f"{result['exchange_bytes_per_node']['sent'] / 2**20:.0f} MiB sent and received per node",
        targets_table(result["targets"]),
    ]
    return "\n".join(lines)


def run(*, quick: bool = False, rounds: int | None = None, timeout_s: float = 900) -> dict:
    """Launch the 2-rank job, analyse it, print the table and write the JSON."""
    sizes = dict(QUICK if quick else FULL)
    if rounds is not None:
        sizes["rounds"] = max(2, rounds)
    root = RUNS_DIR / "restore"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
    shm = shm_base / f"bench-restore-{uuid.uuid4().hex[:12]}"
    try:
        raw = run_workers(
            "bench.restore",
            log_dir=root,
            timeout_s=timeout_s,
            dim=sizes["dim"],
            layers=sizes["layers"],
            rounds=sizes["rounds"],
            root=root,
            shm=shm,
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    result = analyse(
        raw,
        dim=sizes["dim"],
        layers=sizes["layers"],
        rounds=sizes["rounds"],
    )
    result["machine"] = machine()
    result["quick"] = quick
    print(report(result), flush=True)
    write_result("restore", result)
    shutil.rmtree(root / "storage", ignore_errors=True)  # GBs: keep only the logs
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.restore", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small state, 2 rounds")
    parser.add_argument("--rounds", type=int, help="rounds of the three ways")
    add_worker_options(parser, dim=FULL["dim"], layers=FULL["layers"], root=Path, shm=Path)
    args = parser.parse_args(argv)
    if args.worker:
        worker(
            dim=args.dim,
            layers=args.layers,
            rounds=args.rounds or FULL["rounds"],
            root=args.root,
            shm=args.shm,
            out=args.out,
        )
        return 0
    run(quick=args.quick, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
