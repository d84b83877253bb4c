"""Shared fixtures for the whole test suite.

Run everything with ``.venv/bin/pytest`` (or ``make test``); only the trainer tests with
``.venv/bin/pytest tests/training``. Tests marked ``gpu`` are skipped when CUDA is absent.
Helpers (starting jobs, reading metrics and checkpoints) are in ``tests/support.py``.

- ``corpus``: a tiny, learnable byte-token shard directory built once per session with
  ``training.data.prepare`` (repeating word cycles: a small model learns it in a few steps).
- ``torchrun``: the :func:`support.run_torchrun` helper as a fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import run_torchrun, write_learnable_text


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
