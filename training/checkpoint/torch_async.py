"""torch DCP's ``async_save`` background process (engine ``torch_async``) across in-process
restarts.

torch 2.13 keeps one checkpoint process per trainer process
(``torch/distributed/checkpoint/_async_process_executor.py``, ``_CHECKPOINT_PROCESS``), created
by the first ``async_save`` with a process group of its own for the world of that moment, and
reused by every later save. Kept across an in-process restart it breaks both guarantees the
NVRx worker keeps (``training.checkpoint.nvrx_async``):

- its requests and replies travel untagged on one pipe, FIFO: a save of the failed attempt
  still in it delays the next attempt's saves behind a write whose peers may be gone (its
  collectives then wait for good), and goes on writing into a step directory the next attempt
  sweeps as torn;
- it is created by a collective (``_ProcessGroupInitInfo``: a broadcast on the trainer's group)
  that only ranks *without* one join: a rank that is a fresh process (a spare) would meet its
  peers' next collective instead, and its group spans the old world.

So every rank drops it when an attempt is abandoned (:func:`drop_background_process`): the next
attempt's first save makes a new one on every rank alike, in the new world.
"""

from __future__ import annotations

import contextlib
import logging

from torch.distributed.checkpoint import _async_process_executor as executor

log = logging.getLogger(__name__)


def drop_background_process(*, timeout_s: float = 5.0) -> str:
    """Stop this process's DCP checkpoint process, if any, without a collective. Idle, it
    leaves on torch's own stop message; with a write in flight (never to be committed) it is
    killed after ``timeout_s``. Returns ``"none"``, ``"clean"`` or ``"killed"``."""
    background = executor._CHECKPOINT_PROCESS
    executor._CHECKPOINT_PROCESS = None
    if background is None:
        return "none"
    process = background._save_process
    if process.is_alive():
        with contextlib.suppress(OSError, ValueError):
            background._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process.join(timeout=timeout_s)
    if not process.is_alive():
        return "clean"
    log.warning("DCP's checkpoint process %s was still writing; killing it", process.pid)
    process.kill()
    process.join(timeout=10)
    return "killed"
