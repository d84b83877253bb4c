"""All-reduce preflight: bus bandwidth of the whole job, of each node and of each node pair.

Run by a launcher in every rank of every node (the EKS preflight Job, `make eks-preflight`)::

    torchrun --nnodes=N --nproc-per-node=8 ... -m training.allreduce_check [--sizes ...]

Three phases, each an all-reduce of float32 buffers timed like nccl-tests (warm-up, then the
mean time of ``--iters`` back-to-back calls on the slowest rank):

1. ``world``: every rank, for each message size of ``--sizes`` (the sweep is informational;
   only the largest size is judged);
2. ``node``: each node's own ranks (NVLink inside a p5), all nodes at once;
3. ``pair``: every pair of nodes (EFA between them), in rounds of disjoint pairs (a round-robin
   schedule: ``N - 1`` rounds for ``N`` nodes, each node in one pair per round), so a slow node
   shows up in every pair it is part of and is named.

Bus bandwidth follows nccl-tests (``doc/PERFORMANCE.md``): ``algbw = bytes / time`` and, for
all-reduce, ``busbw = algbw * 2 * (n - 1) / n`` with ``n`` ranks in the group: a figure that
does not depend on ``n`` and compares with the hardware's link speed.

A group fails when its bus bandwidth is below ``--min-fraction`` of the median of its phase or
below ``--min-busbw-gbs``; a node is named slow when its own group fails, or (3+ nodes) when
every pair it is in fails. Every node's local rank 0 prints a table and one JSON line starting
with ``PREFLIGHT_REPORT``, then every rank exits `exits.OK`, `exits.ENVIRONMENT` (a slow node:
the same nodes would fail again; replace or cordon them) or `exits.FAILED` (a collective raised
or timed out: a broken node or link, named by the phase and group that failed).

Backend: NCCL on CUDA, gloo on CPU (so it runs in the tests, 4 CPU ranks as 2 "nodes"). The
results are gathered over a gloo group of their own, so a group that timed out is still reported.
For tests and demos, ``--slow-node I --slow-delay-s S [--slow-phase world|node|pair]`` makes node
I sleep before each all-reduce: slow, or broken once S exceeds ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from facts.hardware import P5_EFA_GBITS
from training import exits
from training.tables import text_table

REPORT_PREFIX = "PREFLIGHT_REPORT "
PHASES = ("world", "node", "pair")
MiB = 1 << 20

# p5.48xlarge: 3,200 Gbps of EFA networking per node, i.e. 400 GB/s each way (facts/hardware.py
# names the sources).
P5_NETWORK_GBS = P5_EFA_GBITS / 8
# The absolute floor on NCCL, as a fraction of that line rate. A healthy pair of p5 nodes runs
# its all-reduce at a large fraction of it; NCCL silently falling back to TCP sockets (EFA
# provider or plugin missing) or a node with most of its EFA cards down lands at a few percent.
# A quarter separates "EFA works" from "it does not" without failing a healthy cluster on tuning;
# the relative test below finds the single slow node. Calibrate with a known-good run
# (`--min-busbw-gbs`): this figure has not been measured on this stack.
P5_FLOOR_FRACTION = 0.25
NCCL_MIN_BUSBW_GBS = P5_NETWORK_GBS * P5_FLOOR_FRACTION
# A group slower than 80% of its phase's median is an outlier: identical nodes and links should
# measure within a few percent of each other, a degraded link or a throttled GPU costs far more
# (reasoned, like the floor: calibrate on the cluster with `--min-fraction`).
MIN_FRACTION_OF_MEDIAN = 0.8
# 256 MiB is on nccl-tests' bandwidth plateau for inter-node all-reduce (latency no longer
# matters) and takes milliseconds on a p5 pair: the node and pair phases use it.
DEFAULT_SIZES = (1 * MiB, 16 * MiB, 256 * MiB, 1024 * MiB)
DEFAULT_PAIR_BYTES = 256 * MiB


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """When a group's bus bandwidth fails the check."""

    min_fraction: float = MIN_FRACTION_OF_MEDIAN
    """Fail below this fraction of the median bus bandwidth of the same phase."""
    min_busbw_gbs: float = 0.0
    """Fail below this bus bandwidth (GB/s) whatever the others do (0: no floor)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_fraction <= 1 or self.min_busbw_gbs < 0:
            raise ValueError("min_fraction must be in [0, 1] and min_busbw_gbs >= 0")


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One timed all-reduce of one group."""

    phase: str
    """world | node | pair."""
    nodes: tuple[int, ...]
    """Node indices in the group."""
    ranks: int
    nbytes: int
    seconds: float = 0.0
    """Mean time per all-reduce on the slowest rank of the group."""
    error: str = ""
    """Why the measurement did not finish (a raised or timed-out collective)."""

    @property
    def algbw_gbs(self) -> float:
        return bus_bandwidth(nbytes=self.nbytes, seconds=self.seconds, ranks=self.ranks)[0]

    @property
    def busbw_gbs(self) -> float:
        return bus_bandwidth(nbytes=self.nbytes, seconds=self.seconds, ranks=self.ranks)[1]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nodes"] = list(self.nodes)
        d.update(algbw_gbs=round(self.algbw_gbs, 3), busbw_gbs=round(self.busbw_gbs, 3))
        return d


