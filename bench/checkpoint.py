"""Checkpoint benchmark: how long each engine blocks training, and how fast it writes.

Measures, in ONE torchrun job of 2 CPU ranks (gloo) on the same FSDP2 state (a debug model
widened so that model + AdamW state is >= 300 MB in total):

- per-rank blocking time of ``CheckpointManager.save`` with the three engines side by side:
  ``nvrx`` (NVRx async, persistent worker), ``torch_async`` (torch DCP ``async_save`` in a
  process) and ``sync`` (blocking DCP save with fsync, committed before it returns);
- the floor: a memory copy of one rank's shard (a clone of its local tensors);
- the first save of each engine against the warm ones (median of the later repeats);
- background write throughput (bytes / (committed - staged)) against a raw fsynced write of the
  same bytes to the same disk, by both ranks at once;
- the phases of each nvrx save (``CheckpointManager.last_save_phases``), first and warm;
- loading the newest nvrx checkpoint four ways, taking turns: a plain DCP load (the floor),
  the one-pass verified load the manager uses, the same reader with its CRCs skipped (what the
  verification itself costs) and the old two-pass way (CRC pass, then DCP).

The engines take turns within each repeat (the order rotates), so machine noise hits all of
them alike; every save is waited for and must be committed (checked at the end).

    python -m bench.checkpoint               # full: ~420 MB of state, 3 rounds
    python -m bench.checkpoint --quick       # smoke: ~20 MB, 2 rounds

Writes bench/results/checkpoint.json; ``nvrx_async_blocking_s`` (median warm, slowest rank) is
what the planner (``python -m planner --costs measured-cpu``, planner/measured.py) reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    RUNS_DIR,
    add_worker_options,
    machine,
    median,
    ratio,
    run_workers,
    table,
    target,
    targets_table,
    write_result,
)

ENGINES = ("nvrx", "torch_async", "sync")
PREPARE_STEPS = 3
"""Steps between ``CheckpointManager.prepare`` (the trainer calls it after step 1) and the
first save; any checkpoint interval of the recipes is longer."""
FULL = {"dim": 1024, "layers": 3, "repeats": 3}
QUICK = {"dim": 256, "layers": 2, "repeats": 2}


# ---------------------------------------------------------------------------------------------
# the worker: one rank under torchrun
# ---------------------------------------------------------------------------------------------


def _local_tensors(state: Any) -> list:
    """Every tensor of a state dict, DTensors as their local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return [t for value in state.values() for t in _local_tensors(value)]
    if isinstance(state, list | tuple):
        return [t for value in state for t in _local_tensors(value)]
    if isinstance(state, DTensor):
        return [state.to_local()]
    if hasattr(state, "detach"):
        return [state]
    return []


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def worker(*, dim: int, layers: int, repeats: int, root: Path, out: Path) -> None:
    """Build the trainer, take one step (AdamW state exists), then time the saves."""
    import torch.distributed as dist

    from training.checkpoint.layout import committed_steps, rank_files, step_dir, verify
    from training.checkpoint.manager import CheckpointManager, needs_cpu_collectives
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
            "checkpoint.keep_last": "100",
        },
    )
    env = dist_env_from_environment(
        config.parallel, cpu_collectives=needs_cpu_collectives(config.checkpoint)
    )
    init_process_group(env, timeout_s=config.parallel.pg_timeout_s)
    rank = env.rank
    events = EventLog(run_dir=root, rank=rank)
    trainer = Trainer(config=config, env=env, events=events)
    trainer.train_step()  # AdamW's state (exp_avg, exp_avg_sq) exists from the first step on
    trainer.step = 1

    local = _local_tensors(trainer.state_dict())
    shard_bytes = sum(t.numel() * t.element_size() for t in local)
    managers = {
        engine: CheckpointManager.for_job(
            config=dataclasses.replace(
                config,
                checkpoint=dataclasses.replace(
                    config.checkpoint, engine=engine, dir=str(root / engine)
                ),
            ),
            rank=rank,
            world_size=env.world_size,
            events=events,
        )
        for engine in ENGINES
    }
    for manager in managers.values():
        manager.start()
        manager.prepare(trainer)  # as the trainer does after its first step: starts the worker
        manager.wait()  # the NVRx worker is up, as it is long before a run's first save
    for _ in range(PREPARE_STEPS):  # a run trains at least a few steps before its first save
        trainer.train_step()

    rows: list[dict[str, Any]] = []
    floor: list[float] = []
    for repeat in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        copies = [t.detach().clone() for t in local]
        floor.append(time.perf_counter() - started)
        del copies
        order = ENGINES[repeat % 3 :] + ENGINES[: repeat % 3]
        for engine in order:
            manager = managers[engine]
            step = 10 * (repeat + 1)
            dist.barrier()
            started = time.perf_counter()
            blocking = manager.save(trainer, step=step, blocking=False)
            manager.wait()
            dist.barrier()
            total = time.perf_counter() - started
            rows.append(
                {
                    "engine": engine,
                    "repeat": repeat,
                    "step": step,
                    "blocking_s": blocking,
                    "phases": dict(manager.last_save_phases),
                    "plan_reused": manager.last_plan_reused,
                    "durable_s": total,
                    "rank_bytes": sum(
                        p.stat().st_size for p in rank_files(step_dir(manager.root, step), rank)
                    ),
                }
            )

    # A raw write of this rank's shard bytes to the same disk, fsynced, both ranks at once.
    raw_dir = root / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    raw: list[float] = []
    for _ in range(max(2, repeats - 1)):
        path = raw_dir / f"rank_{rank}.bin"
        dist.barrier()
        started = time.perf_counter()
        with open(path, "wb") as handle:
            for tensor in local:
                handle.write(tensor.detach().contiguous().reshape(-1).numpy().view("uint8"))
            handle.flush()
            os.fsync(handle.fileno())
        dist.barrier()
        raw.append(time.perf_counter() - started)
        path.unlink()

    loads = _time_loads(
        trainer,
        step_dir(managers["nvrx"].root, 10 * repeats),
        rank=rank,
        world_size=env.world_size,
        rounds=LOAD_ROUNDS,
    )

    # Every save committed, and the newest of each engine passes its checksums.
    problems = []
    for engine, manager in managers.items():
        manager.close()
        expected = [10 * (r + 1) for r in range(repeats)]
        found = committed_steps(manager.root)
        if found != expected:
            problems.append(f"{engine}: committed {found}, expected {expected}")
        elif rank == 0 and (problem := verify(step_dir(manager.root, expected[-1]))):
            problems.append(f"{engine}: step {expected[-1]}: {problem}")

    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(
        gathered,
        {
            "rank": rank,
            "rows": rows,
            "floor_s": floor,
            "raw_s": raw,
            "shard_bytes": shard_bytes,
            "loads": loads,
        },
    )
    if rank == 0:
        sizes = {engine: _dir_bytes(step_dir(root / engine, 10)) for engine in ENGINES}
        out.write_text(
            json.dumps({"ranks": gathered, "checkpoint_bytes": sizes, "problems": problems})
        )
    dist.barrier()
    dist.destroy_process_group()


