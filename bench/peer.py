"""Peer exchange benchmark: the cost per memory interval of copying each rank's pod-memory
snapshot to its holder, against the wire-time floor measured in the same run.

Two CPU ranks as two nodes of one rank (gloo), each with a state of ``mib`` MiB snapshotted into
its own "pod memory" (a directory under ``/dev/shm``). Rounds interleave four measurements, so
a load change on the machine hits them alike:

- ``floor``: the same bytes sent around the ring in one message on the exchange's own gloo
  group, between buffers already in memory: what the wire (here loopback TCP) costs at least;
- ``serial``: the exchange waited for on the training thread (``exchange(blocking=True)``: what
  every exchange cost before it had its own thread): wall time = blocked time;
- ``background``: the exchange as the manager runs it (``settle()``, the snapshot,
  ``exchange()``): the training thread's time in settle and exchange (one all-reduce, the
  thread started; the snapshot's own copy not counted) is its blocked time; the
  training thread then runs steps (a matmul and an all-reduce each) until every rank's
  exchange is over; the exchange's wall time is its thread's, publish wait to publish;
- ``steps``: the same steps with no exchange, for the step time the exchange slows down (on
  this 2-core machine the exchange's copies and CRC take CPU from the steps; on a p5 host with
  192 vCPUs they would not).

Each figure: median, min and max over the rounds, slowest rank per round; ratios to the floor's
median. Then the p5 estimate (``facts.hardware``: 32 x 100 Gb/s EFA = 3,200 Gb/s per node): the
exchange moves 52.9 GB per node per interval at ``p5_70b`` on 16 nodes; on the exchange's gloo
group that is TCP on the pod's network interface, not EFA (docs/restore-tiers.md, "Peer copy").

Writes bench/results/peer.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
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
    write_result,
)

FULL = {"mib": 192, "rounds": 7, "bucket_mib": 16}
QUICK = {"mib": 16, "rounds": 3, "bucket_mib": 4}
MODES = ("floor", "serial", "background", "steps")
OWNER = "bench-peer"
STEPS_PER_ROUND = 6
"""Steps of the ``steps`` measurement (and at least as many in ``background``)."""

P5_NODE_BYTES = 52.9e9
"""What one node sends (and receives) per interval at p5_70b on 16 nodes: 12 bytes per
parameter (fp32 sharded params, AdamW's two moments), 847 GB / 16 nodes."""
P5_TCP_GBITS = 100
"""The pod's TCP path on a p5 node: one network card's interface (of 32), an assumption (not
measured here, no AWS): the gloo group's sockets go over the pod's interface, not EFA."""


def worker(*, mib: int, rounds: int, bucket_mib: int, shm: Path, out: Path) -> None:
    import os

    import torch
    import torch.distributed as dist

    from training.checkpoint.peer import PeerCopies
    from training.checkpoint.pod_memory import PodMemorySnapshots
    from training.runlog.metrics import EventLog

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    torch.set_num_threads(1)
    node = shm / f"node-{rank}"
    events = EventLog(run_dir=out.parent / "run", rank=rank)
    numel = (mib << 20) // 4
    state = {"model": {"w": torch.randn(numel)}, "step": 0}
    snapshots = PodMemorySnapshots(root=node, owner=OWNER, rank=rank, world_size=world)
    copies = PeerCopies(
        root=node,
        owner=OWNER,
        rank=rank,
        world_size=world,
        local_world_size=1,
        events=events,
        staging=None,
        bucket_bytes=bucket_mib << 20,
        published=snapshots.publication,
    )
    snapshots.prepare(state)
    a = torch.randn(256, 256)

    def step() -> None:
        for _ in range(8):
            a.copy_(torch.tanh(a @ a / 256))
        dist.all_reduce(torch.ones(1))

    def everyone_done() -> bool:
        flag = torch.tensor([0 if copies.in_flight() else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    source = torch.empty(numel * 4, dtype=torch.uint8).fill_(1)
    sink = torch.empty(numel * 4, dtype=torch.uint8).fill_(0)
    holder, src = (rank + 1) % world, (rank - 1) % world
    step_no = [0]

    def snapshot() -> int:
        step_no[0] += 1
        state["model"]["w"].add_(1.0)
        state["step"] = step_no[0]
        snapshots.take(state, step=step_no[0])
        return step_no[0]

    copies.exchange(step=snapshot(), blocking=True)  # warm: the group, the mappings, the pages
    records: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for k in range(rounds):
        order = MODES[k % len(MODES) :] + MODES[: k % len(MODES)]
        for mode in order:
            dist.barrier()
            if mode == "floor":
                group = copies._exchange_group()
                started = time.perf_counter()
                ops = [
                    dist.P2POp(dist.isend, source, holder, group=group),
                    dist.P2POp(dist.irecv, sink, src, group=group),
                ]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                wall = time.perf_counter() - started
                records[mode].append({"wall_s": slowest(wall), "blocked_s": slowest(wall)})
            elif mode == "serial":
                started = time.perf_counter()
                copies.settle()
                settle_s = copies._settle_s
                taken = snapshot()
                snapshot_s = time.perf_counter() - started - settle_s
                started = time.perf_counter()
                copies.exchange(step=taken, blocking=True)
                wall = time.perf_counter() - started
                records[mode].append(
                    {
                        "wall_s": slowest(wall),
                        "blocked_s": slowest(wall + settle_s),
                        "snapshot_s": slowest(snapshot_s),
                    }
                )
            elif mode == "background":
                started = time.perf_counter()
                copies.settle()  # the manager's order: settle, snapshot, exchange
                taken = snapshot()
                snapshot_s = time.perf_counter() - started - copies._settle_s
                assert copies.exchange(step=taken)
                blocked = copies.last_blocked_s
                started = time.perf_counter()
                steps = 0
                while True:
                    step()
                    steps += 1
                    if steps >= STEPS_PER_ROUND and everyone_done():
                        break
                stepping = time.perf_counter() - started
                copies.wait()
                records[mode].append(
                    {
                        "wall_s": slowest(copies.last_exchange_s),
                        "blocked_s": slowest(blocked),
                        "snapshot_s": slowest(snapshot_s),
                        "steps": steps,
                        "step_s": slowest(stepping / steps),
                    }
                )
            else:
                started = time.perf_counter()
                for _ in range(STEPS_PER_ROUND):
                    step()
                records[mode].append(
                    {"step_s": slowest((time.perf_counter() - started) / STEPS_PER_ROUND)}
                )
    copies.close()
    snapshots.close(remove=True)
    if rank == 0:
        out.write_text(json.dumps({"records": records, "bytes_per_rank": numel * 4}))
    dist.barrier()
    dist.destroy_process_group()


def spread(values: list[float]) -> dict[str, float | None]:
    return {
        "median": median(values),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
        "stdev": statistics.stdev(values) if len(values) > 1 else None,
    }


def analyse(raw: dict[str, Any], *, sizes: dict[str, int]) -> dict[str, Any]:
    records = raw["records"]
    nbytes = raw["bytes_per_rank"]

    def column(mode: str, key: str) -> list[float]:
        return [r[key] for r in records[mode]]

    floor = median(column("floor", "wall_s"))
    modes = {
        mode: {
            "wall_s": spread(column(mode, "wall_s")),
            "blocked_s": spread(column(mode, "blocked_s")),
        }
        for mode in ("floor", "serial", "background")
    }
    for mode in ("serial", "background"):
        for key in ("wall_s", "blocked_s"):
            modes[mode][f"{key}_vs_floor"] = ratio(modes[mode][key]["median"], floor)
            per_round = [v / floor for v in column(mode, key)] if floor else []
            modes[mode][f"{key}_vs_floor_spread"] = spread(per_round)
    step_alone = median(column("steps", "step_s"))
    step_during = median(column("background", "step_s"))
    wall_ratio = modes["background"]["wall_s_vs_floor"]
    p5_rank_bytes = P5_NODE_BYTES / 8
    efa_floor = P5_NODE_BYTES / (3200 / 8 * 1e9)
    tcp_floor = P5_NODE_BYTES / (P5_TCP_GBITS / 8 * 1e9)
    return {
        **sizes,
        "ranks": 2,
        "ranks_per_node": 1,
        "bytes_per_rank": nbytes,
        "buckets": -(-nbytes // (sizes["bucket_mib"] << 20)),
        "floor_s": floor,
        "floor_gb_per_s": nbytes / floor / 1e9 if floor else None,
        "modes": modes,
        "background_blocked_s": modes["background"]["blocked_s"]["median"],
        "background_wall_s": modes["background"]["wall_s"]["median"],
        "serial_blocked_s": modes["serial"]["blocked_s"]["median"],
        "background_wall_vs_floor": wall_ratio,
        "serial_blocked_vs_floor": modes["serial"]["blocked_s_vs_floor"],
        "background_blocked_vs_serial": ratio(
            modes["background"]["blocked_s"]["median"], modes["serial"]["blocked_s"]["median"]
        ),
        "steps_during_exchange": column("background", "steps"),
        "step_s_alone": spread(column("steps", "step_s")),
        "step_s_during_exchange": spread(column("background", "step_s")),
        "step_slowdown_during_exchange": ratio(step_during, step_alone),
        "p5_estimate": {
            "node_bytes_per_interval": P5_NODE_BYTES,
            "rank_bytes_per_interval": p5_rank_bytes,
            "buckets_per_rank_at_256_mib": -(-int(p5_rank_bytes) // (256 << 20)),
            "efa_gbits": 3200,
            "efa_note": "32 network cards x 100 Gb/s (facts.hardware.P5_EFA_GBITS)",
            "efa_floor_s": efa_floor,
            "tcp_gbits_assumed": P5_TCP_GBITS,
            "tcp_floor_s": tcp_floor,
            "exchange_wall_s_estimate": tcp_floor * wall_ratio if wall_ratio else None,
            "training_thread_blocked_s_estimate": "one all-reduce of an int and a thread start "
            "per interval (measured here: background_blocked_s), whatever the size",
        },
    }


def report(result: dict[str, Any]) -> str:
    rows = []
    for mode in ("floor", "serial", "background"):
        m = result["modes"][mode]
        rows.append(
            [
                mode,
                m["wall_s"]["median"],
                f"{fmt(m['wall_s']['min'])}-{fmt(m['wall_s']['max'])}",
                m["blocked_s"]["median"],
                f"{fmt(m['blocked_s']['min'])}-{fmt(m['blocked_s']['max'])}",
                m.get("blocked_s_vs_floor", 1.0),
            ]
        )
    p5 = result["p5_estimate"]
    return "\n".join(
        [
            f"peer exchange, 2 CPU ranks as nodes of 1, {result['bytes_per_rank'] / 2**20:.0f} MiB "
            f"per rank in {result['buckets']} buckets, {result['rounds']} interleaved rounds "
            "(slowest rank per round)",
            table(
                ["mode", "wall s", "wall min-max", "blocked s", "blocked min-max", "blocked/floor"],
                rows,
            ),
            f"exchange wall / floor: {fmt(result['background_wall_vs_floor'])}; step time during "
            f"the exchange / alone: {fmt(result['step_slowdown_during_exchange'])}",
            f"p5 (52.9 GB per node per interval): EFA floor {fmt(p5['efa_floor_s'])} s at 3,200 "
            f"Gb/s; the exchange's TCP floor {fmt(p5['tcp_floor_s'])} s at "
            f"{p5['tcp_gbits_assumed']} Gb/s, x{fmt(result['background_wall_vs_floor'])} measured "
            f"here: ~{fmt(p5['exchange_wall_s_estimate'])} s in the background per interval",
        ]
    )


def run(*, quick: bool = False, rounds: int | None = None, timeout_s: float = 900) -> dict:
    sizes = dict(QUICK if quick else FULL)
    if rounds is not None:
        sizes["rounds"] = max(2, rounds)
    root = RUNS_DIR / "peer"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
    shm = shm_base / f"bench-peer-{uuid.uuid4().hex[:12]}"
    try:
        raw = run_workers(
            "bench.peer",
            log_dir=root,
            timeout_s=timeout_s,
            mib=sizes["mib"],
            rounds=sizes["rounds"],
            bucket_mib=sizes["bucket_mib"],
            shm=shm,
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    result = analyse(raw, sizes=sizes)
    result["machine"] = machine()
    result["quick"] = quick
    print(report(result), flush=True)
    write_result("peer", result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small state, 3 rounds")
    parser.add_argument("--rounds", type=int, help="interleaved rounds")
    add_worker_options(parser, mib=FULL["mib"], bucket_mib=FULL["bucket_mib"], shm=Path)
    args = parser.parse_args(argv)
    if args.worker:
        worker(
            mib=args.mib,
            rounds=args.rounds or FULL["rounds"],
            bucket_mib=args.bucket_mib,
            shm=args.shm,
            out=args.out,
        )
        return 0
    run(quick=args.quick, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
