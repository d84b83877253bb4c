"""A run's final state read back from its newest committed checkpoint, and the bit-identity
check every fault scenario ends with (tests and benchmarks compare runs with it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def committed_checkpoints(run_dir: Path, *, root: Path | None = None) -> list[Path]:
    """Committed checkpoints under `root` (default ``<run_dir>/checkpoints``), oldest first."""
    root = run_dir / "checkpoints" if root is None else root
    return sorted(p for p in root.glob("step_*") if (p / "commit.json").is_file())


def final_state(run_dir: Path, *, checkpoint_root: Path | None = None) -> dict[str, Any]:
    """The newest committed checkpoint as one flat dict (``trainer.model....`` keys)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoints = committed_checkpoints(run_dir, root=checkpoint_root)
    assert checkpoints, f"no committed checkpoint for {run_dir}"
    out = run_dir / "final_state.pt"
    dcp_to_torch_save(checkpoints[-1], out)
    return flatten(torch.load(out, weights_only=False))


def assert_identical(state: dict[str, Any], reference: dict[str, Any], *, steps: int) -> None:
    """Bit-identical final states: every tensor (model and optimizer) `torch.equal`."""
    import torch

    assert state.keys() == reference.keys()
    tensors = [k for k, v in reference.items() if isinstance(v, torch.Tensor)]
    assert any(".optim." in k for k in tensors), "optimizer state must be part of the check"
    different = [k for k in tensors if not torch.equal(state[k], reference[k])]
    assert different == [], f"{len(different)} tensors differ, e.g. {different[:3]}"
    assert state["trainer.step"] == reference["trainer.step"] == steps


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    if isinstance(tree, list | tuple):
        flat = {}
        for index, value in enumerate(tree):
            flat.update(flatten(value, f"{prefix}{index}."))
        return flat
    return {prefix[:-1]: tree}
