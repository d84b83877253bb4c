"""`make deploy` keeps the GPU node count `make gpu-nodes` set, so a plain deploy never scales
running p5 nodes back to cdk.json's 0. Dry runs (`make -n`): nothing is deployed.

Run: .venv/bin/pytest tests/infra/test_make_deploy.py
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from support import REPO_ROOT


def _dry_run(target: str, *variables: str) -> str:
    return subprocess.run(
        ["make", "-n", "--no-print-directory", target, *variables],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_deploy_passes_the_remembered_gpu_node_count(tmp_path: Path) -> None:
    remembered = tmp_path / "gpu-nodes"
    assert "gpuNodesDesired" not in _dry_run("deploy", f"GPU_NODES_FILE={remembered}")
    remembered.write_text("2\n")
    assert "-c gpuNodesDesired=2" in _dry_run("deploy", f"GPU_NODES_FILE={remembered}")


def test_gpu_nodes_refuses_a_count_that_is_not_a_number() -> None:
    proc = subprocess.run(
        ["make", "--no-print-directory", "gpu-nodes", "NODES=two", "GPU_NODES_FILE=/dev/null"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "NODES: give the GPU node count" in proc.stderr


def test_gpu_nodes_of_an_overlay_are_its_nodes_and_hot_spares() -> None:
    """`make gpu-nodes OVERLAY=2node` asks for the overlay's training nodes plus its spares
    (manifests/sizes.py's node_count); NODES, when given, wins."""
    from manifests.sizes import SIZES

    size = SIZES["2node"]
    assert size.spares >= 1
    out = _dry_run("gpu-nodes", "OVERLAY=2node", "GPU_NODES_FILE=/dev/null")
    assert f"-c gpuNodesDesired={size.nodes + size.spares} " in out
    assert "-c gpuNodesDesired=5 " in _dry_run("gpu-nodes", "OVERLAY=2node", "NODES=5")
