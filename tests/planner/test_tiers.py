"""Tests of the restore tiers in the planner (planner.tiers, their terms, the ETTR with memory
restores) and of the node-loss measurements it reads (planner.measured.node_loss).

Run: .venv/bin/python -m pytest tests/planner/test_tiers.py -q
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from planner import tiers
from planner.cli import build_parser, inputs_from_args, main
from planner.ettr import Kind, SimKind, draws, ettr_model, simulate, split
from planner.failures import Outcome
from planner.measured import NODE_LOSS_COMMAND, node_loss
from planner.plan import plan

FIXTURES = Path(__file__).parent / "fixtures"
GPU = Outcome(kind="gpu", share=0.6, needs_node=True, hangs=True, strikes_idle=True)
SW = Outcome(kind="software", share=0.2, needs_node=False, hangs=False)
MANUAL = Outcome(kind="manual", share=0.01, needs_node=False, hangs=True, manual=True)


def test_the_planners_restore_sources_are_the_trainers_tiers_in_its_order() -> None:
    """The planner's sources are the trainer's restore tiers (names and order, cheapest first)
    and its names for them are among them; ``reserve`` is the planner's own mode, not one the
    trainer has."""
    from training.checkpoint.tiers import TIERS
    from training.modes import MODES

    assert tiers.SOURCES == TIERS
    names = (tiers.MEMORY, tiers.POD_MEMORY, tiers.PEER, tiers.LOCAL, tiers.STORAGE)
    assert names == TIERS
    assert "reserve" not in MODES


@pytest.mark.parametrize(
    ("mode", "outcome", "nodes", "source"),
    [
        # The product's snapshots live in the pod's /dev/shm (checkpoint.pod_memory_dir's
        # default): every restart that keeps the pod restores them, in-process ones included.
        ("nested", SW, 16, "pod_memory"),
        ("inprocess", SW, 16, "pod_memory"),
        ("reserve", SW, 16, "pod_memory"),
        ("injob", SW, 16, "pod_memory"),  # new workers, same pod
        ("nested", GPU, 16, "peer"),  # a lost node: its shard from the next node
        ("injob", replace(GPU, spare=True), 16, "peer"),
        ("nested", GPU, 1, "storage"),  # no peer on one node
        ("inprocess", GPU, 16, "storage"),  # a whole-job restart: pods and their memory gone
        ("none", SW, 16, "storage"),
        ("nested", MANUAL, 16, "storage"),
        ("reserve", replace(GPU, spare=True), 16, "peer"),  # reserve ranks on the spare
        ("reserve", GPU, 16, "storage"),  # no spare: a whole-job restart
    ],
)
def test_restore_source_per_failure_kind(mode: str, outcome: Outcome, nodes: int, source: str):
    assert tiers.restore_source(mode=mode, outcome=outcome, nodes=nodes, tiers=tiers.ON) == source
    assert tiers.restore_source(mode=mode, outcome=outcome, nodes=nodes, tiers=tiers.OFF) == (
        "storage"
    )
    assert source in tiers.SOURCES


def test_a_second_loss_takes_the_peer_copy_with_either_neighbour() -> None:
    rate = 3.8 * 0.766 / 1000 / 86_400  # one node's hardware failures per second (Llama 3)
    q = tiers.peer_lost_chance(node_rate_per_s=rate, window_s=2000.0)
    assert q == pytest.approx(2 * rate * 2000.0, rel=1e-4)
    assert tiers.peer_lost_chance(node_rate_per_s=rate, window_s=0.0) == 0.0


def test_ettr_with_every_kind_on_storage_is_the_old_form() -> None:
    kw = {"stall_s": 0.5, "write_s": 30.0, "drag": 0.0, "mtbf_s": 3600.0, "outage": 300.0}
    assert ettr_model(interval_s=600.0, **kw) == pytest.approx(
        ettr_model(interval_s=600.0, reset_share=1.0, dilation=1.0, **kw)
    )
    # Nothing restores from storage: only the pauses (dilation) and the stall cost.
    got = ettr_model(interval_s=600.0, **{**kw, "reset_share": 0.0, "dilation": 1.1})
    assert got == pytest.approx(600.0 / (600.5 * 1.1))


def test_closed_form_with_memory_restores_matches_the_monte_carlo() -> None:
    """Memory restores keep the progress (a pause plus the recomputed steps); storage restores
    lose the work since the last commit. The Monte Carlo simulates both failure by failure;
    the closed form must agree within its noise, and differ from the storage-only model."""
    mtbf, tau, stall, write = 1800.0, 600.0, 1.0, 60.0
    kinds = [
        Kind(share=0.3, recovery_s=400.0, strikes_idle=True),
        Kind(share=0.7, recovery_s=120.0, strikes_idle=False, resets=False, recompute_s=25.0),
    ]
    sp = split(mtbf_s=mtbf, kinds=kinds)
    common = {"stall_s": stall, "write_s": write, "drag": 0.0, "mtbf_s": mtbf}
    formula = ettr_model(
        interval_s=tau,
        outage=sp.outage,
        reset_share=sp.reset_share,
        dilation=sp.dilation,
        snapshot_stall_per_s=0.002,
        **common,
    )
    job_s = 30 * 86_400.0
    mc = simulate(
        draws=draws(trials=200, max_failures_mean=job_s / mtbf, seed=1),
        kinds=[
            SimKind(
                share=k.share,
                recovery_s=k.recovery_s,
                spare_recovery_s=k.recovery_s,
                needs_node=False,
                strikes_idle=k.strikes_idle,
                resets=k.resets,
                recompute_s=k.recompute_s,
            )
            for k in kinds
        ],
        spares=0,
        refill_s=0.0,
        interval_s=tau,
        job_s=job_s,
        snapshot_stall_per_s=0.002,
        **common,
    )
    assert abs(mc.mean - formula) < 4 * mc.stderr + 0.003
    storage_only = [replace(k, resets=True, recompute_s=0.0) for k in kinds]
    old = ettr_model(interval_s=tau, outage=split(mtbf_s=mtbf, kinds=storage_only).outage, **common)
    assert formula - old > 0.03 and abs(mc.mean - old) > 4 * mc.stderr + 0.003


@pytest.mark.parametrize("mode", sorted(tiers.ROWS))
@pytest.mark.parametrize("pod_memory_dir", ["/dev/shm/fsdp-snapshots", ""])
@pytest.mark.parametrize("outcome", [SW, GPU, replace(GPU, spare=True)])
def test_the_planner_restores_from_the_tier_the_product_writes(mode, pod_memory_dir, outcome):
    """The planner's source is the product's own decision (training.modes.snapshot_plan, which
    the checkpoint manager takes): they cannot disagree about a tier."""
    from training.modes import snapshot_plan

    checkpoint = replace(tiers.PLANNED, pod_memory_dir=pod_memory_dir)
    config = tiers.TierConfig(checkpoint=checkpoint)
    got = tiers.restore_source(mode=mode, outcome=outcome, nodes=16, tiers=config)
    product = snapshot_plan(checkpoint=checkpoint, restart=tiers.row(mode), nodes=16)
    if tiers.whole_job_restart(mode=mode, outcome=outcome):
        assert got == "storage"
    elif outcome.needs_node:
        assert got == ("peer" if product.copies == 2 else "storage")
    else:
        assert got == (product.tier or "storage")


def test_without_peer_copies_a_lost_node_restores_from_storage() -> None:
    config = tiers.TierConfig(checkpoint=replace(tiers.PLANNED, peer_copy=False))
    assert tiers.restore_source(mode="nested", outcome=GPU, nodes=16, tiers=config) == "storage"


def test_the_planned_settings_are_the_products_defaults_with_snapshots_on() -> None:
    from training.config import CheckpointConfig

    default = CheckpointConfig()
    assert tiers.PLANNED.pod_memory_dir == default.pod_memory_dir != ""
    assert tiers.PLANNED.memory_interval > 0 and tiers.PLANNED.peer_copy


def _inputs(*argv: str):
    return inputs_from_args(build_parser().parse_args(["--no-plot", *argv]))


def test_tiers_never_lose_against_storage_only_and_name_their_sources() -> None:
    r = plan(inputs=_inputs("--gpus", "16384", "--failure-rate", "llama3"), simulate=False)[0]
    rate = r.rates[0]
    for mode in ("injob", "inprocess", "nested"):
        m = rate.modes[mode]
        assert m.ettr >= m.tiers_off_ettr - 1e-12, mode
    nested = rate.modes["nested"]
    assert nested.ettr > nested.tiers_off_ettr + 0.003  # a lost node restores from a peer
    assert nested.memory_interval_steps >= 1
    sources = {rec.outcome.kind: rec.source for rec in nested.recoveries}
    assert sources["software"] == "pod_memory" and sources["gpu+spare"] == "peer"
    assert sources["manual"] == "storage"
    injob = {rec.outcome.kind: rec.source for rec in rate.modes["injob"].recoveries}
    assert injob["software"] == "pod_memory"
    off = plan(
        inputs=_inputs("--gpus", "16384", "--failure-rate", "llama3", "--tiers", "off"),
        simulate=False,
    )[0].rates[0]
    assert off.modes["nested"].ettr == pytest.approx(nested.tiers_off_ettr, abs=1e-12)
    assert {rec.source for rec in off.modes["nested"].recoveries} == {"storage"}


def test_node_loss_fixture_is_read_and_a_missing_file_is_none(tmp_path: Path) -> None:
    assert node_loss(bench_dir=tmp_path) is None
    got = node_loss(bench_dir=FIXTURES)
    assert got is not None and got.timer_scale == 30
    assert set(got.cases) == {"injob/spare", "injob/no-spare", "nested/spare", "nested/no-spare"}
    assert got.cases["injob/spare"].restart_p50_s == 14.7
    data = json.loads((FIXTURES / "node_loss.json").read_text())
    del data["cases"]["nested/spare"]["phases_p50_s"]["pod_failed"]
    (tmp_path / "node_loss.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"nested/spare.*'pod_failed'.*bench.node_loss"):
        node_loss(bench_dir=tmp_path)


def test_answer_shows_tiers_overlays_and_the_emulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--gpus", "16384", "--failure-rate", "llama3", "--trials", "5", "--no-plot"]
    assert main([*argv, "--bench-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "(--tiers off)" in text and "--checkpoint.memory_interval=" in text
    assert "restores: pod_memory" in text and "peer" in text
    overlays = text.split("Overlays (manifests/sizes.py)")[1]
    for name in ("smoke", "2node", "16node"):
        assert f"  {name} " in overlays
    assert f"no bench/results/node_loss.json (run `{NODE_LOSS_COMMAND}`)" in overlays
    shutil.copy(FIXTURES / "node_loss.json", tmp_path / "node_loss.json")
    assert main([*argv, "--bench-dir", str(tmp_path)]) == 0
    overlays = capsys.readouterr().out.split("Overlays (manifests/sizes.py)")[1]
    assert "Node-loss EMULATION" in overlays and "x30: 231" in overlays
    line = next(x for x in overlays.splitlines() if x.startswith("  16node: restart"))
    assert "emulation 15.7 s" in line and "restore from peer" in line
