"""How the launchers start the exporter: its command from the run's config (thresholds from the
recipe's `observe` section), one per pod with node 0 reporting the job, and bad settings.

    .venv/bin/pytest tests/observability/test_launch.py -q
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support import free_port

from training.exits import ConfigError
from training.launch import pod
from training.observe.launch import exporter_command, stop_exporter
from training.overrides import build_config


def test_the_thresholds_come_from_the_config(tmp_path: Path) -> None:
    config, _ = build_config(
        [
            f"--run-dir={tmp_path}",
            "--observe.stall_factor=20",
            "--observe.stall_floor_s=90",
            "--checkpoint.interval=25",
            "--restart=injob",
        ]
    )
    command = exporter_command(
        config=config, job="j", node=1, nproc_per_node=8, reporter=False, addr="0.0.0.0", port=1
    )
    assert command[1:3] == ["-m", "training.observe.exporter"]
    for flag in (
        "--stall-factor=20",
        "--stall-floor-s=90",
        "--checkpoint-interval=25",
        "--restart-mode=injob",
        "--node=1",
        "--nproc-per-node=8",
        f"--run-dir={tmp_path}",
    ):
        assert flag in command
    assert "--reporter" not in command


@pytest.mark.parametrize(
    ("flag", "field"),
    [("--observe.stall_factor=1", "observe.stall_factor"), ("--observe.stall_floor_s=0", "floor")],
)
def test_a_bad_observe_setting_names_the_field(flag: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config([flag])
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("index", "reporter"), [("0", True), ("1", False)])
def test_each_pod_starts_one_exporter_and_node_0_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index: str, reporter: bool
) -> None:
    """The pod supervisor's exporter, as the Job's environment (JOB_COMPLETION_INDEX,
    JOB_NAME) and the launcher command (--nproc-per-node) describe the pod."""
    monkeypatch.setenv("JOB_COMPLETION_INDEX", index)
    monkeypatch.setenv("JOB_NAME", "fsdp-smoke")
    monkeypatch.setattr(pod, "METRICS_PORT", free_port())
    command = [
        "ft_launcher",
        "--nproc-per-node=4",
        "-m",
        "training",
        "--",
        "train",
        f"--run-dir={tmp_path}",
    ]
    config, _ = build_config(command[6:])
    process = pod.pod_exporter(command, config)
    assert isinstance(process, subprocess.Popen)
    try:
        args = process.args
        assert f"--node={index}" in args and "--job=fsdp-smoke" in args
        assert "--nproc-per-node=4" in args and "--addr=0.0.0.0" in args
        assert ("--reporter" in args) is reporter
        assert "--final-scrape-wait-s=60" in args
    finally:
        stop_exporter(process, final_scrape=False)
    assert process.returncode is not None