@dataclass(frozen=True, kw_only=True)
class Verdict:
    ok: bool
    code: int
    problems: tuple[str, ...] = ()
    slow_nodes: tuple[int, ...] = ()
    slow_pairs: tuple[tuple[int, int], ...] = ()
    broken: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Report:
    backend: str
    world_size: int
    nodes: tuple[str, ...]
    """Node index -> name (the hostname of its local rank 0: the pod name on EKS)."""
    thresholds: Thresholds
    measurements: tuple[Measurement, ...]
    verdict: Verdict
    elapsed_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.verdict.ok,
            "exit_code": self.verdict.code,
            "backend": self.backend,
            "world_size": self.world_size,
            "nodes": list(self.nodes),
            "thresholds": asdict(self.thresholds),
            "slow_nodes": [self.nodes[i] for i in self.verdict.slow_nodes],
            "slow_pairs": [[self.nodes[a], self.nodes[b]] for a, b in self.verdict.slow_pairs],
            "broken": list(self.verdict.broken),
            "problems": list(self.verdict.problems),
            "measurements": [m.as_dict() for m in self.measurements],
            "elapsed_s": round(self.elapsed_s, 3),
            **self.extra,
        }


# --- pure parts: formula, schedule, judgement ---------------------------------------------------


def bus_bandwidth(*, nbytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) of an all-reduce of `nbytes` taking `seconds`."""
    if seconds <= 0 or ranks < 1:
        return 0.0, 0.0
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (ranks - 1) / ranks


def round_robin(nodes: int) -> list[list[tuple[int, int]]]:
    """Every pair of `nodes` exactly once, in rounds of disjoint pairs (the circle method)."""
    slots = list(range(nodes)) + ([-1] if nodes % 2 else [])  # -1: a bye for odd counts
    rounds = []
    for _ in range(len(slots) - 1):
        half = len(slots) // 2
        pairs = [(slots[i], slots[-1 - i]) for i in range(half)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if -1 not in (a, b)])
        slots = [slots[0], slots[-1], *slots[1:-1]]  # fix the first, rotate the rest
    return rounds


def judge(
    *, measurements: Sequence[Measurement], names: Sequence[str], thresholds: Thresholds
) -> Verdict:
    """Which groups, nodes and pairs fail; the exit code that says so. `names[i]` is node i."""
    nodes = len(names)

    def label(m: Measurement) -> str:
        return "all nodes" if m.phase == "world" else " + ".join(names[n] for n in m.nodes)

    problems: list[str] = []
    broken = [f"{m.phase} {label(m)}: {m.error}" for m in measurements if m.error]
    failed: dict[str, list[Measurement]] = {}
    for phase in ("world", "node", "pair"):
        # One rank moves no data (busbw 0 by the formula): nothing to judge.
        group = [m for m in measurements if m.phase == phase and not m.error and m.ranks > 1]
        if phase == "world" and group:
            largest = max(m.nbytes for m in group)
            group = [m for m in group if m.nbytes == largest]  # smaller sizes: latency-bound
        if not group:
            continue
        median = statistics.median(m.busbw_gbs for m in group)
        floor = max(thresholds.min_fraction * median, thresholds.min_busbw_gbs)
        for m in group:
            if m.busbw_gbs < floor:
                failed.setdefault(phase, []).append(m)
                problems.append(
                    f"{phase} {label(m)}: busbw {m.busbw_gbs:.2f} GB/s < "
                    f"{floor:.2f} GB/s (median {median:.2f}, floor "
                    f"{thresholds.min_busbw_gbs:g}, fraction {thresholds.min_fraction:g})"
                )
    slow = {m.nodes[0] for m in failed.get("node", [])}
    pairs = [m for m in measurements if m.phase == "pair" and not m.error]
    slow_pairs = tuple(sorted((m.nodes[0], m.nodes[1]) for m in failed.get("pair", [])))
    if nodes >= 3:
        # A node whose every pair fails is the slow one; a single failing pair is a link.
        for n in range(nodes):
            mine = [p for p in pairs if n in p.nodes]
            if mine and all((p.nodes[0], p.nodes[1]) in slow_pairs for p in mine):
                slow.add(n)
    if broken:
        code = exits.FAILED
    elif problems:
        code = exits.ENVIRONMENT
    else:
        code = exits.OK
    return Verdict(
        ok=code == exits.OK,
        code=code,
        problems=tuple(problems),
        slow_nodes=tuple(sorted(slow)),
        slow_pairs=slow_pairs,
        broken=tuple(broken),
    )


def table(report: Report) -> str:
    """A human-readable summary: one line per measurement, then the verdict."""
    names = report.nodes
    rows = []
    for m in report.measurements:
        group = " + ".join(names[n] for n in m.nodes) if m.phase != "world" else "all"
        first = [m.phase, group, str(m.ranks), str(m.nbytes)]
        if m.error:
            rows.append([*first, f"ERROR {m.error}"])
            continue
        rows.append([*first, f"{m.seconds * 1e6:.1f}", f"{m.algbw_gbs:.2f}", f"{m.busbw_gbs:.2f}"])
    headers = ["phase", "group", "ranks", "size", "time us", "algbw GB/s", "busbw GB/s"]
    error_rows = any(m.error for m in report.measurements)
    lines = [
        f"all-reduce preflight: {report.world_size} ranks on {len(names)} node(s), "
        f"backend {report.backend}",
        # An error's message runs on from the time column: left-aligned when there is one.
        *text_table(rows, headers=headers, align="<<>>" + ("<" if error_rows else ">") + ">>"),
    ]
    v = report.verdict
    if v.ok:
        lines.append("PASS: no slow or broken node")
    else:
        lines += [f"FAIL: {p}" for p in (*v.broken, *v.problems)]
        if v.slow_nodes:
            lines.append("slow node(s): " + ", ".join(names[n] for n in v.slow_nodes))
        if v.slow_pairs:
            lines.append(
                "slow pair(s): " + ", ".join(f"{names[a]} + {names[b]}" for a, b in v.slow_pairs)
            )
    return "\n".join(lines)


# --- the distributed part -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to measure and how long to wait for it."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    pair_bytes: int = DEFAULT_PAIR_BYTES
    iters: int = 20
    warmup: int = 5
    timeout_s: float = 300.0
    """Process-group timeout: a collective that takes longer is a broken node or link."""
    slow_node: int = -1
    """For tests and demos: this node's ranks sleep `slow_delay_s` before every all-reduce
    (of `slow_phase` only, unless empty); a delay beyond `timeout_s` makes a broken node."""
    slow_delay_s: float = 0.0
    slow_phase: str = ""

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 4 or self.pair_bytes < 4:
            raise ValueError("message sizes must be at least 4 bytes (one float32)")
        if self.iters < 1 or self.warmup < 0 or self.timeout_s <= 0:
            raise ValueError("iters >= 1, warmup >= 0 and timeout_s > 0 are required")
        if self.slow_phase not in ("", *PHASES):
            raise ValueError(f"slow_phase must be one of {', '.join(PHASES)} or empty")

    @property
    def control_timeout_s(self) -> float:
        """The results' group waits out a timed-out measurement and a slow node's delays."""
        return max(600.0, 4 * self.timeout_s, 4 * self.slow_delay_s * (self.iters + self.warmup))


def _time_all_reduce(
    *, group: Any, nbytes: int, plan: Plan, device: Any, before: Callable[[], None]
) -> float:
    """Mean seconds per all-reduce on the slowest rank of `group`."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(plan.warmup):
        before()
        dist.all_reduce(buf, group=group)
    sync()
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)
    start = time.perf_counter()
    works = []
    for _ in range(plan.iters):
        before()
        works.append(dist.all_reduce(buf, group=group, async_op=True))
    for work in works:
        work.wait()  # raises when the group's communicator was aborted (timeout)
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / plan.iters], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def _measure(
    *,
    phase: str,
    group: Any,
    nodes: tuple[int, ...],
    ranks: int,
    nbytes: int,
    plan: Plan,
    device: Any,
    before: Callable[[], None],
) -> Measurement:
    try:
        seconds = _time_all_reduce(
            group=group, nbytes=nbytes, plan=plan, device=device, before=before
        )
    except Exception as err:  # a timed-out or aborted collective: report it, do not hang
        first = (str(err).splitlines() or [""])[0]
        first = re.sub(r"^\[[^\]]*\]\s*", "", first)[:200]  # drop gloo's "[file.cc:129]"
        return Measurement(
            phase=phase,
            nodes=nodes,
            ranks=ranks,
            nbytes=nbytes,
            error=f"{type(err).__name__}: {first}",
        )
    return Measurement(phase=phase, nodes=nodes, ranks=ranks, nbytes=nbytes, seconds=seconds)


