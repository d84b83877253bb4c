"""Shared fixtures for the whole test suite.

Run everything with ``.venv/bin/pytest`` (or ``make test``); only the trainer tests with
``.venv/bin/pytest tests/training``. Tests marked ``gpu`` are skipped when CUDA is absent.
Helpers (starting jobs, reading metrics and checkpoints) are in ``tests/support.py``.

- ``corpus``: a tiny, learnable byte-token shard directory built once per session with
  ``training.data.prepare`` (repeating word cycles: a small model learns it in a few steps).
- ``torchrun``: the :func:`support.run_torchrun` helper as a fixture.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import REQUIRE_ALL_ENV, node_reason, run_torchrun, skip_or_fail, write_learnable_text

_LEFT_OUT = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires(reason): what the test needs from the machine is missing when reason is set "
        "(support.requires_tool / requires_root): skipped, or failed under TESTS_REQUIRE_ALL=1",
    )


INFRA = Path(__file__).with_name("infra")
"""Imports aws-cdk-lib, whose jsii runtime starts Node.js at import: without Node.js no test
there can even be collected, so the directory is left out, with the reason in the summary."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path != INFRA or os.environ.get(REQUIRE_ALL_ENV) == "1":
        return None
    reason = node_reason()
    if reason is None:
        return None
    config.stash[_LEFT_OUT] = f"tests/infra not collected: {reason}"
    return True


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if _LEFT_OUT in config.stash:
        terminalreporter.write_line(config.stash[_LEFT_OUT], yellow=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A missing tool or privilege skips the test with its one-line reason; in CI
    (``TESTS_REQUIRE_ALL=1``, .ci/run) it fails it: CI runs everything."""
    for mark in item.iter_markers("requires"):
        reason = mark.kwargs.get("reason")
        if reason is None:
            continue
        skip_or_fail(reason)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gpu" in item.keywords for item in items):
        return  # torch is imported only when a gpu test was collected
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shard directory (``meta.json`` + one shard, ~70k byte tokens) of learnable text."""
    from training.data import prepare

    root = tmp_path_factory.mktemp("corpus")
    source = root / "src"
    source.mkdir()
    write_learnable_text(source / "words.txt")
    out = root / "shards"
    prepare(sources=[source], out_dir=out)
    return out


@pytest.fixture(scope="session")
def torchrun():
    """The :func:`run_torchrun` helper as a fixture."""
    return run_torchrun


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group (in-memory store) for the test, destroyed after it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
