"""The EKS Job's exact trainer command, run in emulated pods (see tests/pods/emulator.py).

Run: sudo .venv/bin/pytest tests/pods   (root: network and mount namespaces; CI is root)
Emulated because they cannot exist here: the API server and Job controller (emulator.run_job
follows their documented behaviour), the GPU and EFA (CPU sizes through the values the
manifests read).
"""

from __future__ import annotations

import subprocess
import sys

import emulator
import pytest

from manifests import render
from training import exits

reason = emulator.can_run()
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(reason is not None, reason=reason or ""),
    pytest.mark.timeout(600),
]

CPU = {"RECIPE": "debug_cpu", "NPROC_PER_NODE": "2"}
FAST = [
    "--resilience.heartbeat_timeout_s=20",
    "--resilience.initial_heartbeat_timeout_s=120",
    "--resilience.step_section_timeout_s=30",
    "--resilience.checkpoint_section_timeout_s=120",
    "--resilience.join_timeout_s=120",
    "--resilience.stop_timeout_s=10",
    "--parallel.pg_timeout_s=60",
    "--checkpoint.interval=10",
]


def _objects(overlay: str, *, restart: str, train_args: list[str]):
    shared = render.shared_objects(namespace="training", image="img", **render.PLACEHOLDER_FSX)
    _, job = render.job_objects(
        overlay=overlay, namespace="training", image="img", restart=restart, train_args=train_args
    )
    config_map = next(o for o in shared if o["kind"] == "ConfigMap")
    return shared, job, config_map


def _prepare_data(root) -> None:
    """What the Job's init container leaves on FSx (a small corpus, same command)."""
    out = root / "fsx" / "data" / "stdlib"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "prepare",
            "--stdlib",
            "--max-mb",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )


def _final_state(root, job_name: str) -> dict:
    import json

    commit = sorted((root / "fsx" / "checkpoints" / job_name).glob("step_*/commit.json"))
    return json.loads(commit[-1].read_text()) if commit else {}


@pytest.fixture
def pods(tmp_path):
    with emulator.cluster(tmp_path) as c:
        _prepare_data(tmp_path)
        yield c


def _run(pods, overlay, restart, train_args, *, on_start=None, timeout_s=400):
    shared, job, config_map = _objects(overlay, restart=restart, train_args=train_args)
    pods.start_store(shared=shared)
    return emulator.run_job(
        pods,
        job=job,
        config_map=config_map,
        job_uid=emulator.new_job_uid(),
        env_overrides=CPU,
        timeout_s=timeout_s,
        on_start=on_start,
    ), job


def _logs(pods) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(pods.root.glob("*.log")))


@pytest.mark.parametrize("restart", ["injob"])
def test_smoke_overlay_trains_to_the_end_in_one_pod(pods, restart):
    result, job = _run(pods, "smoke", restart, ["--train.steps=20", *FAST])
    assert result.status == "Complete", _logs(pods)
    assert result.exit_codes == {0: [0]}
    events = (pods.root / "fsx" / "runs" / job["metadata"]["name"] / "events.jsonl").read_text()
    assert '"completed"' in events


def test_a_bad_trainer_flag_fails_the_job_at_once(pods):
    shared, job, config_map = _objects("smoke", restart="injob", train_args=["--train.steps=5"])
    job["spec"]["template"]["spec"]["containers"][0]["args"].append("--train.stepz=5")
    pods.start_store(shared=shared)
    result = emulator.run_job(
        pods,
        job=job,
        config_map=config_map,
        job_uid=emulator.new_job_uid(),
        env_overrides=CPU,
        timeout_s=120,
    )
    assert result.status == "Failed" and result.reason == f"PodFailurePolicy: exit {exits.USAGE}"
    assert result.exit_codes == {0: [exits.USAGE]}
