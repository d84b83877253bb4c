"""The fault-free reference of the replica fault tests, run once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from replica_runs import start, wait
from support import final_state


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict:
    """Group 0's final model and optimizer state of a fault-free run (every group ends with
    the same state: the fault tests compare both groups with it)."""
    reference_dir = tmp_path_factory.mktemp("reference") / "run"
    proc, log = start(reference_dir, corpus)
    wait(proc, log, timeout=400)
    return final_state(reference_dir / "group-0")
