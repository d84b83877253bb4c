"""NVRx local checkpoints on the node's NVMe (GPU only).

A second, faster tier beside the shared (FSx) checkpoints: every ``checkpoint.local_interval``
steps each rank writes its own shard to ``checkpoint.local_dir`` (the instance-store NVMe RAID0,
``/scratch`` in the pods) through NVRx's ``LocalCheckpointManager``, asynchronously on the same
NVRx queue as the shared checkpoints. On restart, when every rank still has a local checkpoint
newer than the newest committed shared one (in-process restart, or in-job restart on the same
nodes), it is loaded instead: no read from shared storage. A replaced node has none, so NVRx's
``find_latest`` (which needs every rank's shard) falls back to the shared checkpoint.

NVRx's ``BasicTensorAwareStateDict`` accepts CUDA tensors only, so this tier exists only on GPU;
asking for it on CPU is a configuration error. Local shards hold this rank's DTensor shards
(``to_local``) and are only valid for the same world size and sharding, which NVRx checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from training.config import ConfigError


def _to_local_cuda(tree: Any, specs: dict[str, tuple], prefix: str = "") -> Any:
    """DTensors -> their local CUDA shards (spec remembered); CPU tensors -> CUDA copies."""
    if isinstance(tree, dict):
        return {k: _to_local_cuda(v, specs, f"{prefix}{k}/") for k, v in tree.items()}
    if isinstance(tree, DTensor):
        specs[prefix] = (tree.device_mesh, tree.placements, tree.shape, tree.stride())
        return tree.to_local()
    if isinstance(tree, torch.Tensor):
        specs[prefix] = ("cpu",) if tree.device.type == "cpu" else ("plain",)
        return tree.cuda() if tree.device.type == "cpu" else tree
    return tree


def _from_local(tree: Any, specs: dict[str, tuple], prefix: str = "") -> Any:
    if isinstance(tree, dict):
        return {k: _from_local(v, specs, f"{prefix}{k}/") for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        spec = specs[prefix]
        if spec[0] == "cpu":
            return tree.cpu()
        if spec[0] == "plain":
            return tree
        mesh, placements, shape, stride = spec
        return DTensor.from_local(
            tree, mesh, placements, shape=shape, stride=stride, run_check=False
        )
    return tree


class LocalCheckpoints:
    """Per-rank checkpoints on node-local storage through NVRx (GPU only)."""

    def __init__(self, *, root: Path, session_id: str) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(
                "checkpoint.local_dir",
                "NVRx local checkpoints need CUDA tensors; leave it empty on CPU",
            )
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )

        self._manager = LocalCheckpointManager(str(root), session_id=session_id)

    def save_request(self, trainer, *, step: int):
        """Stage this rank's shard (device-to-host copy) and return NVRx's ``AsyncRequest``
        for the persistent worker to write."""
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
            BasicTensorAwareStateDict,
        )

        specs: dict[str, tuple] = {}
        local_state = _to_local_cuda(trainer.state_dict(), specs)
        return self._manager.save(BasicTensorAwareStateDict(local_state), step, is_async=True)

    def latest_step(self) -> int | None:
        """Newest step every rank has locally (collective); None when there is none."""
        step = self._manager.find_latest()
        return step if step >= 0 else None

    def load_into(self, trainer) -> int:
        """Load the newest complete local checkpoint into ``trainer`` (collective)."""
        specs: dict[str, tuple] = {}
        _to_local_cuda(trainer.state_dict(), specs)  # the DTensor layout to rebuild
        tensor_aware, _ckpt_id = self._manager.load()
        tensor_aware.restore_tensor_device(non_blocking=False)
        trainer.load_state_dict(_from_local(tensor_aware.state_dict, specs))
        return int(trainer.step)
