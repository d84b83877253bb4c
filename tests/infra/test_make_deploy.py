"""The Makefile's deploy targets keep no local state: every deploy reads the deployed stack back
(app.py, infra/deployed.py). Dry runs (`make -n`): nothing is deployed.

Run: .venv/bin/pytest tests/infra/test_make_deploy.py
"""

from __future__ import annotations

import subprocess

from support import REPO_ROOT

STATE_FILES = (".gpu-nodes", ".first-deploy", ".last-deploy")


def _dry_run(target: str, *variables: str) -> str:
    return subprocess.run(
        ["make", "-n", "--no-print-directory", target, *variables],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_deploy_reads_the_deployed_stack_and_keeps_no_local_state() -> None:
    out = _dry_run("deploy", "ARGS=-c x=1")
    line = next(x for x in out.splitlines() if " deploy " in x)
    # Refuses when the deployed stack cannot be read; ARGS last (the CLI keeps the last -c).
    assert line.index("-c deployCheck=required") < line.index("-c x=1")
    infrastructure = (REPO_ROOT / "Makefile").read_text().split("# --- infrastructure")[1]
    infrastructure = infrastructure.split("# --- quality")[0]
    for name in STATE_FILES:
        assert name not in infrastructure


def test_gpu_nodes_refuses_a_count_that_is_not_a_number() -> None:
    proc = subprocess.run(
        ["make", "--no-print-directory", "gpu-nodes", "NODES=two"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "NODES: give the GPU node count" in proc.stderr


def test_gpu_nodes_is_a_deploy_with_the_overlay() -> None:
    """`make gpu-nodes OVERLAY=2node` deploys with the overlay (infra/config.py sizes the group
    to its nodes + hot spares from manifests/sizes.py); NODES=N is the override."""
    out = _dry_run("gpu-nodes", "OVERLAY=2node")
    assert "-c overlay=2node " in out and "-c deployCheck=required" in out
    assert "-c gpuNodesDesired" not in out
    pinned = _dry_run("gpu-nodes", "OVERLAY=2node", "NODES=5")
    assert "-c gpuNodesDesired=5 " in pinned and "-c overlay" not in pinned


def test_destroy_says_what_it_keeps() -> None:
    out = _dry_run("destroy")
    assert "-c deployCheck=destroy" in out
    assert "cdk.out/retained.txt" in out
