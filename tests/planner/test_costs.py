"""Tests of planner.costs and planner.measured: each term and each recovery path by hand.

Run: .venv/bin/python -m pytest tests/planner/test_costs.py -q
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from infra.fencer.settings import FENCER
from planner.costs import (
    DEFAULTS,
    MODES,
    REPLICA_QUORUM_S,
    REPLICA_REJOIN_S,
    Job,
    checkpoint_stall_s,
    cluster_model,
    low_startup,
    recovery,
    recovery_s,
    replica_loss_s,
    replica_recovery,
    scaled_estimates,
    terms,
)
from planner.failures import Outcome
from planner.measured import measured_cpu_model, replica_rejoin_s
from planner.sources import SOURCES
from training.config import ResilienceConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
HW = Outcome(kind="hardware", share=0.766, needs_node=True, hangs=True)
SPARE = Outcome(kind="hardware+spare", share=0.1, needs_node=True, hangs=True, spare=True)
SW = Outcome(kind="software", share=0.134, needs_node=False, hangs=False)
NET = Outcome(kind="network", share=0.1, needs_node=False, hangs=True)


def _job(gpus: int, fsx_gbps: float = 10.0) -> Job:
    return Job(
        gpus=gpus,
        gpus_per_node=8,
        ckpt_bytes=840e9,
        step_time_s=10.0,
        fsx_bytes_per_s=fsx_gbps * 1e9,
    )


def test_every_default_cites_a_known_source() -> None:
    for name, p in DEFAULTS.items():
        assert p.source in SOURCES, name
        assert p.help, name
        assert p.estimate or p.source != "estimate", name


@pytest.mark.parametrize("gpus", [16_384, 100_000])
def test_terms_by_hand(gpus: int) -> None:
    t = {k: v.seconds for k, v in terms(model=cluster_model(), job=_job(gpus)).items()}
    nodes = -(-gpus // 8)
    assert t["rendezvous_s"] == pytest.approx(100.0 * gpus / 98_304)
    assert t["nccl_init_s"] == pytest.approx(265.0 * gpus / 98_304)
    assert t["inprocess_barrier_s"] == pytest.approx(0.5 * gpus / 16_384)
    assert t["inprocess_abort_s"] == pytest.approx(0.5 + 0.5 + 10.0)  # + one 10 s step
    assert t["ckpt_load_s"] == pytest.approx(84.0)  # 840 GB at 10 GB/s
    assert t["ckpt_write_s"] == pytest.approx(84.0)
    assert t["pod_replace_all_s"] == pytest.approx(5.0 + nodes / 100.0)
    assert t["node_replace_s"] == pytest.approx(600 + 300 + 300 + 5)
    assert t["spare_swap_s"] == pytest.approx(5.0)
    assert t["ckpt_stall_s"] == pytest.approx(0.5 + 840e9 / gpus / 32e9)
    assert checkpoint_stall_s(model=cluster_model(), job=_job(gpus)) == t["ckpt_stall_s"]


def test_recovery_paths_by_hand_at_16k() -> None:
    model, job = cluster_model(), _job(16_384)
    rdzv, nccl, load = 100 / 6, 265 / 6, 84.0
    node = 1205.0
    pods = 5 + 2048 / 100
    expected = {
        ("none", SW): 10 + 30 + pods + 30 + rdzv + nccl + load,
        ("none", NET): 600 + 30 + pods + 30 + rdzv + nccl + load,
        ("none", HW): 600 + 30 + node + 30 + rdzv + nccl + load,  # new node slower than pods
        ("none", SPARE): 600 + 30 + pods + 30 + rdzv + nccl + load,
        ("injob", SW): 1 + 5 + 30 + rdzv + nccl + load,
        ("injob", NET): 30 + 5 + 30 + rdzv + nccl + load,
        ("injob", HW): 30 + 5 + node + 30 + rdzv + nccl + load,
        ("injob", SPARE): 30 + 5 + 5 + 30 + rdzv + nccl + load,
        # The project's Wrapper settings (training/resilience/nvrx.py): last_call_wait 0.1 s;
        # soft timeout 20 s + monitor_process_interval 0.5 s; heartbeat max(10, 20) s.
        ("inprocess", SW): 0.1 + 11 + 0.5 + nccl + load,
        ("inprocess", NET): 20.5 + 11 + 0.5 + nccl + load,
        ("inprocess", HW): 20 + 30 + node + 30 + rdzv + nccl + load,  # falls back to a job restart
        ("nested", SW): 0.1 + 11 + 0.5 + nccl + load,
        # The in-job path, after the in-process heartbeat (20 s) noticed the lost node.
        ("nested", HW): 20 + 5 + node + 30 + rdzv + nccl + load,
        ("nested", SPARE): 20 + 5 + 5 + 30 + rdzv + nccl + load,
    }
    for (mode, outcome), seconds in expected.items():
        got = recovery_s(model=model, job=job, mode=mode, outcome=outcome)
        assert got == pytest.approx(seconds), (mode, outcome.kind)
    names = [t.name for t in recovery(model=model, job=job, mode="nested", outcome=HW)]
    # The in-process layer notices the lost node first (its heartbeat), then in-job recovers.
    assert names[0] == "detect_lost_rank_inprocess_s" and "node_replace_s" in names


def test_nested_is_never_worse_than_either_layer() -> None:
    model = cluster_model()
    for gpus in (1024, 16_384, 100_000):
        job = _job(gpus)
        for o in (HW, SPARE, SW, NET):
            r = {m: recovery_s(model=model, job=job, mode=m, outcome=o) for m in MODES}
            assert r["nested"] <= min(r["injob"], r["inprocess"]) + 1e-9
            assert r["nested"] <= r["none"]


def test_overrides_and_unknown_names() -> None:
    model = cluster_model(overrides={"image_pull_s": 30.0, "node_repair_wait_s": 60.0})
    assert model.sources["image_pull_s"] == "override"
    t = terms(model=model, job=_job(16_384))
    assert t["node_replace_s"].seconds == pytest.approx(60 + 300 + 30 + 5)
    with pytest.raises(ValueError, match="unknown cost parameter"):
        cluster_model(overrides={"warp_drive_s": 1.0})
    with pytest.raises(ValueError, match="unknown mode"):
        recovery(model=cluster_model(), job=_job(8), mode="warm", outcome=SW)


def test_measured_cpu_model_reads_bench_results(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="make bench"):
        measured_cpu_model(bench_dir=tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps({"nvrx_async_blocking_s": 0.41}))
    (tmp_path / "restart.json").write_text(
        json.dumps({"inprocess_p50_s": 6.9, "injob_p50_s": 16.3, "cold_p50_s": 14.1})
    )
    model = measured_cpu_model(bench_dir=tmp_path)
    assert model.name == "measured-cpu"
    job = _job(100_000)
    assert checkpoint_stall_s(model=model, job=job) == 0.41
    r = {
        (m, o.kind): recovery_s(model=model, job=job, mode=m, outcome=o)
        for m in MODES
        for o in (HW, SW)
    }
    assert r[("none", "software")] == 14.1 and r[("injob", "hardware")] == 16.3
    assert r[("inprocess", "software")] == 6.9 and r[("inprocess", "hardware")] == 14.1
    assert r[("nested", "software")] == 6.9 and r[("nested", "hardware")] == 16.3
    (tmp_path / "restart.json").write_text(json.dumps({"inprocess_p50_s": -1}))
    with pytest.raises(ValueError, match="inprocess_p50_s"):
        measured_cpu_model(bench_dir=tmp_path)


def test_host_manual_and_not_shipped_paths_by_hand_at_16k() -> None:
    model, job = cluster_model(), _job(16_384)
    rdzv, nccl, load = 100 / 6, 265 / 6, 84.0
    host = Outcome(kind="host", share=0.1, needs_node=True, hangs=True, host=True)
    manual = Outcome(kind="manual", share=0.01, needs_node=False, hangs=True, manual=True)
    # Ready turns Unknown after 50 s; the fencer waits 30 s (FENCER.wait_s) and up to one pass
    # (FENCER.poll_s), EC2 terminates the instance (FENCER.terminate_s, an estimate); a new one
    # boots and pulls the image.
    host_node = 50 + FENCER.wait_s + FENCER.poll_s + FENCER.terminate_s + 300 + 300 + 5
    assert recovery_s(model=model, job=job, mode="injob", outcome=host) == pytest.approx(
        30 + 5 + host_node + 30 + rdzv + nccl + load
    )
    # A spare does not shorten the wait for a silent node's pod: the Job replaces it only once
    # PodGC has failed it, at its next loop after the fencer's out-of-service taint
    # (docs/node-loss.md, "The fencer").
    host_spare = replace(host, spare=True)
    pod_failed = 50 + FENCER.wait_s + FENCER.poll_s + FENCER.terminate_s + 20
    assert recovery_s(model=model, job=job, mode="injob", outcome=host_spare) == pytest.approx(
        30 + 5 + pod_failed + 5 + 30 + rdzv + nccl + load
    )
    # ... nor does a whole-job restart (the stuck pod holds its completion index).
    pods = 5 + 2048 / 100
    assert recovery_s(model=model, job=job, mode="none", outcome=host_spare) == pytest.approx(
        600 + 30 + pod_failed + 5 + 30 + rdzv + nccl + load
    )
    assert recovery_s(model=model, job=job, mode="nested", outcome=manual) == pytest.approx(
        7200 + 20.5 + 30 + pods + 30 + rdzv + nccl + load
    )
    # Reserve ranks (not shipped): a lost node with a free spare recovers in place.
    assert recovery_s(model=model, job=job, mode="reserve", outcome=SPARE) == pytest.approx(
        20 + 11 + 0.5 + nccl + load
    )
    assert recovery_s(model=model, job=job, mode="reserve", outcome=HW) == recovery_s(
        model=model, job=job, mode="inprocess", outcome=HW
    )


def test_replica_groups_by_hand_at_16k() -> None:
    """--restart replica: the failed group's own in-job restart at its size (512 GPUs), its
    state healed from a peer group over EFA (no rollback), the measured rejoin and the step
    redone; waiting semantics charge all of it to the job, shrinking only the group's share
    (after a quorum and the redone step)."""
    model, job, group = cluster_model(), _job(16_384), _job(512)
    restart = recovery(model=model, job=group, mode="injob", outcome=HW, source="peer")
    heal = terms(model=model, job=group)["restore_peer_s"].seconds
    # 64 nodes: each receives its 840 GB / 64 shard from its counterpart in a live group.
    assert heal == pytest.approx(
        840e9 / 64 / (DEFAULTS["efa_gbps"].value * 1e9)
        + 840e9 / 512 / (DEFAULTS["d2h_gbps"].value * 1e9)
    )
    assert [t.name for t in restart][-1] == "restore_peer_s"
    # The group's own start-up: rendezvous and NCCL at 512 ranks, not 16,384.
    assert {t.name: t.seconds for t in restart}["nccl_init_s"] == pytest.approx(265 * 512 / 98_304)
    wait = replica_recovery(model=model, job=job, outcome=HW)
    names = [t.name for t in wait]
    assert "restore_peer_s" not in names and "ckpt_load_s" not in names
    assert names[-3:] == ["replica_heal_s", "replica_rejoin_s", "replica_redo_step_s"]
    waited = sum(t.seconds for t in restart) + REPLICA_REJOIN_S + 10.0
    assert replica_loss_s(model=model, job=job, outcome=HW) == pytest.approx(waited)
    # Shrinking: a hung GPU blocks the survivors' all-reduce until the group's own detection
    # kills its processes (or torchft's timeout, whichever first), then the quorum (measured)
    # and the redone step; the group's share of the rest.
    detect = restart[0].seconds
    timeout = ResilienceConfig().replica_timeout_s
    assert replica_loss_s(model=model, job=job, outcome=HW, semantics="shrink") == pytest.approx(
        min(detect, timeout) + REPLICA_QUORUM_S + 10 + (waited - 10) * 512 / 16_384
    )
    # A crash is seen at once; a silent node's processes cannot be killed: only the timeout.
    crash = replace(HW, hangs=False)
    silent = replace(HW, host=True)
    for outcome, blocked in ((crash, 0.0), (silent, timeout)):
        own = sum(t.seconds for t in replica_recovery(model=model, job=group, outcome=outcome))
        shrunk = replica_loss_s(model=model, job=job, outcome=outcome, semantics="shrink")
        assert shrunk == pytest.approx(
            blocked + REPLICA_QUORUM_S + 10 + (own - 10) * 512 / 16_384, rel=1e-6
        ), outcome
    # Far below a global restart's loss at this size (no NCCL start-up at 16k ranks).
    assert waited < recovery_s(model=model, job=job, mode="nested", outcome=HW) - 40
    with pytest.raises(ValueError, match="wait, shrink"):
        replica_loss_s(model=model, job=job, outcome=HW, semantics="drop")


def test_replica_rejoin_is_what_the_recorded_fault_run_measured() -> None:
    """The rejoin term's default: the failed group's restored workers (``checkpoint_loaded``)
    to the survivors' quorum with it back, in the fault test's recorded run."""
    run = REPO_ROOT / "tests" / "training" / "replica" / "recorded" / "sigkill-group1"
    assert replica_rejoin_s(recorded=run) == pytest.approx(REPLICA_REJOIN_S, abs=0.05)
    assert DEFAULTS["replica_rejoin_s"].value == REPLICA_REJOIN_S
    assert DEFAULTS["replica_rejoin_s"].source == "replica-emulation"


def test_low_startup_swaps_in_the_low_ends() -> None:
    low = low_startup(cluster_model())
    t = terms(model=low, job=_job(98_304))
    assert t["nccl_init_s"].seconds == pytest.approx(26.5)
    assert t["rendezvous_s"].seconds == pytest.approx(10.0)
    assert low.sources["nccl_init_s_at_96k"] == "estimate"


def test_scaled_estimates_touch_only_estimates_that_were_not_overridden() -> None:
    model = cluster_model(overrides={"worker_start_s": 12.0})
    doubled = scaled_estimates(model, 2.0)
    assert doubled.params["node_boot_s"] == 600.0  # an estimate
    assert doubled.params["worker_start_s"] == 12.0  # the user's value stays
    assert doubled.params["nccl_init_s_at_96k"] == 265.0  # published
    assert doubled.params["write_drag"] == model.params["write_drag"]  # a fraction


def test_restore_terms_by_hand_at_16_nodes() -> None:
    """Each restore source reads what it holds at its bandwidth: process memory over PCIe (32
    GB/s per GPU, half of PCIe 5.0 x16); pod memory the same after a copy out of /dev/shm at
    the GPU's share of host memory bandwidth (409.6 GB/s per node / 8 GPUs, read and write:
    25.6 GB/s); a peer's memory over one node's EFA (400 GB/s); FSx at its aggregate
    throughput shared by every reading node."""
    job = _job(128, fsx_gbps=10.0)
    model = cluster_model()
    t = {k: v.seconds for k, v in terms(model=model, job=job).items()}
    shard_gpu, shard_node = 840e9 / 128, 840e9 / 16
    assert t["restore_memory_s"] == pytest.approx(shard_gpu / 32e9)
    assert t["restore_pod_memory_s"] == pytest.approx(shard_gpu / 25.6e9 + shard_gpu / 32e9)
    assert t["restore_peer_s"] == pytest.approx(shard_node / 400e9 + shard_gpu / 32e9)
    assert t["ckpt_load_s"] == pytest.approx(84.0)
    # A snapshot blocks its fixed part and the peer copy; the device-to-host copy (0.2 s)
    # hides behind a 10 s step.
    assert t["memory_snapshot_stall_s"] == pytest.approx(0.1 + shard_node / 400e9)
    nested_sw = {
        src: recovery_s(model=model, job=job, mode="nested", outcome=SW, source=src)
        for src in ("memory", "storage")
    }
    assert nested_sw["storage"] - nested_sw["memory"] == pytest.approx(84.0 - shard_gpu / 32e9)
    # A whole-job restart reads storage whatever the source asked for.
    assert recovery_s(model=model, job=job, mode="none", outcome=SW, source="pod_memory") == (
        recovery_s(model=model, job=job, mode="none", outcome=SW)
    )
    with pytest.raises(ValueError, match="no restore from 'local'"):
        recovery(model=model, job=job, mode="injob", outcome=SW, source="local")