LOADS = ("plain", "verified", "unchecked", "two_pass")
LOAD_ROUNDS = 8
"""Each way twice in each position of the rotation; a load is ~0.15 s."""


def _time_loads(
    trainer: Any, path: Path, *, rank: int, world_size: int, rounds: int
) -> dict[str, list[float]]:
    """The same committed checkpoint loaded into the trainer four ways, taking turns:
    ``plain`` (DCP's ``FileSystemReader``, no checks: the floor), ``verified`` (the one-pass
    ``VerifyingReader`` the manager uses), ``unchecked`` (that reader with its CRCs skipped:
    the rest is its one-copy load) and ``two_pass`` (the old way: every rank CRCs its
    share of the files, the ranks agree, then a plain DCP load). One warm-up load first, so
    every timed load reads from the page cache alike; no garbage collection inside a timed
    load (the manager's load pauses it, ``integrity.gc_paused``; the plain one would otherwise
    take the collections the others are spared)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from training.checkpoint.integrity import VerifyingReader, gc_paused
    from training.checkpoint.layout import verify

    def two_pass() -> None:
        names = sorted(json.loads((path / "commit.json").read_text())["files"])
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, verify(path, names=names[rank::world_size]))
        assert not any(gathered), gathered
        dcp.load({"trainer": trainer}, storage_reader=FileSystemReader(path))

    class UncheckedReader(VerifyingReader):
        def _fails_checksum(self, chunk: memoryview, recorded: int) -> bool:
            return False

    ways = {
        "plain": lambda: dcp.load({"trainer": trainer}, storage_reader=FileSystemReader(path)),
        "verified": lambda: dcp.load({"trainer": trainer}, storage_reader=VerifyingReader(path)),
        "unchecked": lambda: dcp.load({"trainer": trainer}, storage_reader=UncheckedReader(path)),
        "two_pass": two_pass,
    }
    ways["plain"]()  # warm-up
    times: dict[str, list[float]] = {way: [] for way in LOADS}
    for k in range(rounds):
        for way in LOADS[k % len(LOADS) :] + LOADS[: k % len(LOADS)]:
            gc.collect()  # a full collection here takes ~150 ms: timed in no way (as timeit)
            dist.barrier()
            with gc_paused():
                started = time.perf_counter()
                ways[way]()
                times[way].append(time.perf_counter() - started)
    return times


# ---------------------------------------------------------------------------------------------
# the driver: launch the job, reduce, print, write JSON
# ---------------------------------------------------------------------------------------------


def analyse(raw: dict[str, Any], *, dim: int, layers: int, repeats: int) -> dict[str, Any]:
    """Medians over repeats; "warm" = every repeat but the first; per-rank and slowest-rank."""
    ranks = raw["ranks"]
    world = len(ranks)
    total_state = sum(r["shard_bytes"] for r in ranks)

    engines: dict[str, dict[str, Any]] = {}
    for engine in ENGINES:
        by_repeat = []
        for rep in range(repeats):
            rows = [row for r in ranks for row in r["rows"] if row["engine"] == engine]
            rows = [row for row in rows if row["repeat"] == rep]
            by_repeat.append(
                {
                    "blocking_s": max(row["blocking_s"] for row in rows),
                    "durable_s": max(row["durable_s"] for row in rows),
                    "bytes": sum(row["rank_bytes"] for row in rows),
                    "per_rank_blocking_s": [row["blocking_s"] for row in rows],
                }
            )
        warm = by_repeat[1:] or by_repeat
        background = [
            rep["bytes"] / max(1e-9, rep["durable_s"] - rep["blocking_s"]) / 1e6 for rep in warm
        ]
        engines[engine] = {
            "first_blocking_s": by_repeat[0]["blocking_s"],
            "warm_blocking_s": median(rep["blocking_s"] for rep in warm),
            "warm_blocking_per_rank_s": [
                median(rep["per_rank_blocking_s"][k] for rep in warm) for k in range(world)
            ],
            "warm_durable_s": median(rep["durable_s"] for rep in warm),
            "background_MBps": median(background) if engine != "sync" else None,
            "durable_MBps": median(rep["bytes"] / rep["durable_s"] / 1e6 for rep in warm),
            "repeats": by_repeat,
        }
    floor_s = median(max(r["floor_s"][k] for r in ranks) for k in range(repeats))
    raw_n = len(ranks[0]["raw_s"])
    raw_s = median(max(r["raw_s"][k] for r in ranks) for k in range(raw_n))
    raw_mbps = total_state / raw_s / 1e6 if raw_s else None
    nv, ta, sy = engines["nvrx"], engines["torch_async"], engines["sync"]
    load_rounds = {
        way: [max(r["loads"][way][k] for r in ranks) for k in range(len(ranks[0]["loads"][way]))]
        for way in LOADS
    }
    loads = {way: median(load_rounds[way]) for way in LOADS}
    targets = [
        _target(
            "nvrx warm blocking <= 2x the clone floor of the shard",
            value=nv["warm_blocking_s"],
            floor=floor_s,
            goal=2.0,
        ),
        _target(
            "nvrx first save <= 1.5x a warm one",
            value=nv["first_blocking_s"],
            floor=nv["warm_blocking_s"],
            goal=1.5,
        ),
        _target(
            "verified load <= 1.1x a plain DCP load",
            value=loads["verified"],
            floor=loads["plain"],
            goal=1.1,
        ),
        _target(
            "nvrx warm blocking <= 0.05x a sync durable save",
            value=nv["warm_blocking_s"],
            floor=sy["warm_blocking_s"],
            goal=0.05,
        ),
    ]
    return {
        "world_size": world,
        "model": {"dim": dim, "n_layers": layers},
        "repeats": repeats,
        "state_bytes_total": total_state,
        "state_bytes_per_rank": [r["shard_bytes"] for r in ranks],
        "checkpoint_bytes": raw["checkpoint_bytes"],
        "engines": engines,
        "floor_copy_s": floor_s,
        "raw_fsync_write_s": raw_s,
        "raw_fsync_MBps": raw_mbps,
        "nvrx_async_blocking_s": nv["warm_blocking_s"],
        "nvrx_first_blocking_s": nv["first_blocking_s"],
        "torch_async_blocking_s": ta["warm_blocking_s"],
        "sync_blocking_s": sy["warm_blocking_s"],
        "nvrx_background_vs_raw": ratio(nv["background_MBps"], raw_mbps),
        "nvrx_phases": {
            "first": _phases(ranks, "nvrx", repeats=[0]),
            "warm": _phases(ranks, "nvrx", repeats=list(range(1, repeats)) or [0]),
        },
        "load_s": loads,
        "load_rounds_s": load_rounds,
        "all_committed": not raw["problems"],
        "problems": raw["problems"],
        "targets": targets,
    }


def _target(name: str, *, value: float | None, floor: float | None, goal: float) -> dict:
    """``bench.common.target`` on value / floor, both kept beside the verdict."""
    entry = target(name, ratio(value, floor), goal=goal, higher_is_better=False)
    return {**entry, "value_s": value, "floor_s": floor}


def _phases(ranks: list[dict], engine: str, *, repeats: list[int]) -> dict[str, float]:
    """Median seconds of each save phase over ``repeats``, on the slowest rank of each."""
    rows = [row for r in ranks for row in r["rows"] if row["engine"] == engine]
    names = sorted({name for row in rows for name in row["phases"]})
    return {
        name: median(
            max(row["phases"].get(name, 0.0) for row in rows if row["repeat"] == rep)
            for rep in repeats
        )
        for name in names
    }


def report(result: dict[str, Any]) -> str:
    rows = []
    for engine, e in result["engines"].items():
        rows.append(
            (
                engine,
                e["first_blocking_s"],
                e["warm_blocking_s"],
                " / ".join(f"{v:.3f}" for v in e["warm_blocking_per_rank_s"]),
                e["warm_durable_s"],
                e["background_MBps"],
                ratio(e["warm_blocking_s"], result["floor_copy_s"]),
            )
        )
    rows.append(("floor: clone of a shard", None, result["floor_copy_s"], "", None, None, 1.0))
    raw_row = ("raw fsynced write", None, None, "", result["raw_fsync_write_s"])
    rows.append((*raw_row, result["raw_fsync_MBps"], None))
    header = (
        f"checkpoint: {result['state_bytes_total'] / 1e6:.0f} MB of model+AdamW state on "
        f"{result['world_size']} ranks, {result['repeats']} rounds; seconds are the slowest "
        f"rank's, warm = median of rounds 2..N; all committed: {result['all_committed']}"
    )
    body = table(
        [
            "engine",
            "first block s",
            "warm block s",
            "per rank s",
            "durable s",
            "bg MB/s",
            "x floor",
        ],
        rows,
    )
    phases = result["nvrx_phases"]
    phase_rows = [
        (name, phases["first"].get(name), phases["warm"].get(name))
        for name in phases["first"] | phases["warm"]
    ]
    loads = result["load_s"]
    load_rows = [(way, loads[way], ratio(loads[way], loads["plain"])) for way in LOADS]
    target_rows = [
        (t["target"], t["floor_s"], t["value_s"], t["value"], t["goal"], t["verdict"])
        for t in result["targets"]
    ]
    return "\n".join(
        [
            header,
            body,
            "",
            "nvrx save phases (s, slowest rank)",
            table(["phase", "first", "warm"], phase_rows),
            "",
            "load of the newest nvrx checkpoint (s, slowest rank, median)",
            table(["reader", "seconds", "x plain"], load_rows),
            "",
            table(["target", "floor s", "value s", "ratio", "goal", "verdict"], target_rows),
            "",
            targets_table(result["targets"]),
        ]
    )


def run(*, quick: bool = False, repeats: int | None = None, timeout_s: float = 900) -> dict:
    """Launch the 2-rank job, analyse it, print the table and write the JSON."""
    sizes = dict(QUICK if quick else FULL)
    if repeats is not None:
        sizes["repeats"] = max(2, repeats)
    root = RUNS_DIR / "checkpoint"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    raw = run_workers(
        "bench.checkpoint",
        log_dir=root,
        timeout_s=timeout_s,
        dim=sizes["dim"],
        layers=sizes["layers"],
        repeats=sizes["repeats"],
        root=root,
    )
    result = analyse(
        raw,
        dim=sizes["dim"],
        layers=sizes["layers"],
        repeats=sizes["repeats"],
    )
    result["machine"] = machine()
    result["quick"] = quick
    print(report(result), flush=True)
    write_result("checkpoint", result)
    # The checkpoints themselves are GBs: keep only the logs.
    for engine in ENGINES:
        shutil.rmtree(root / engine, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small state, 2 rounds")
    parser.add_argument("--repeats", type=int, help="rounds (first + warm ones)")
    add_worker_options(parser, dim=FULL["dim"], layers=FULL["layers"], root=Path)
    args = parser.parse_args(argv)
    if args.worker:
        worker(
            dim=args.dim,
            layers=args.layers,
            repeats=args.repeats or FULL["repeats"],
            root=args.root,
            out=args.out,
        )
        return 0
    run(quick=args.quick, repeats=args.repeats)
    return 0


if __name__ == "__main__":  # guarded: NVRx's worker and DCP's writer process use spawn
    sys.exit(main())
