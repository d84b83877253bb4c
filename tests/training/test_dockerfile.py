"""The trainer image's versions: pinned once, at the top of training/Dockerfile, and consistent
with each other and with pyproject.toml (torch 2.13.0 from PyPI is a CUDA 13 build, so the base
image's CUDA is 13 and the NCCL wheel torch brings is nvidia-nccl-cu13).

Run: ``.venv/bin/pytest tests/training/test_dockerfile.py`` (text only, no Docker).
"""

from __future__ import annotations

import re
import tomllib

from support import REPO_ROOT
from test_architecture import _import_graph, _modules

DOCKERFILE = (REPO_ROOT / "training" / "Dockerfile").read_text()
TOP = DOCKERFILE.split("\nFROM ", 1)[0]


def _pins() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", TOP, flags=re.M))


def _pyproject_pin(name: str) -> str:
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["train"]
    return next(d.split("==")[1] for d in deps if d.startswith(f"{name}=="))


def test_versions_are_pinned_once_above_the_from_line() -> None:
    pins = _pins()
    assert {"CUDA_VERSION", "TORCH_VERSION", "TORCH_CUDA", "NVRX_VERSION"} <= pins.keys()
    assert "EFA_INSTALLER_VERSION" in pins
    after = DOCKERFILE.split("\nFROM ", 1)[1]
    assert not re.search(r"^ARG \w+=", after, flags=re.M), "a version pinned below FROM"
    from_line = "FROM " + after.splitlines()[0]
    assert "${CUDA_VERSION}" in from_line and not re.search(r":\d", from_line)


def test_image_cuda_matches_the_torch_build() -> None:
    pins = _pins()
    major = pins["CUDA_VERSION"].split(".")[0]
    assert major == "13", "torch 2.13.0 on PyPI is a CUDA 13 build"
    assert pins["TORCH_CUDA"] == f"cu{major}"
    assert "nvidia-nccl-${TORCH_CUDA}" in DOCKERFILE  # the build checks the NCCL wheel


def test_image_runs_the_tested_torch_and_nvrx() -> None:
    pins = _pins()
    assert pins["TORCH_VERSION"] == _pyproject_pin("torch")
    assert pins["NVRX_VERSION"] == _pyproject_pin("nvidia-resiliency-ext")


def test_the_image_holds_what_the_jobs_command_runs() -> None:
    """The Job's containers start in the image's WORKDIR, and every first-party package the
    pod's code imports is in the image (a missing one would fail only on the cluster)."""
    import re

    from manifests import render

    text = DOCKERFILE
    workdirs = re.findall(r"^WORKDIR (\S+)", text, flags=re.M)
    _, job = render.job_objects(overlay="smoke", namespace="ns", image="img")
    spec = job["spec"]["template"]["spec"]
    for container in [*spec["initContainers"], *spec["containers"]]:
        assert container["workingDir"] == workdirs[-1]
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, flags=re.M))
    # The packages the pod's entry points import (whole import closure, lazy imports included).
    graph = _import_graph(_modules())
    seen, todo = set(), ["training.launch.pod", "training.__main__", "training.allreduce_check"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    imported = {module.split(".")[0] for module in seen}
    assert {"training", "facts", "ops"} <= imported
    assert imported <= copied, f"the image lacks {sorted(imported - copied)}"
    assert '".[train,tensorboard]"' in text
