"""Host staging for NVRx saves of CPU state: one shared-memory buffer per rank, laid out once
per save plan and reused by every warm save, so that a warm save's blocking part is one copy
of the shard into memory that is already mapped (no allocation, no page faults), and the
request to the worker carries one file descriptor instead of one per tensor.

The worker turns each slot back into a tensor with a storage of its own (``torch.frombuffer``
over the mapped buffer): ``torch.save``, which DCP writes every tensor with, saves a tensor's
whole storage, so a plain view of the big buffer would write all of it each time.

Also the save's structure key: what a cached save plan depends on (paths, tensor types,
dtypes, shapes, DTensor placements and meshes). A change on any rank invalidates the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64  # bytes: every slot starts cache-line aligned


@dataclass(frozen=True, kw_only=True)
class Slot:
    """Where one tensor of a write bucket lies in the staging buffer."""

    offset: int
    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def structure_key(state: Any, prefix: str = "") -> tuple:
    """Everything about ``state`` a DCP save plan depends on; values excluded."""
    if isinstance(state, dict):
        keys = sorted(state, key=str)
        return tuple(item for k in keys for item in _key(state[k], f"{prefix}{k}."))
    if isinstance(state, list | tuple):
        return tuple(item for i, v in enumerate(state) for item in _key(v, f"{prefix}{i}."))
    return _key(state, prefix)


def _key(value: Any, path: str) -> tuple:
    if isinstance(value, dict | list | tuple):
        return structure_key(value, path)
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        layout: tuple = ()
        if hasattr(value, "placements"):
            layout = (str(value.placements), tuple(value.device_mesh.mesh.flatten().tolist()))
        shapes = (tuple(value.shape), tuple(local.shape))
        return ((path, type(value).__name__, str(value.dtype), *shapes, *layout),)
    return ((path, type(value).__name__),)


class HostStaging:
    """The persistent staging buffer of one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self._slots: list[list[Slot]] | None = None

    def reset(self) -> None:
        """The plan changed: lay the buffer out again at the next save."""
        self.buffer = None
        self._slots = None

    def stage(self, buckets: list) -> list:
        """Copy every tensor of NVRx's write buckets into its slot; returns the buckets with
        :class:`Slot` in place of each tensor. The copy is complete when this returns: the
        trainer may change its tensors from then on."""
        if self._slots is None:
            self._lay_out(buckets)
        assert self.buffer is not None and self._slots is not None
        staged = []
        for (path, key, (bytes_data, tensor_data)), slots in zip(buckets, self._slots, strict=True):
            for (_, tensor), slot in zip(tensor_data, slots, strict=True):
                _view(self.buffer, slot).copy_(tensor.detach())
            items = [(item, slot) for (item, _), slot in zip(tensor_data, slots, strict=True)]
            staged.append((path, key, (bytes_data, items)))
        return staged

    def _lay_out(self, buckets: list) -> None:
        offset = 0
        layout = []
        for _, _, (_, tensor_data) in buckets:
            slots = []
            for _, tensor in tensor_data:
                slots.append(
                    Slot(
                        offset=offset,
                        numel=tensor.numel(),
                        dtype=tensor.dtype,
                        shape=tuple(tensor.shape),
                    )
                )
                offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
            layout.append(slots)
        # share_memory_ on an empty tensor maps fresh shared memory (no copy of anything)
        self.buffer = torch.empty(max(offset, ALIGN), dtype=torch.uint8).share_memory_()
        self._slots = layout


def _view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    nbytes = slot.numel * slot.dtype.itemsize
    return buffer[slot.offset : slot.offset + nbytes].view(slot.dtype).view(slot.shape)


def unstage(buckets: list, buffer: torch.Tensor) -> list:
    """In the worker: tensors for :class:`Slot` entries, each on a storage of its own that is
    a window of ``buffer`` (``torch.frombuffer`` shares the memory, copies nothing)."""
    raw = memoryview(buffer.numpy()).cast("B")
    out = []
    for path, key, (bytes_data, items) in buckets:
        tensors = [
            (
                item,
                torch.frombuffer(raw, dtype=slot.dtype, count=slot.numel, offset=slot.offset).view(
                    slot.shape
                )
                if slot.numel
                else torch.empty(slot.shape, dtype=slot.dtype),
            )
            for item, slot in items
        ]
        out.append((path, key, (bytes_data, tensors)))
    return out
