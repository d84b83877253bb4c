"""Tests of the goodput planner (training/planner.py): formulas, Monte Carlo, FSx sizing, CLI.

Run: .venv/bin/python -m pytest tests/training/test_planner.py -q
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path

import pytest

from training.planner import (
    BUILTIN_CKPT_STALL_S,
    BUILTIN_RESTART_S,
    PlannerInputs,
    bench_defaults,
    daly_interval_s,
    ettr_first_order,
    ettr_formula,
    format_params,
    fsx_capacity_tib,
    fsx_need,
    job_mtbf_s,
    main,
    plan,
    simulate_ettr,
    unit_arrivals,
    young_interval_s,
)

DAY = 86_400.0


def _inputs(**over) -> PlannerInputs:
    base = {
        "params": 70e9,
        "bytes_per_param": 16.0,
        "gpus": (1024, 16384, 100000),
        "gpus_per_node": 8,
        "step_time_s": 10.0,
        "ckpt_stall_s": 3.0,
        "restart_s": {"inprocess": 30.0, "injob": 120.0, "cold": 600.0},
        "failure_rates": {"llama3": 3.8, "rsc1": 6.5, "rsc2": 2.34},
        "target_stall_s": 30.0,
        "days": 7.0,
        "trials": 300,
        "seed": 1,
        "sources": {"ckpt_stall_s": "test"},
    }
    return PlannerInputs(**{**base, **over})


def test_job_mtbf_from_failures_per_node_day() -> None:
    # 16,384 GPUs = 2,048 nodes; 3.8 failures per 1,000 node-days -> 7.7824 failures a day.
    assert job_mtbf_s(
        failures_per_1000_node_days=3.8, gpus=16384, gpus_per_node=8
    ) == pytest.approx(DAY / 7.7824)
    # A partial node fails like a whole one.
    assert job_mtbf_s(failures_per_1000_node_days=1.0, gpus=9, gpus_per_node=8) == pytest.approx(
        DAY * 500
    )


def test_young_and_daly_intervals() -> None:
    assert young_interval_s(stall_s=2.0, mtbf_s=10_000.0) == pytest.approx(200.0)
    # Daly: 200 * (1 + sqrt(1e-4)/3 + 1e-4/9) - 2
    assert daly_interval_s(stall_s=2.0, mtbf_s=10_000.0) == pytest.approx(
        200.0 * (1 + 0.01 / 3 + 1e-4 / 9) - 2.0
    )
    assert daly_interval_s(stall_s=300.0, mtbf_s=100.0) == 100.0  # stall >= 2M: tau = M


def test_formulas_agree_when_failures_are_rare_and_diverge_when_not() -> None:
    kw = {"interval_s": 200.0, "stall_s": 2.0, "restart_s": 60.0}
    rare1 = ettr_first_order(mtbf_s=1e6, **kw)
    rare = ettr_formula(mtbf_s=1e6, **kw)
    assert rare == pytest.approx(rare1, abs=1e-4)
    assert rare == pytest.approx(200 / 202 * (1 - (60 + 101) / 1e6), abs=1e-6)
    # Exact value of Daly's form at M = 2,000 s.
    assert ettr_formula(mtbf_s=2000.0, **kw) == pytest.approx(
        200.0 / (2000.0 * math.exp(0.03) * math.expm1(0.101))
    )
    assert ettr_first_order(mtbf_s=100.0, **kw) == 0.0  # floored, never negative


@pytest.mark.parametrize("gpus", [4096, 16384])
def test_monte_carlo_agrees_with_formula_at_moderate_failure_rates(gpus: int) -> None:
    mtbf = job_mtbf_s(failures_per_1000_node_days=3.8, gpus=gpus, gpus_per_node=8)
    tau = daly_interval_s(stall_s=3.0, mtbf_s=mtbf)
    units = unit_arrivals(trials=2000, max_failures_mean=7 * DAY / mtbf, seed=7)
    for restart in (30.0, 600.0):
        kw = {"interval_s": tau, "stall_s": 3.0, "restart_s": restart, "mtbf_s": mtbf}
        mc = simulate_ettr(unit_arrivals=units, job_s=7 * DAY, **kw)
        assert mc.mean == pytest.approx(ettr_formula(**kw), abs=0.003)
        assert mc.p5 < mc.mean < mc.p95
        assert mc.failures_mean == pytest.approx(7 * DAY / mtbf, rel=0.05)


def test_monte_carlo_without_failures_is_checkpoint_overhead_only() -> None:
    units = unit_arrivals(trials=4, max_failures_mean=1.0, seed=0) + 1e9  # no failure in the job
    mc = simulate_ettr(
        unit_arrivals=units, mtbf_s=1.0, interval_s=97.0, stall_s=3.0, restart_s=50.0, job_s=1000.0
    )
    # 10 cycles of 97 s compute + 3 s stall in 1,000 s.
    assert mc.mean == pytest.approx(0.97)
    assert mc.failures_mean == 0


def test_monte_carlo_is_seedable() -> None:
    a = plan(inputs=_inputs(gpus=(16384,), trials=50, seed=3))
    b = plan(inputs=_inputs(gpus=(16384,), trials=50, seed=3))
    c = plan(inputs=_inputs(gpus=(16384,), trials=50, seed=4))
    assert [r.mc for r in a] == [r.mc for r in b]
    assert [r.mc for r in a] != [r.mc for r in c]


def test_plan_trends_and_speed() -> None:
    import time

    start = time.perf_counter()
    rows = plan(inputs=_inputs(gpus=(1024, 4096, 16384, 65536, 100000)))
    assert time.perf_counter() - start < 10.0  # ~0.5 s here
    assert len(rows) == 5 * 3 * 3
    by = {(r.gpus, r.rate_name, r.mode): r for r in rows}
    sizes = (1024, 4096, 16384, 65536, 100000)
    for rate in ("llama3", "rsc1", "rsc2"):
        for mode in ("inprocess", "injob", "cold"):
            # ETTR falls as the cluster grows, by formula and by simulation.
            for small, big in itertools.pairwise(sizes):
                assert by[(big, rate, mode)].ettr_formula < by[(small, rate, mode)].ettr_formula
                assert by[(big, rate, mode)].mc.mean < by[(small, rate, mode)].mc.mean
        for g in sizes:
            # ETTR rises as the restart gets cheaper.
            ettrs = [by[(g, rate, m)].mc.mean for m in ("cold", "injob", "inprocess")]
            assert ettrs == sorted(ettrs) and ettrs[0] < ettrs[-1]
    # Higher failure rate, lower ETTR.
    assert by[(100000, "rsc1", "cold")].mc.mean < by[(100000, "llama3", "cold")].mc.mean
    assert by[(100000, "llama3", "cold")].mc.mean < by[(100000, "rsc2", "cold")].mc.mean
    # The interval is a whole number of steps.
    assert all(r.interval_s == r.interval_steps * 10.0 for r in rows)


def test_fsx_sizing() -> None:
    # 70B x 16 B = 1.12 TB in 30 s -> 37.33 GB/s = 37,333 MB/s; at 250 MB/s/TiB -> 149.3 TiB,
    # rounded up to 1.2 + 62 x 2.4 = 150.0 TiB.
    need = fsx_need(state_bytes=70e9 * 16, seconds=30.0, label="sync")
    assert need.throughput_gbps == pytest.approx(37.333, rel=1e-4)
    assert need.capacity_tib[250] == pytest.approx(150.0)
    assert need.capacity_tib[1000] == pytest.approx(39.6)
    assert fsx_capacity_tib(throughput_mbps=100.0, tier_mbps_per_tib=125) == 1.2
    assert fsx_capacity_tib(throughput_mbps=3.6 * 250, tier_mbps_per_tib=250) == pytest.approx(3.6)


def test_bench_defaults_read_results_or_fall_back(tmp_path: Path) -> None:
    stall, restart, sources = bench_defaults(bench_dir=tmp_path / "none")
    assert stall == BUILTIN_CKPT_STALL_S and restart == BUILTIN_RESTART_S
    assert set(sources.values()) == {"built-in"}
    (tmp_path / "checkpoint.json").write_text(json.dumps({"nvrx_async_blocking_s": 1.5}))
    (tmp_path / "restart.json").write_text(json.dumps({"inprocess_p50_s": 12.0, "cold_p50_s": -1}))
    stall, restart, sources = bench_defaults(bench_dir=tmp_path)
    assert stall == 1.5 and "checkpoint.json" in sources["ckpt_stall_s"]
    assert restart == {"inprocess": 12.0, "injob": BUILTIN_RESTART_S["injob"], "cold": 600.0}
    assert "restart.json" in sources["restart_s.inprocess"]
    assert sources["restart_s.cold"] == "built-in"  # a non-positive value is ignored
    (tmp_path / "restart.json").write_text("{not json")
    assert bench_defaults(bench_dir=tmp_path)[1] == BUILTIN_RESTART_S


def test_format_params() -> None:
    assert (format_params(70e9), format_params(1.5e12), format_params(125e6)) == (
        "70B",
        "1.5T",
        "125M",
    )


def test_cli_prints_tables_and_writes_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "restart.json").write_text(json.dumps({"injob_p50_s": 77.0}))
    out = tmp_path / "p.png"
    argv = ["--gpus", "1024,8192", "--trials", "50", "--bench-dir", str(bench), "--out", str(out)]
    assert main([*argv, "--failure-rate", "llama3,5", "--restart-s", "cold=300"]) == 0
    text = capsys.readouterr().out
    assert "restart injob     77 s" in text and "restart.json injob_p50_s" in text
    assert "restart cold      300 s  [--restart-s]" in text
    assert "checkpoint stall 3 s  [built-in]" in text
    assert "Optimal checkpoint interval" in text and "FSx for Lustre" in text
    assert " 5 " in text.split("Expected ETTR")[1]  # the numeric failure rate is a row label
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    assert (w, h) == (1000, 600)


def test_cli_single_restart_value_replaces_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--gpus", "1024", "--trials", "10", "--restart-s", "45", "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "custom" in text and "inprocess" not in text


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--params", "-1"], "--params"),
        (["--params", "big"], "--params"),
        (["--gpus", "1024,abc"], "--gpus"),
        (["--gpus", "0"], "--gpus"),
        (["--failure-rate", "llama4"], "--failure-rate"),
        (["--restart-s", "warm=3"], "--restart-s"),
        (["--restart-s", "cold=-3"], "--restart-s"),
        (["--ckpt-stall-s", "nan"], "--ckpt-stall-s"),
        (["--trials", "0"], "--trials"),
        (["--target-stall-s", "0"], "--target-stall-s"),
    ],
)
def test_cli_bad_values_exit_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"argument {flag}" in err
