"""Tests of the planner's plan and command line (``python -m planner``).

Run: .venv/bin/python -m pytest tests/planner/test_planner_cli.py -q
"""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from facts import fsx as fsx_facts
from planner.cli import build_parser, inputs_from_args, main
from planner.costs import MODES
from planner.plan import ALL_MODES, plan

ROOT = Path(__file__).resolve().parents[2]


def _inputs(*argv: str):
    return inputs_from_args(build_parser().parse_args(["--no-plot", *argv]))


def test_plan_trends() -> None:
    plans = plan(inputs=_inputs("--gpus", "1024,16384,100000"), simulate=False)
    assert [p.job.gpus for p in plans] == [1024, 16384, 100000]
    for rate in ("llama3", "rsc1", "rsc2"):
        for mode in ALL_MODES:
            series = [next(r for r in p.rates if r.rate_name == rate).modes[mode] for p in plans]
            # ETTR falls as the cluster grows; low start-up costs never make it worse.
            for small, big in itertools.pairwise(series):
                assert big.ettr < small.ettr
            assert all(m.ettr_low_startup >= m.ettr for m in series)
    for p in plans:
        for r in p.rates:
            e = {m: r.modes[m].ettr for m in ALL_MODES}
            # Any resilience beats none; nested is at least as good as either layer alone.
            assert e["none"] < min(e["injob"], e["inprocess"])
            assert e["nested"] >= max(e["injob"], e["inprocess"]) - 1e-9
            assert r.best in MODES and r.best != r.runner_up
            for m in ALL_MODES:
                mr = r.modes[m]
                assert mr.interval_s == mr.interval_steps * 10.0
                assert fsx_facts.is_valid_capacity(mr.fsx.capacity_gib)
            # The recommended spare count keeps the chance of finding none below 1%.
            assert r.spares.no_spare_chance < 0.01
            assert r.spares.in_force.origin == "recommended"


def test_fsx_and_interval_are_chosen_together_by_price_per_rate() -> None:
    """The FSx minimises GPU-hours lost + storage price, per failure rate: adding a rate no
    longer changes another rate's rows."""
    alone = plan(inputs=_inputs("--gpus", "16384", "--failure-rate", "llama3"), simulate=False)[
        0
    ].rates[0]
    both = plan(inputs=_inputs("--gpus", "16384", "--failure-rate", "llama3,rsc1"), simulate=False)[
        0
    ].rates[0]
    assert alone.modes["nested"].ettr == both.modes["nested"].ettr
    assert alone.modes["nested"].fsx == both.modes["nested"].fsx
    assert alone.modes["nested"].fsx_near_usd_per_h <= alone.modes["nested"].fsx_usd_per_h
    # The chosen FSx is the cheapest of the options once its lost GPU-hours are counted.
    inputs = _inputs("--gpus", "16384", "--failure-rate", "llama3")
    chosen = alone.modes["nested"]
    for cap, tier in [(4800, 125), (12000, 1000), (chosen.fsx.capacity_gib * 2, 1000)]:
        other = (
            plan(inputs=replace(inputs, fsx_capacity_gib=cap, fsx_tier=tier), simulate=False)[0]
            .rates[0]
            .modes["nested"]
        )
        assert other.cost_usd_per_h >= chosen.cost_usd_per_h - 1e-6


def test_a_given_interval_is_evaluated_as_given() -> None:
    got = plan(
        inputs=_inputs("--gpus", "16384", "--failure-rate", "llama3", "--interval-steps", "100"),
        simulate=False,
    )[0].rates[0]
    best = plan(inputs=_inputs("--gpus", "16384", "--failure-rate", "llama3"), simulate=False)[
        0
    ].rates[0]
    assert all(m.interval_steps == 100 for m in got.modes.values())
    assert got.modes["nested"].ettr < best.modes["nested"].ettr