def node_of_rank() -> int:
    """This rank's node index: torchrun's GROUP_RANK, else rank // LOCAL_WORLD_SIZE."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    return int(os.environ.get("RANK", "0")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def run_check(*, plan: Plan, thresholds: Thresholds | None) -> Report:
    """Measure every phase in this (already initialised) process group and judge the result.

    `thresholds=None` takes the defaults of the backend: the p5 floor on NCCL, none on gloo.
    """
    import torch.distributed as dist

    started = time.monotonic()
    backend = dist.get_backend()
    device = _device()
    if thresholds is None:
        floor = NCCL_MIN_BUSBW_GBS if backend == "nccl" else 0.0
        thresholds = Thresholds(min_busbw_gbs=floor)
    timeout = timedelta(seconds=plan.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    # Results travel over a group of their own, gloo (TCP): they still arrive when a measured
    # group timed out or its NCCL communicator was aborted.
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=plan.control_timeout_s))
    me = (node_of_rank(), socket.gethostname())
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, me, group=control)
    node_ranks: dict[int, list[int]] = {}
    for r, (node, _host) in enumerate(everyone):
        node_ranks.setdefault(node, []).append(r)
    order = sorted(node_ranks)
    index = {node: i for i, node in enumerate(order)}  # dense 0..N-1
    nodes = len(order)
    ranks_of = [node_ranks[n] for n in order]
    names = tuple(f"{everyone[rs[0]][1]}/node{i}" for i, rs in enumerate(ranks_of))
    my_node = index[me[0]]

    def slow_in(phase: str) -> Callable[[], None]:
        def before() -> None:
            if my_node == plan.slow_node and plan.slow_phase in ("", phase):
                time.sleep(plan.slow_delay_s)

        return before

    local: list[Measurement] = []
    everything = tuple(range(nodes))
    for nbytes in plan.sizes:
        m = _measure(
            phase="world",
            group=dist.group.WORLD,
            nodes=everything,
            ranks=world,
            nbytes=nbytes,
            plan=plan,
            device=device,
            before=slow_in("world"),
        )
        if rank == 0:
            local.append(m)
    if nodes > 1:
        groups = [(("node", (i,)), ranks_of[i]) for i in range(nodes)]
        rounds = [groups] + [
            [(("pair", (a, b)), ranks_of[a] + ranks_of[b]) for a, b in pairs]
            for pairs in round_robin(nodes)
        ]
        for round_groups in rounds:
            mine, _ = dist.new_subgroups_by_enumeration(
                [rs for _, rs in round_groups], timeout=timeout
            )
            for (phase, members), rs in round_groups:
                if rank not in rs:
                    continue
                m = _measure(
                    phase=phase,
                    group=mine,
                    nodes=members,
                    ranks=len(rs),
                    nbytes=plan.pair_bytes,
                    plan=plan,
                    device=device,
                    before=slow_in(phase),
                )
                if rank == rs[0]:  # one report per group
                    local.append(m)
            if mine is not None:
                _destroy(mine)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local, group=control)
    phases = {p: i for i, p in enumerate(PHASES)}
    measurements = tuple(
        sorted(
            (m for part in gathered for m in part),
            key=lambda m: (phases[m.phase], m.nodes, m.nbytes),
        )
    )
    verdict = judge(measurements=measurements, names=names, thresholds=thresholds)
    _destroy(control)
    return Report(
        backend=backend,
        world_size=world,
        nodes=names,
        thresholds=thresholds,
        measurements=measurements,
        verdict=verdict,
        elapsed_s=time.monotonic() - started,
    )


def _destroy(group: Any = None) -> None:
    """Destroy a process group; one whose communicator was aborted may refuse: keep going."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception as err:  # the verdict is already known; do not lose it here
        print(f"allreduce_check: destroying a process group: {err}", file=sys.stderr)


