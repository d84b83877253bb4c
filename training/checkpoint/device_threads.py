"""Background threads that may touch CUDA, bound to the rank's GPU first.

A new thread's current CUDA device is 0, whatever the thread that started it set: the CUDA
runtime keeps the current device per thread. Its first CUDA call (an event's synchronize, a
``cudaHostRegister``, a pinned allocation) then binds device 0's primary context to the thread,
and creates that context if the process has none there: on local ranks 1-7, a stray context of
several hundred MB on GPU 0 per rank. torch's own pin-memory thread calls
``torch.cuda.set_device`` first for this reason (``torch/utils/data/_utils/pin_memory.py``), and
so does every thread here (the NVRx worker process binds its device the same way,
``nvrx_async._bind_worker``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


def current_device() -> int | None:
    """The calling thread's CUDA device, for a thread it starts; None when CUDA is not in use
    in this process (nothing to bind, and no context to create by asking)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def device_index(device: torch.device | int | None) -> int | None:
    """The CUDA index of ``device`` (None for the CPU or None)."""
    if device is None or isinstance(device, int):
        return device
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def start(
    target: Callable[..., Any],
    *,
    name: str,
    device: int | None,
    args: tuple = (),
) -> threading.Thread:
    """Start a daemon thread that sets ``device`` as its CUDA device (when not None) before it
    runs ``target(*args)``."""

    def run() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