def test_plan_is_seeded() -> None:
    def mcs(seed: str) -> list:
        plans = plan(
            inputs=_inputs(
                "--gpus", "16384", "--failure-rate", "llama3", "--trials", "20", "--seed", seed
            )
        )
        return [m.mc for p in plans for r in p.rates for m in r.modes.values()]

    assert mcs("3") == mcs("3")
    assert mcs("3") != mcs("4")


def test_hot_spares_and_lemon_exclusion_raise_ettr() -> None:
    def ettr(*argv: str) -> float:
        p = plan(
            inputs=_inputs("--gpus", "100000", "--failure-rate", "llama3", *argv), simulate=False
        )
        return p[0].rates[0].modes["nested"].ettr

    base = ettr("--hot-spares", "0")
    assert ettr("--hot-spares", "8") > base
    assert ettr("--hot-spares", "0", "--lemon-share", "0.3", "--exclude-lemons") > base
    assert ettr("--hot-spares", "0", "--lemon-share", "0.3") == base  # lemons kept
    # A longer spare refill needs more spares for the same 1%.
    quick = plan(
        inputs=_inputs(
            "--gpus", "100000", "--failure-rate", "llama3", "--set", "spare_refill_s=1205"
        ),
        simulate=False,
    )[0].rates[0]
    slow = plan(
        inputs=_inputs(
            "--gpus", "100000", "--failure-rate", "llama3", "--set", "spare_refill_s=86400"
        ),
        simulate=False,
    )[0].rates[0]
    assert slow.spares.recommended > quick.spares.recommended


def test_answer_comes_first_with_the_four_decisions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.png"
    argv = ["--gpus", "16384,100000", "--failure-rate", "llama3", "--trials", "10"]
    assert main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    answer = text.split("ANSWER")[1].split("ETTR per mode")[0]
    for gpus in ("16,384 GPUs, llama3", "100,000 GPUs, llama3"):
        block = answer.split(gpus)[1][:1500]
        for needle in (
            "  mode      ",
            "Monte Carlo p5",
            " pt over ",
            "--checkpoint.interval=",
            "hot spares (recommended",
            "P(no spare)",
            "$",
            "cdk deploy -c fsxStorageCapacityGiB=",
            "-c fsxThroughputPerUnit=",
            "  dominant  ",
        ):
            assert needle in block, (gpus, needle)
    # At 100k the start-up range is wide and NCCL start-up dominates.
    big = answer.split("100,000 GPUs, llama3")[1]
    assert "over NCCL/rendezvous start-up" in big
    assert "NCCL init" in big.split("dominant")[1].splitlines()[0]
    assert "NOT SHIPPED" in text
    assert "Cost terms" not in text  # the full tables are one flag away
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1300, 550)


def test_brief_and_full(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "16384", "--failure-rate", "llama3", "--trials", "5", "--no-plot"]
    assert main([*argv, "--brief"]) == 0
    brief = capsys.readouterr().out
    assert "ANSWER" in brief and "ETTR per mode" not in brief
    assert len(brief.splitlines()) < 22
    assert main([*argv, "--full"]) == 0
    text = capsys.readouterr().out
    terms = text.split("Cost terms")[1].split("Recovery R")[0]
    for label, source in [
        ("NCCL init at N ranks", "ncclx"),
        ("rendezvous / TCPStore at N", "tcpstore"),
        ("checkpoint load from FSx", "fsx"),
        ("node replacement, GPU fault", "eks-repair"),
        ("node replacement, host fault", "fencer"),
        ("in-process store barrier", "nvrx-latency"),
        ("start worker processes", "estimate*"),
        ("hot spare refill", "estimate*"),
    ]:
        line = next(x for x in terms.splitlines() if label in x)
        assert source in line, label
    assert "Hot spares: chance" in text and "[prices]" in text and "[erlang]" in text


def _bench_results(directory: Path) -> Path:
    """A `make bench` results directory holding the CPU measurements `--costs measured-cpu`
    reads."""
    (directory / "checkpoint.json").write_text(json.dumps({"nvrx_async_blocking_s": 0.41}))
    (directory / "restart.json").write_text(
        json.dumps({"inprocess_p50_s": 6.9, "injob_p50_s": 16.3, "cold_p50_s": 14.1})
    )
    return directory