def _device() -> Any:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# --- command line -------------------------------------------------------------------------------


def _sizes(text: str) -> tuple[int, ...]:
    """``1M,16M,1G`` or bytes -> byte counts."""
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = units.get(part[-1:], 1)
        out.append(int(part[:-1] if scale != 1 else part) * scale)
    return tuple(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.allreduce_check", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    d = Plan()
    p.add_argument("--sizes", type=_sizes, default=d.sizes, help="world sweep, e.g. 1M,16M,1G")
    p.add_argument("--pair-bytes", type=_sizes, default=(d.pair_bytes,), help="node/pair size")
    p.add_argument("--iters", type=int, default=d.iters)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per collective")
    p.add_argument("--min-fraction", type=float, default=MIN_FRACTION_OF_MEDIAN)
    p.add_argument(
        "--min-busbw-gbs",
        type=float,
        help=f"absolute floor, GB/s (default: {NCCL_MIN_BUSBW_GBS:g} on NCCL, 0 on gloo)",
    )
    p.add_argument("--slow-node", type=int, default=-1, help="tests/demos: node index to slow")
    p.add_argument("--slow-delay-s", type=float, default=0.0, help="tests/demos: its delay")
    p.add_argument("--slow-phase", default="", help="tests/demos: only in this phase")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    ns = parser().parse_args(argv)
    try:
        plan = Plan(
            sizes=ns.sizes,
            pair_bytes=ns.pair_bytes[0],
            iters=ns.iters,
            warmup=ns.warmup,
            timeout_s=ns.timeout_s,
            slow_node=ns.slow_node,
            slow_delay_s=ns.slow_delay_s,
            slow_phase=ns.slow_phase,
        )
        thresholds = None
        if ns.min_busbw_gbs is not None or ns.min_fraction != MIN_FRACTION_OF_MEDIAN:
            floor = ns.min_busbw_gbs
            if floor is None:
                floor = NCCL_MIN_BUSBW_GBS if torch.cuda.is_available() else 0.0
            thresholds = Thresholds(min_fraction=ns.min_fraction, min_busbw_gbs=floor)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return exits.USAGE
    cuda = torch.cuda.is_available()
    if cuda:
        # A timed-out collective aborts its communicator and raises in this thread (2:
        # CleanUpOnly) instead of tearing the process down, so the report names the group.
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=plan.timeout_s)
    )
    try:
        report = run_check(plan=plan, thresholds=thresholds)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one copy per node's log
            print(table(report), flush=True)
            print(REPORT_PREFIX + json.dumps(report.as_dict()), flush=True)
        return report.verdict.code
    finally:
        _destroy()


if __name__ == "__main__":
    sys.exit(main())
