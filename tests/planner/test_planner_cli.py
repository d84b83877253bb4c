"""Tests of the planner's plan and command line (``python -m planner``).

Run: .venv/bin/python -m pytest tests/planner/test_cli.py -q
"""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from facts import fsx as fsx_facts
from planner.cli import build_parser, inputs_from_args, main
from planner.costs import MODES
from planner.plan import plan

ROOT = Path(__file__).resolve().parents[2]


def _inputs(*argv: str):
    return inputs_from_args(build_parser().parse_args(["--no-plot", *argv]))


def test_plan_trends() -> None:
    plans = plan(inputs=_inputs("--trials", "60"))
    sizes = [p.job.gpus for p in plans]
    assert sizes == [1024, 4096, 16384, 65536, 100000]
    for rate in ("llama3", "rsc1", "rsc2"):
        for mode in MODES:
            series = [next(r for r in p.rates if r.rate_name == rate).modes[mode] for p in plans]
            # ETTR falls as the cluster grows, by formula and by simulation.
            for small, big in itertools.pairwise(series):
                assert big.ettr_formula < small.ettr_formula
                assert big.mc.mean < small.mc.mean
    for p in plans:
        for r in p.rates:
            e = {m: r.modes[m].ettr_formula for m in MODES}
            # Any resilience beats none; nested is at least as good as either layer alone.
            assert e["none"] < min(e["injob"], e["inprocess"])
            assert e["nested"] >= max(e["injob"], e["inprocess"]) - 1e-12
            assert r.interval_s == r.interval_steps * 10.0
            # The sized FSx writes a checkpoint within every interval it plans.
            assert p.terms["ckpt_write_s"].seconds <= r.interval_s * (1 + 1e-9)
        assert fsx_facts.is_valid_capacity(p.fsx.capacity_gib)


def test_plan_is_seeded() -> None:
    def mcs(seed: str) -> list:
        plans = plan(inputs=_inputs("--gpus", "16384", "--trials", "30", "--seed", seed))
        return [m.mc for p in plans for r in p.rates for m in r.modes.values()]

    assert mcs("3") == mcs("3")
    assert mcs("3") != mcs("4")


def test_hot_spares_and_lemon_exclusion_raise_ettr() -> None:
    def ettr(*argv: str) -> float:
        p = plan(
            inputs=_inputs("--gpus", "100000", "--failure-rate", "llama3", "--trials", "5", *argv)
        )
        return p[0].rates[0].modes["nested"].ettr_formula

    base = ettr()
    assert ettr("--hot-spares", "8") > base
    assert ettr("--lemon-share", "0.3", "--exclude-lemons") > base
    assert ettr("--lemon-share", "0.3") == base  # lemons kept: same failures


def test_output_at_16k_and_100k_shows_terms_sources_modes_and_fsx(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.png"
    assert main(["--gpus", "16384,100000", "--trials", "20", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cost model: cluster" in text
    terms = text.split("Cost terms")[1].split("Recovery R")[0]
    assert "16384" in terms and "100000" in terms
    for label, source in [
        ("NCCL init at N ranks", "ncclx"),
        ("rendezvous / TCPStore at N", "tcpstore"),
        ("checkpoint load from FSx", "fsx"),
        ("node replacement (+image)", "eks-repair"),
        ("in-process store barrier", "nvrx-latency"),
        ("start worker processes", "estimate*"),
    ]:
        line = next(x for x in terms.splitlines() if label in x)
        assert line.rstrip().endswith(source) or source in line
    ettr = text.split("ETTR: formula")[1].split("FSx for Lustre")[0]
    for mode in MODES:
        assert mode in ettr
    assert ettr.count("%") == 2 * 3 * 4 * 2  # 2 sizes x 3 rates x 4 modes, formula and MC
    fsx = text.split("FSx for Lustre")[1].split("Sources")[0]
    for line in (x for x in fsx.splitlines() if "-c fsxStorageCapacityGiB=" in x):
        cap = int(line.split("fsxStorageCapacityGiB=")[1].split()[0])
        tier = int(line.split("fsxThroughputPerUnit=")[1].split()[0])
        assert fsx_facts.is_valid_capacity(cap)
        assert tier in fsx_facts.THROUGHPUT_TIERS_MBPS_PER_TIB
    assert "[llama3] Dubey et al." in text and "[ncclx]" in text
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1300, 550)


def test_measured_cpu_costs_are_selectable_and_labelled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "checkpoint.json").write_text(json.dumps({"nvrx_async_blocking_s": 0.41}))
    (tmp_path / "restart.json").write_text(
        json.dumps({"inprocess_p50_s": 6.9, "injob_p50_s": 16.3, "cold_p50_s": 14.1})
    )
    argv = ["--gpus", "1024", "--trials", "5", "--no-plot", "--bench-dir", str(tmp_path)]
    assert main([*argv, "--costs", "measured-cpu"]) == 0
    text = capsys.readouterr().out
    assert "cost model: measured-cpu" in text
    assert "MEASURED ON A 2-CORE CPU" in text and "restart.json injob_p50_s" in text
    assert main(argv) == 0
    assert "MEASURED" not in capsys.readouterr().out  # never the default


def test_given_fsx_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "16384", "--trials", "5", "--no-plot", "--failure-rate", "llama3"]
    assert main([*argv, "--fsx-capacity-gib", "4800", "--fsx-tier", "250"]) == 0
    text = capsys.readouterr().out
    assert "-c fsxStorageCapacityGiB=4800 -c fsxThroughputPerUnit=250" in text
    assert "! interval lengthened" in text  # 1.2 GB/s cannot write 840 GB within Daly's interval
    assert main([*argv, "--set", "image_pull_s=30,node_boot_s=120"]) == 0
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


def test_module_entry_point_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "planner", "--gpus", "1024", "--trials", "3", "--no-plot"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "cost model: cluster" in done.stdout