def test_measured_cpu_costs_are_selectable_and_labelled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Selected, they are labelled; never the default: test_module_entry_point_runs runs the
    default with the same results directory and finds no measured cost in its answer."""
    bench = _bench_results(tmp_path)
    argv = ["--gpus", "1024", "--trials", "5", "--no-plot", "--bench-dir", str(bench)]
    assert main([*argv, "--costs", "measured-cpu"]) == 0
    text = capsys.readouterr().out
    assert "cost model: measured-cpu" in text
    assert "MEASURED ON A 2-CORE CPU" in text and "restart.json injob_p50_s" in text


def test_given_fsx_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "16384", "--trials", "5", "--no-plot", "--failure-rate", "llama3"]
    assert main([*argv, "--fsx-capacity-gib", "4800", "--fsx-tier", "250"]) == 0
    text = capsys.readouterr().out
    assert "-c fsxStorageCapacityGiB=4800 -c fsxThroughputPerUnit=250" in text
    # 1.2 GB/s writes 840 GB in 717 s: the commit lag is shown and the interval covers it.
    assert "commits 717 s after its stall" in text
    assert main([*argv, "--full", "--set", "image_pull_s=30,node_boot_s=120,write_drag=0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "node replacement" in x)
    assert "755.0" in line and "override" in line


def test_list_costs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list-costs"]) == 0
    text = capsys.readouterr().out
    assert "nccl_init_s_at_96k" in text and "[ncclx]" in text


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--params", "-1"], "argument --params"),
        (["--params", "big"], "argument --params"),
        (["--gpus", "1024,abc"], "argument --gpus"),
        (["--gpus", "0"], "argument --gpus"),
        (["--failure-rate", "llama4"], "argument --failure-rate"),
        (["--hardware-share", "1.2"], "argument --hardware-share"),
        (["--hot-spares", "-2"], "argument --hot-spares"),
        (["--costs", "gpu"], "argument --costs"),
        (["--set", "warp_s=3"], "argument --set"),
        (["--set", "image_pull_s=-3"], "argument --set"),
        (["--set", "write_drag=1.5"], "argument --set"),
        (["--interval-steps", "0"], "argument --interval-steps"),
        (["--recipe", "p5_1t"], "argument --recipe"),
        (["--trials", "0"], "argument --trials"),
        (["--fsx-capacity-gib", "3686", "--fsx-tier", "250"], "not a PERSISTENT_2 size"),
        (["--fsx-capacity-gib", "4800"], "go together"),
        (["--fsx-capacity-gib", "4800", "--fsx-tier", "300"], "is not offered"),
        (["--costs", "measured-cpu", "--bench-dir", "/nonexistent"], "make bench"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--no-plot", "--trials", "5"] if "--trials" not in argv else argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert needle in err and err.startswith("python -m planner: error:")


def test_module_entry_point_runs(tmp_path: Path) -> None:
    """`python -m planner`, the default cost model even where `make bench` left CPU
    measurements (`--costs measured-cpu` is never the default). One rate and the brief answer:
    the entry point is what this run pins (the default report's three rates and the overlays'
    plans are a minute of CPU here; the in-process tests above print them)."""
    bench = _bench_results(tmp_path)
    argv = ["--gpus", "1024", "--trials", "3", "--no-plot", "--bench-dir", str(bench)]
    argv += ["--failure-rate", "llama3", "--brief"]
    done = subprocess.run(
        [sys.executable, "-m", "planner", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "cost model: cluster" in done.stdout
    assert "MEASURED" not in done.stdout  # never the default


def test_recipe_sets_params_and_step_time_from_facts() -> None:
    from facts.recipes import RECIPES

    inputs = _inputs("--recipe", "p5_70b", "--gpus", "128")
    assert inputs.params == RECIPES["p5_70b"].params
    assert inputs.step_time_s == pytest.approx(RECIPES["p5_70b"].step_time_s)
