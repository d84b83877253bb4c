"""All-reduce preflight (training/allreduce_check.py): formula, schedule, judgement, real runs.

Run: ``.venv/bin/pytest tests/training/test_allreduce_check.py -q``. The distributed tests start
4 CPU ranks (gloo) as 2 "nodes" of 2 (LOCAL_WORLD_SIZE=2, GROUP_RANK = rank // 2), the way
torchrun numbers them on 2 pods, and run the module itself; a per-node delay makes one node slow.
NCCL over EFA (the point of the check) needs p5 nodes: see docs/eks.md's "Preflight".
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest
from support import REPO_ROOT, subprocess_env

from training import allreduce_check as ac
from training import exits

SMALL = ("--sizes=64K,256K", "--pair-bytes=256K", "--iters=3", "--warmup=1", "--timeout-s=60")


def test_bus_bandwidth_matches_nccl_tests_formula() -> None:
    # 1 GB in 10 ms over 16 ranks: algbw 100 GB/s; busbw = 100 * 2 * 15 / 16 = 187.5 GB/s.
    algbw, busbw = ac.bus_bandwidth(nbytes=10**9, seconds=0.01, ranks=16)
    assert algbw == pytest.approx(100.0)
    assert busbw == pytest.approx(187.5)
    assert ac.bus_bandwidth(nbytes=10**9, seconds=0.01, ranks=1) == (pytest.approx(100.0), 0.0)


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 16])
def test_round_robin_covers_every_pair_once_in_disjoint_rounds(nodes: int) -> None:
    rounds = ac.round_robin(nodes)
    assert len(rounds) == (nodes - 1 if nodes % 2 == 0 else nodes)
    seen = [pair for r in rounds for pair in r]
    assert sorted(seen) == list(combinations(range(nodes), 2))
    for r in rounds:
        members = [n for pair in r for n in pair]
        assert len(members) == len(set(members)), r  # a node is in one pair per round


def _m(phase: str, nodes: tuple[int, ...], busbw: float, ranks: int = 16) -> ac.Measurement:
    nbytes = 1 << 28
    # seconds that give exactly `busbw` GB/s for this group size
    seconds = nbytes / 1e9 * 2 * (ranks - 1) / ranks / busbw
    return ac.Measurement(phase=phase, nodes=nodes, ranks=ranks, nbytes=nbytes, seconds=seconds)


NAMES4 = ("pod-0", "pod-1", "pod-2", "pod-3")


def test_judge_names_the_node_whose_every_pair_is_slow() -> None:
    pairs = [
        _m("pair", (a, b), 100.0 if 2 in (a, b) else 300.0) for a, b in combinations(range(4), 2)
    ]
    nodes = [_m("node", (i,), 450.0, ranks=8) for i in range(4)]
    v = ac.judge(measurements=pairs + nodes, names=NAMES4, thresholds=ac.Thresholds())
    assert not v.ok and v.code == exits.ENVIRONMENT
    assert v.slow_nodes == (2,)
    assert v.slow_pairs == ((0, 2), (1, 2), (2, 3))
    assert any("pair pod-0 + pod-2: busbw 100.00 GB/s" in p for p in v.problems)


def test_judge_one_slow_link_names_the_pair_not_a_node() -> None:
    pairs = [
        _m("pair", (a, b), 150.0 if (a, b) == (0, 1) else 300.0)
        for a, b in combinations(range(4), 2)
    ]
    v = ac.judge(measurements=pairs, names=NAMES4, thresholds=ac.Thresholds())
    assert v.code == exits.ENVIRONMENT and v.slow_pairs == ((0, 1),) and v.slow_nodes == ()


def test_judge_floor_fails_a_uniformly_slow_fabric_and_passes_a_healthy_one() -> None:
    # Two nodes: one pair, so only the absolute floor can fail it (EFA missing: TCP sockets).
    names = ("pod-0", "pod-1")
    slow = [_m("pair", (0, 1), 12.0)]
    v = ac.judge(measurements=slow, names=names, thresholds=ac.Thresholds(min_busbw_gbs=100))
    assert v.code == exits.ENVIRONMENT and v.slow_pairs == ((0, 1),)
    healthy = [_m("pair", (0, 1), 350.0), _m("world", (0, 1), 340.0)]
    v = ac.judge(measurements=healthy, names=names, thresholds=ac.Thresholds(min_busbw_gbs=100))
    assert v.ok and v.code == exits.OK and v.problems == ()


def test_judge_world_sweep_judges_only_the_largest_size() -> None:
    small = ac.Measurement(phase="world", nodes=(0, 1), ranks=16, nbytes=1 << 20, seconds=1.0)
    v = ac.judge(
        measurements=[small, _m("world", (0, 1), 300.0)],
        names=("a", "b"),
        thresholds=ac.Thresholds(min_busbw_gbs=100),
    )
    assert v.ok, v.problems


def test_judge_an_error_is_a_broken_group_and_a_retryable_failure() -> None:
    broken = ac.Measurement(
        phase="pair", nodes=(0, 1), ranks=16, nbytes=1 << 28, error="DistBackendError: timeout"
    )
    v = ac.judge(measurements=[broken], names=("a", "b"), thresholds=ac.Thresholds())
    assert v.code == exits.FAILED and v.broken == ("pair a + b: DistBackendError: timeout",)


def test_judge_skips_one_rank_groups() -> None:
    # A 1-GPU world moves no data: busbw is 0 by the formula, which is no failure.
    one = ac.Measurement(phase="world", nodes=(0,), ranks=1, nbytes=1 << 20, seconds=1e-5)
    v = ac.judge(measurements=[one], names=("a",), thresholds=ac.Thresholds(min_busbw_gbs=100))
    assert v.ok


def test_nccl_floor_is_a_quarter_of_p5_line_rate() -> None:
    assert ac.P5_NETWORK_GBS == 400.0  # 3,200 Gbps
    assert ac.NCCL_MIN_BUSBW_GBS == 100.0


def test_bad_plan_is_a_usage_error() -> None:
    assert ac.main(["--iters=0"]) == exits.USAGE


# --- real runs: 4 gloo ranks as 2 nodes -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_nodes(*args: str, timeout: float = 120) -> tuple[list[int], list[str]]:
    """Start ranks 0-3 (nodes 0 and 1) of `python -m training.allreduce_check ARGS`."""
    port = _free_port()
    procs = []
    for rank in range(4):
        env = subprocess_env(
            RANK=str(rank),
            WORLD_SIZE="4",
            LOCAL_RANK=str(rank % 2),
            LOCAL_WORLD_SIZE="2",
            GROUP_RANK=str(rank // 2),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "training.allreduce_check", *args],
                cwd=REPO_ROOT,
                env={**env, "CUDA_VISIBLE_DEVICES": ""},  # gloo even where a GPU is present
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    codes, outputs = [], []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            codes.append(proc.returncode)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes, outputs


def _report(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith(ac.REPORT_PREFIX)]
    assert len(lines) == 1, output[-3000:]
    return json.loads(lines[0][len(ac.REPORT_PREFIX) :])


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_two_nodes_pass_and_report_every_phase() -> None:
    # Two CPU cores shared by four ranks: timings are noisy, so no relative threshold here.
    codes, outputs = _run_two_nodes(*SMALL, "--min-fraction=0")
    assert codes == [exits.OK] * 4, outputs
    # Each node's local rank 0 prints the same report; the other ranks print none.
    assert not any(ac.REPORT_PREFIX in outputs[r] for r in (1, 3))
    report = _report(outputs[0])
    assert report == {**_report(outputs[2]), "elapsed_s": report["elapsed_s"]}
    assert report["ok"] is True and report["exit_code"] == exits.OK
    assert report["backend"] == "gloo" and report["world_size"] == 4
    host = socket.gethostname()
    assert report["nodes"] == [f"{host}/node0", f"{host}/node1"]
    assert report["thresholds"] == {"min_fraction": 0.0, "min_busbw_gbs": 0.0}  # gloo: no floor
    groups = [
        (m["phase"], tuple(m["nodes"]), m["ranks"], m["nbytes"]) for m in report["measurements"]
    ]
    assert groups == [
        ("world", (0, 1), 4, 64 << 10),
        ("world", (0, 1), 4, 256 << 10),
        ("node", (0,), 2, 256 << 10),
        ("node", (1,), 2, 256 << 10),
        ("pair", (0, 1), 4, 256 << 10),
    ]
    for m in report["measurements"]:
        assert m["error"] == "" and m["seconds"] > 0
        n = m["ranks"]
        algbw = m["nbytes"] / m["seconds"] / 1e9
        assert m["algbw_gbs"] == pytest.approx(algbw, abs=1e-3)
        assert m["busbw_gbs"] == pytest.approx(algbw * 2 * (n - 1) / n, abs=1e-3)
    assert "PASS: no slow or broken node" in outputs[0]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_slow_node_fails_the_check_and_is_named() -> None:
    # Node 1's ranks sleep 50 ms before every all-reduce: its own group is ~20x slower than
    # node 0's, far below 80% of the median.
    codes, outputs = _run_two_nodes(*SMALL, "--slow-node=1", "--slow-delay-s=0.05")
    assert codes == [exits.ENVIRONMENT] * 4, outputs
    report = _report(outputs[0])
    host = socket.gethostname()
    assert report["ok"] is False and report["exit_code"] == exits.ENVIRONMENT
    assert report["slow_nodes"] == [f"{host}/node1"]
    assert any(p.startswith(f"node {host}/node1: busbw") for p in report["problems"])
    assert f"slow node(s): {host}/node1" in outputs[0]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_broken_node_fails_the_check_naming_the_group_that_timed_out() -> None:
    # Node 1 stalls 6 s in the pair phase, past the 3 s collective timeout: the pair's
    # all-reduce times out on both nodes, the results still travel over their own group.
    slow = ("--slow-node=1", "--slow-delay-s=6", "--slow-phase=pair", "--min-fraction=0")
    codes, outputs = _run_two_nodes(*SMALL[:4], "--timeout-s=3", *slow)
    assert codes == [exits.FAILED] * 4, outputs
    report = _report(outputs[0])
    host = socket.gethostname()
    (broken,) = report["broken"]
    assert broken.startswith(f"pair {host}/node0 + {host}/node1: RuntimeError: Timed out")
    pair = [m for m in report["measurements"] if m["phase"] == "pair"]
    assert pair[0]["error"] and report["exit_code"] == exits.FAILED
    assert all(not m["error"] for m in report["measurements"] if m["phase"] != "pair")


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_absolute_floor_fails_the_pair_of_two_nodes() -> None:
    codes, outputs = _run_two_nodes(*SMALL, "--min-busbw-gbs=1000")
    assert codes == [exits.ENVIRONMENT] * 4, outputs
    report = _report(outputs[0])
    host = socket.gethostname()
    assert report["thresholds"]["min_busbw_gbs"] == 1000
    assert report["slow_pairs"] == [[f"{host}/node0", f"{host}/node1"]]


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_nccl_on_this_machines_gpus() -> None:
    """NCCL, one node, every local GPU: the CUDA path (device timing, NCCL groups, the floor)."""
    import torch

    gpus = torch.cuda.device_count()
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            f"--nproc-per-node={gpus}",
            "-m",
            "training.allreduce_check",
            "--sizes=1M,64M",
            "--pair-bytes=64M",
            "--timeout-s=120",
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=280,
    )
    report = _report(proc.stdout)
    assert report["backend"] == "nccl" and report["world_size"] == gpus
    assert report["thresholds"]["min_busbw_gbs"] == ac.NCCL_MIN_BUSBW_GBS
    # The floor is p5's: a smaller machine's GPUs may fall below it, but nothing may break.
    assert report["broken"] == [], proc.stdout[-4000:]
    assert proc.returncode == report["exit_code"], proc.stdout[-4000:]
